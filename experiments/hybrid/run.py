"""Hybrid trees and suffix decoding on SmolLM2-135M, this CPU, batch 1, greedy (issue 29).

    .venv/bin/python experiments/hybrid/run.py [--prompts N] [--max-new-tokens T]

In one process, per prompt set (copy-heavy: Spec-Bench summarization and RAG; chat: MT-Bench) and
per prompt, every method runs once to compile and warm up and then once timed, interleaved per
prompt: autoregressive, prompt lookup, EAGLE (the shipped heads, tree from the cost curve), the
registry's hybrid (prompt lookup + the EAGLE heads in one tree, copies scored by their measured
acceptance), the same with copies always first (`hybrid-copies-first`, measured=False) and
prompt lookup + the Medusa heads (`hybrid-medusa`). Reports per set
the median speedup over autoregressive (same prompt, same process), tau (tokens per target call)
and the tokens the hybrid accepted from each drafter; writes results.json beside this file (after each set) with
the command and the machine's load average before and after (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import specjax as sj  # noqa: E402
from specjax import methods as sj_methods  # noqa: E402
from specjax import prompts as sj_prompts  # noqa: E402

SETS = ["spec_bench:summarization", "spec_bench:rag", "mt_bench"]
METHODS = ["autoregressive", "prompt-lookup", "eagle", "hybrid", "hybrid-copies-first",
           "hybrid-medusa"]
HYBRIDS = ("hybrid", "hybrid-copies-first", "hybrid-medusa")


def run(args) -> dict:
  model = sj.load_model("smollm2-135m")
  built = {m: sj_methods.build(m, model) for m in METHODS if m not in HYBRIDS[1:]}
  built["hybrid-copies-first"] = sj_methods.build("hybrid", model, measured=False)
  built["hybrid-medusa"] = sj_methods.build("hybrid", model, heads=sj_methods.shipped("medusa",
                                                                                      model))
  out = {"command": "python experiments/hybrid/run.py " + " ".join(sys.argv[1:]),
         "load_before": os.getloadavg(), "methods": {m: repr(built[m]) for m in METHODS},
         "sets": {}}
  for kind in SETS:
    ps = sj_prompts.load(kind, args.prompts)
    rows = {m: [] for m in METHODS}
    for p in ps:
      ref = None
      for m in METHODS:
        gen = lambda: sj.generate(model, [p], built[m], max_new_tokens=args.max_new_tokens,  # noqa
                                  chat=True, stop_at_eos=False)
        gen()
        t0 = time.perf_counter()
        o = gen()
        wall = time.perf_counter() - t0
        if ref is None:
          ref = o.tokens
        assert o.tokens == ref, f"{m} differs from autoregressive on {kind}"
        rows[m].append(dict(wall=wall, tau=o.stats["mean_accepted"],
                            by=o.stats.get("accepted_by")))
      print(kind, {m: round(rows["autoregressive"][-1]["wall"] / rows[m][-1]["wall"], 2)
                   for m in METHODS}, flush=True)
    summary = {}
    for m in METHODS:
      speed = [a["wall"] / r["wall"] for a, r in zip(rows["autoregressive"], rows[m])]
      summary[m] = dict(speedup=round(statistics.median(speed), 2),
                        tau=round(statistics.median(r["tau"] for r in rows[m]), 2))
    for h in HYBRIDS:
      by = [r["by"] for r in rows[h]]
      summary[h]["accepted_by"] = {k: sum(b[k] for b in by) for k in by[0]}
    out["sets"][kind] = summary
    out["load_after"] = os.getloadavg()
    save(out)
    print(kind, json.dumps(summary), flush=True)
  return out


def save(res: dict) -> None:
  with open(os.path.join(os.path.dirname(__file__), "results.json"), "w") as f:
    json.dump(res, f, indent=1)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--prompts", type=int, default=3)
  ap.add_argument("--max-new-tokens", type=int, default=128)
  args = ap.parse_args()
  print(json.dumps(run(args), indent=1))


if __name__ == "__main__":
  main()
