"""Hybrid trees and suffix decoding on SmolLM2-135M, this CPU, batch 1, greedy (issue 29).

    .venv/bin/python experiments/hybrid/run.py [--prompts N] [--max-new-tokens T] [--repeats R]
                                               [--sets A,B] [--arithmetic float32|blocks|w4a8]
                                               [--out results.json]

In one process, per prompt set (copy-heavy: Spec-Bench summarization and RAG, and code edits
built from HumanEval (`EDIT`); chat: MT-Bench) and per prompt, every method runs once to compile
and warm up and then R times timed (the fastest kept), interleaved per prompt: autoregressive,
prompt lookup, prompt lookup with adaptive copy lengths (`prompt-lookup-adaptive`:
`sj.PromptLookup(adaptive=True)`, up to 10 tokens), EAGLE (the shipped heads, tree from the cost
curve), the registry's hybrid (prompt lookup + the EAGLE heads in one tree, copies scored by
their measured acceptance), the same with copies always first (`hybrid-copies-first`,
measured=False), prompt lookup + the Medusa heads (`hybrid-medusa`) and the registry's hybrid
with suffix decoding beside its two drafters in a tree of the same size (`hybrid-suffix`; the
suffix store holds this call's prompt and output only, remember=False, so that a warm-up run
cannot teach it the answer). --methods picks a subset (autoregressive always runs: it is the
reference). --arithmetic picks the target's (`bench.ARITHMETICS`: float32 by default; w4a8 is the
GGUF's blocks with int8 activations).

Reports per set the median over prompts of the speedup over autoregressive (same prompt, same
process), the same after the first token (each call's time less that of a one-token
autoregressive call on the prompt: the prefill, which every method pays once and which these
sets' long prompts make a large share of a 128-token call), tau (tokens per target call) and the
tokens the hybrid accepted from each drafter. Writes --out beside this file (after each set) with
the command and the machine's load average before and after (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import specjax as sj  # noqa: E402
from specjax import bench  # noqa: E402
from specjax import methods as sj_methods  # noqa: E402
from specjax import prompts as sj_prompts  # noqa: E402

SETS = ["spec_bench:summarization", "spec_bench:rag", "code_edit", "mt_bench"]
METHODS = ["autoregressive", "prompt-lookup", "prompt-lookup-adaptive", "eagle", "hybrid",
           "hybrid-copies-first", "hybrid-medusa", "hybrid-suffix"]
HYBRIDS = ("hybrid", "hybrid-copies-first", "hybrid-medusa", "hybrid-suffix")
# A code edit (issue 29's other copy-heavy kind; no such set ships with the shared prompts): a
# HumanEval function with its reference body, and an instruction to return it with one change,
# so that the answer copies most of its prompt.
EDIT = ("Rename the function `{name}` to `solution` in the following Python code, and change "
        "nothing else. Reply with the whole code.\n\n```python\n{code}```")


def load_set(kind: str, n: int) -> list[str]:
  """The first n prompts of a set; "code_edit" is built from HumanEval's first n functions."""
  if kind != "code_edit":
    return list(sj_prompts.load(kind, n))
  rows = sj_prompts.read_jsonl(sj_prompts.set_path("humaneval"))[:n]
  return [EDIT.format(name=r["entry_point"], code=r["prompt"] + r["canonical_solution"])
          for r in rows]


def build(model, names: list[str]) -> dict:
  """The methods `names` (of METHODS) for `model`, by name."""
  built = {}
  for m in names:
    if m == "prompt-lookup-adaptive":  # copy lengths that follow acceptance, up to 10 tokens
      built[m] = sj.PromptLookup(adaptive=True)
    elif m == "hybrid-copies-first":
      built[m] = sj_methods.build("hybrid", model, measured=False)
    elif m == "hybrid-medusa":
      built[m] = sj_methods.build("hybrid", model, heads=sj_methods.shipped("medusa", model))
    elif m == "hybrid-suffix":  # the registry's hybrid (built once), suffix decoding added
      base = built.get("hybrid") or sj_methods.build("hybrid", model)
      pl, pred = base.drafters
      built[m] = sj.Hybrid([pl, sj.SuffixDecoding(num_nodes=base.num_nodes, remember=False),
                            pred], num_nodes=base.num_nodes)
    else:
      built[m] = sj_methods.build(m, model)
  return built


