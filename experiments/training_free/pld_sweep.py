"""Prompt lookup's copy length on this CPU: autoregressive against PromptLookup(3, k) for several k,
with the timing protocol of every benchmark here (specjax.bench.run_cases: the methods in turn on
each prompt, autoregressive runs around them, compile excluded), in one process. The evidence
behind the registry's default (`specjax.methods.defaults.lookup_tokens`: the longest copy whose
verification costs at most 1.15 one-token forwards on the device's cost curve).

    .venv/bin/python experiments/training_free/pld_sweep.py [--tokens 2,4,6,10] [--max-new 64]

Chat (MT-Bench), copy-heavy chat (Spec-Bench summarization, RAG) and code (HumanEval), greedy,
batch 1, fixed-length generation. Writes pld_sweep.json (per-prompt records, the cost curve and
the default chosen from it) and pld_sweep.md beside this script.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, ROOT)

import specjax as sj  # noqa: E402
from specjax import bench, calibrate, methods  # noqa: E402

SETS = (("spec_bench:mt_bench", 3), ("spec_bench:summarization", 2), ("humaneval", 2),
        ("spec_bench:rag", 1))


def sweep(model, variants: dict, name: str, chosen: str, max_new: int, out: str) -> dict:
  """Autoregressive and `variants` (label -> method) on SETS in one process (bench.run_cases);
  writes <name>.json (per-prompt records, the cost curve, `chosen`: the registry's default here)
  and <name>.md beside each other in `out`, and returns the data."""
  info, t0 = bench.machine_info(), time.time()
  cases = []
  for spec, n in SETS:
    ps, chat = bench.load_prompt_set(spec, n)
    cases += [bench.Case([p], chat, spec.split(":")[-1]) for p in ps]
  ms = {"autoregressive": sj.Autoregressive(), **variants}
  records = bench.rescore(bench.run_cases(model, cases, ms, max_new_tokens=max_new,
                                          progress=False))
  summary = bench.summarize(records)
  data = {"info": bench.finish_machine_info(info, t0), "max_new_tokens": max_new,
          "cost_curve": calibrate.cost_curve(model), "default": chosen,
          "summary": summary, "records": records}
  with open(os.path.join(out, f"{name}.json"), "w") as f:
    json.dump(data, f, indent=1, default=str)
  groups = [s.split(":")[-1] for s, _ in SETS] + ["overall"]
  rows = [{"method": m, **{g: f"{c[g]['speedup']:.2f}x ({c[g]['tau']:.2f})" for g in groups
                           if g in c}} for m, c in summary.items()]
  md = (f"{bench.machine_summary(data['info'])}\n\n`{info['command']}`\n\n"
        f"Speedup over autoregressive (median over prompts), tau in brackets; {max_new} new "
        f"tokens; prompts per set: {', '.join(f'{s} {n}' for s, n in SETS)}. The default on this "
        f"machine's cost curve: {chosen}.\n\n"
        + bench.markdown_table(rows, [("method", "method", "s")] + [(g, g, "s") for g in groups])
        + "\n")
  with open(os.path.join(out, f"{name}.md"), "w") as f:
    f.write(md)
  print(md)
  return data


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--tokens", default="2,4,6,10", help="num_tokens values to time")
  ap.add_argument("--max-new", type=int, default=64)
  ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
  a = ap.parse_args(argv)
  model = sj.load_model("smollm2-135m")
  ks = [int(k) for k in a.tokens.split(",")]
  chosen = methods.build("prompt-lookup", model).num_tokens
  return sweep(model, {f"k={k}": sj.PromptLookup(ngram=3, num_tokens=k) for k in ks},
               "pld_sweep", f"num_tokens = {chosen}", a.max_new, a.out)


if __name__ == "__main__":
  main()
