"""Lookahead's window on this CPU: autoregressive against Lookahead(W, N, G) for the shapes the
registry chooses among (specjax.methods.defaults.LOOKAHEAD_SHAPES), with prompt lookup's sweep
protocol (pld_sweep.sweep: the shared benchmark timing, one process). The evidence behind the
registry's default (`defaults.lookahead_shape`: the largest shape whose one forward costs at most
1.15 one-token forwards on the device's cost curve).

    .venv/bin/python experiments/training_free/lookahead_sweep.py [--max-new 64]

Writes lookahead_sweep.json and lookahead_sweep.md beside this script.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.normpath(os.path.join(HERE, "..", "..")))
sys.path.insert(0, HERE)

import specjax as sj  # noqa: E402
from specjax import methods  # noqa: E402
from specjax.methods import defaults  # noqa: E402

from pld_sweep import sweep  # noqa: E402


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--max-new", type=int, default=64)
  ap.add_argument("--out", default=HERE)
  a = ap.parse_args(argv)
  model = sj.load_model("smollm2-135m")
  m = methods.build("lookahead", model)
  variants = {f"W={w} N={n} G={g} ({1 + (w + g) * (n - 1)} tokens)":
              sj.Lookahead(window=w, ngram=n, guess=g) for w, n, g in defaults.LOOKAHEAD_SHAPES}
  return sweep(model, variants, "lookahead_sweep",
               f"(W, N, G) = ({m.window}, {m.ngram}, {m.guess})", a.max_new, a.out)


if __name__ == "__main__":
  main()
