"""One target forward of T tokens (SmolLM2-135M, batch 1, a cache of 512 slots with 256 filled)
in one arithmetic, timed in this process: milliseconds and c(T) = ms(T) / ms(1).

    .venv/bin/python experiments/kernels/forward_bench.py [--arithmetic w4a8] [--sizes 1,8,16]
        [--reps 31] [--loop 4] [--label NAME]

The timing is the cost curve's own (`specjax.calibrate.measure_seconds`: --loop forwards per
timed call, the sizes interleaved within every rep), medians printed on one line (prefixed by
--label). For an A/B of a kernel edit, run it once per version of the source, alternating,
several rounds: each version builds its own library (the build key hashes the source), so
switching back and forth costs nothing after the first build.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main(argv=None):
  import specjax as sj
  from specjax import bench, calibrate

  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--arithmetic", default="w4a8", choices=sorted(bench.ARITHMETICS))
  ap.add_argument("--sizes", default="1,8,16")
  ap.add_argument("--reps", type=int, default=31)
  ap.add_argument("--label", default="")
  ap.add_argument("--loop", type=int, default=calibrate.LOOP,
                  help="forwards per timed call (default: the cost curve's, calibrate.LOOP)")
  args = ap.parse_args(argv)
  sizes = sorted({1, *(int(x) for x in args.sizes.split(","))})
  model = sj.load_model("smollm2-135m", **bench.ARITHMETICS[args.arithmetic])
  secs = calibrate.measure_seconds(model, sizes, reps=args.reps, loop=args.loop)
  ms = {t: 1e3 * s for t, s in secs.items()}
  print(" ".join([args.label or args.arithmetic, *(f"T={t}: {ms[t]:.2f} ms" for t in sizes),
                  *(f"c({t}) = {ms[t] / ms[1]:.2f}" for t in sizes if t > 1),
                  f"(load {os.getloadavg()[0]:.2f})"]))


if __name__ == "__main__":
  main()