def run(args) -> dict:
  model = sj.load_model("smollm2-135m", **bench.ARITHMETICS[args.arithmetic])
  names = ["autoregressive"] + [m for m in args.methods.split(",") if m != "autoregressive"]
  unknown = sorted(set(names) - set(METHODS))
  if unknown:
    raise SystemExit(f"--methods: unknown {', '.join(unknown)}; known: {', '.join(METHODS)}")
  built = build(model, names)
  out = {"command": "python experiments/hybrid/run.py " + " ".join(sys.argv[1:]),
         "load_before": os.getloadavg(), "methods": {m: repr(built[m]) for m in names},
         "sets": {}}
  for kind in args.sets.split(","):
    ps = load_set(kind, args.prompts)
    rows = {m: [] for m in names}
    firsts = []
    for p in ps:
      ref = None
      for m in names:
        gen = lambda: sj.generate(model, [p], built[m], max_new_tokens=args.max_new_tokens,  # noqa
                                  chat=True, stop_at_eos=False)
        o = gen()  # compiles and warms; greedy, so every run gives these tokens and stats
        wall = min(bench.time_call(gen, args.repeats))  # the least disturbed run
        if ref is None:
          ref = o.tokens
        assert o.tokens == ref, f"{m} differs from autoregressive on {kind}"
        rows[m].append(dict(wall=wall, tau=o.stats["mean_accepted"],
                            by=o.stats.get("accepted_by")))
      # The first token alone (tokenising, the prompt's prefill, the first sample): a fixed cost
      # that every method pays before it drafts, timed once with autoregressive decoding.
      first = lambda: sj.generate(model, [p], built["autoregressive"], max_new_tokens=1,  # noqa
                                  chat=True, stop_at_eos=False)
      first()
      firsts.append(min(bench.time_call(first, args.repeats)))
      print(kind, {m: round(rows["autoregressive"][-1]["wall"] / rows[m][-1]["wall"], 2)
                   for m in names}, f"first token {firsts[-1]:.2f} s", flush=True)
    summary = {}
    for m in names:
      speed = [a["wall"] / r["wall"] for a, r in zip(rows["autoregressive"], rows[m])]
      after = [(a["wall"] - f) / (r["wall"] - f)
               for a, r, f in zip(rows["autoregressive"], rows[m], firsts)]
      summary[m] = dict(speedup=round(statistics.median(speed), 2),
                        speedup_after_first=round(statistics.median(after), 2),
                        tau=round(statistics.median(r["tau"] for r in rows[m]), 2))
    for h in (h for h in HYBRIDS if h in names):
      by = [r["by"] for r in rows[h]]
      summary[h]["accepted_by"] = {k: sum(b[k] for b in by) for k in by[0]}
    out["sets"][kind] = {
        "first_token_s": round(statistics.median(firsts), 3),
        "autoregressive_s": round(statistics.median(r["wall"] for r in rows["autoregressive"]), 3),
        "methods": summary}
    out["load_after"] = os.getloadavg()
    save(out, args.out)
    print(kind, json.dumps(summary), flush=True)
  return out


def save(res: dict, name: str) -> None:
  with open(os.path.join(os.path.dirname(__file__), name), "w") as f:
    json.dump(res, f, indent=1)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--prompts", type=int, default=3)
  ap.add_argument("--sets", default=",".join(SETS), help="comma-separated prompt sets")
  ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods")
  ap.add_argument("--out", default="results.json", help="results file, beside this script")
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--arithmetic", default="float32", choices=sorted(bench.ARITHMETICS),
                  help="the target's arithmetic (default float32)")
  ap.add_argument("--repeats", type=int, default=1, help="timed runs per method and prompt "
                  "(the fastest is kept)")
  args = ap.parse_args()
  print(json.dumps(run(args), indent=1))


if __name__ == "__main__":
  main()
