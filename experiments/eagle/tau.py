"""Acceptance only: tau and acceptance per depth of several heads files on the same prompts.

    python experiments/eagle/tau.py --heads smollm2-135m-eagle,runs/heads4-eagle.npz \
        [--kind eagle|medusa|mtp] [--nodes 8,16,32] [--depth 5] [--sets mt_bench,humaneval]
        [--prompts 8] [--new 128] [--json out.json]

`--kind eagle` takes EAGLE heads and EAGLE-3 heads (kind "eagle3") alike: both draft through
`sj.Eagle`, so one run compares them on the same prompts. Greedy decoding is deterministic, so
tau (1 + accepted draft tokens / target calls) and the per-depth acceptance need no quiet
machine: this compares heads (e.g. before and after a retrain) on more prompts than a timed run
can afford, beside other work. Speed is
`run.py`'s job (timed against autoregressive in the same process). Every output is checked
token-identical to autoregressive. Batch 1, chat template for MT-Bench, raw HumanEval.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import specjax as sj
from specjax import bench
from specjax import tree as trees

_spec = importlib.util.spec_from_file_location(
    "eagle_experiment_run", os.path.join(os.path.dirname(os.path.abspath(__file__)), "run.py"))
_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_run)
depth_acceptance, pooled = _run.depth_acceptance, _run.pooled


def method_for(heads, kind: str, nodes: int, depth: int, top_k: int):
  if kind == "eagle":
    return sj.Eagle(heads, tree="dynamic", depth=depth, top_k=min(top_k, nodes), num_nodes=nodes)
  if kind == "medusa":  # the tree experiments/medusa/run.py grows from the heads' own accuracies
    k = heads.config.num_heads
    acc = trees.per_rank_accuracy(heads.meta, k)
    acc = trees.prior_accuracies(k, 5) if acc is None else acc
    return sj.Medusa(heads, tree=trees.build_tree(acc, nodes), top_k=5)
  return sj.MTP(heads)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="smollm2-135m")
  ap.add_argument("--heads", required=True, help="comma-separated heads (.npz or shipped names)")
  ap.add_argument("--kind", default="eagle", choices=("eagle", "medusa", "mtp"),
                  help="eagle: EAGLE or EAGLE-3 heads (sj.Eagle)")
  ap.add_argument("--nodes", default="8,16,32", help="EAGLE-2 / Medusa tree sizes")
  ap.add_argument("--depth", type=int, default=5)
  ap.add_argument("--top-k", type=int, default=8)
  ap.add_argument("--sets", default="mt_bench,humaneval")
  ap.add_argument("--prompts", type=int, default=8, help="prompts per set")
  ap.add_argument("--new", type=int, default=128, help="new tokens per prompt (no EOS stop)")
  ap.add_argument("--json", help="write the rows here")
  args = ap.parse_args(argv)

  target = sj.load_model(args.model)
  names = [h.strip() for h in args.heads.split(",") if h.strip()]
  heads = {n: sj.load_heads(n, target) for n in names}  # bad names fail before any decoding
  nodes = [int(x) for x in args.nodes.split(",")] if args.kind != "mtp" else [0]
  ps = bench.load_prompt_sets(args.sets, args.prompts)
  kw = dict(max_new_tokens=args.new, stop_at_eos=False)
  ref = [sj.generate(target, [p], **kw, chat=chat).tokens[0] for _, p, chat in ps]
  rows = []
  for name, h in heads.items():
    for n in nodes:
      m = method_for(h, args.kind, n, args.depth, args.top_k)
      for s in dict.fromkeys(s for s, _, _ in ps):
        idx = [i for i, (s2, _, _) in enumerate(ps) if s2 == s]
        outs = [sj.generate(target, [ps[i][1]], m, **kw, chat=ps[i][2]) for i in idx]
        tau, hist = pooled(outs)
        row = dict(heads=name, set=s, nodes=n, tau=tau, depth_acceptance=depth_acceptance(hist),
                   identical=all(o.tokens[0] == ref[i] for o, i in zip(outs, idx)))
        rows.append(row)
        print(f"{name} {s} N={n}: tau {row['tau']:.3f} by depth "
              + "/".join(f"{x:.2f}" for x in row["depth_acceptance"])
              + ("" if row["identical"] else "  NOT IDENTICAL"), flush=True)
  print("\n| heads | set | nodes | tau | acceptance by depth | identical |\n|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['heads']} | {r['set']} | {r['nodes'] or '-'} | {r['tau']:.2f} | "
          + "/".join(f"{x:.2f}" for x in r["depth_acceptance"]) + f" | {r['identical']} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), "rows": rows}, f, indent=1)
  if not all(r["identical"] for r in rows):
    sys.exit(1)
  return rows


if __name__ == "__main__":
  main()
