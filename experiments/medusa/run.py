"""Medusa on SmolLM2-135M vs autoregressive: per-head accuracy, tau and speedup by tree size.

    python experiments/medusa/run.py [--quick] [--heads smollm2-135m-medusa | heads.npz]

1. The heads' held-out accuracy table (from their training header: top-1 / top-5 per head).
2. The cost curve c(T) of this machine (`specjax.bench.measure_cost_curve`, with the CPU kernel
   when it is on), and the tree `build_tree` grows from the measured per-rank accuracies for
   4 / 8 / 16 / 32 / 64 nodes, plus the size `choose_budget` picks; each with its predicted tau and
   speedup ((1 + E[accepted]) / c(N + 1)).
3. Each tree decoding MT-Bench first turns (chat) and HumanEval prompts (raw), greedy and
   temperature 0.7, batch 1, each run right after the autoregressive baseline on the same prompt
   (same process): median speedup, tau, and token identity with AR at temperature 0.
Writes results.json and a markdown table next to this file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

import specjax as sj
from specjax import bench, prompts
from specjax import tree as T


def per_rank_accuracy(meta: dict, num_heads: int, ranks: int = 5) -> np.ndarray:
  """[K, ranks] P(head k's rank-r token is right) from held-out top-1 / top-5 (the 4 ranks after
  the first share top-5 - top-1, decaying geometrically)."""
  held = meta.get("held_out", {})
  out = np.zeros((num_heads, ranks))
  w = 0.5 ** np.arange(ranks - 1)
  w = w / w.sum()
  for k in range(num_heads):
    t1, t5 = float(held.get(f"top1_{k}", 0.0)), float(held.get(f"top5_{k}", 0.0))
    out[k, 0] = t1
    out[k, 1:] = max(t5 - t1, 0.0) * w
  return out


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--heads", default="smollm2-135m-medusa")
  ap.add_argument("--quick", action="store_true", help="2 prompts per set, 64 tokens, greedy only")
  ap.add_argument("--prompts", type=int, default=4)
  ap.add_argument("--new", type=int, default=128)
  ap.add_argument("--nodes", default="4,8,16,32,64")
  ap.add_argument("--temps", default="0,0.7")
  ap.add_argument("--sets", default="mt_bench,humaneval")
  ap.add_argument("--model", default="smollm2-135m")
  ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
  args = ap.parse_args(argv)
  if args.quick:
    args.prompts, args.new, args.temps, args.nodes = 2, 64, "0", "4,16"

  target = sj.load_model(args.model)
  heads = sj.load_heads(args.heads, target)
  k = heads.config.num_heads
  acc = per_rank_accuracy(heads.meta, k)
  print("held-out accuracy per head (top-1 / top-5):")
  held = heads.meta.get("held_out", {})
  acc_rows = [{"head": i, "top1": held.get(f"top1_{i}"), "top5": held.get(f"top5_{i}")} for i in range(k)]
  for r in acc_rows:
    print(f"  head {r['head']} (token t+{r['head'] + 2}): {r['top1']:.3f} / {r['top5']:.3f}")

  cost = bench.measure_cost_curve(target, (1, 2, 4, 8, 16, 32, 64, 65))
  print("cost curve c(T):", {t: round(c, 2) for t, c in cost.items()})
  pick = T.choose_budget(cost, acc, max_nodes=64)
  sizes = sorted(set(int(n) for n in args.nodes.split(",")) | {pick["num_nodes"]})
  trees = {n: T.build_tree(acc, n) for n in sizes}
  pred = {n: (1 + T.expected_accepted(trees[n], acc), T.interpolate_cost(cost, n + 1)) for n in sizes}
  print(f"budget chooser: N = {pick['num_nodes']} (predicted tau {pick['tau']:.2f}, "
        f"{pick['speedup']:.2f}x)")

  methods = {n: sj.Medusa(heads, tree=trees[n], top_k=5) for n in sizes}
  rows = []
  for kind in args.sets.split(","):
    chat = kind != "humaneval"
    ps = prompts.load(kind, args.prompts)
    for temp in (float(t) for t in args.temps.split(",")):
      kw = dict(max_new_tokens=args.new, temperature=temp, chat=chat, stop_at_eos=False)
      res = {n: [] for n in sizes}
      for i, p in enumerate(ps):
        base = sj.generate(target, [p], seed=i, **kw)  # warm the AR program once per shape
        base = sj.generate(target, [p], seed=i, **kw)
        for n, m in methods.items():
          sj.generate(target, [p], m, seed=i, **kw)  # compile / warm
          out = sj.generate(target, [p], m, seed=i, **kw)
          base2 = sj.generate(target, [p], seed=i, **kw)  # AR again, right after: same load
          t_ar = min(base.stats["wall_time_s"], base2.stats["wall_time_s"])
          res[n].append((t_ar / out.stats["wall_time_s"], out.stats["mean_accepted"],
                         out.tokens == base.tokens if temp == 0 else None))
      for n in sizes:
        rs = res[n]
        same = [r[2] for r in rs if r[2] is not None]
        rows.append({"set": kind, "temperature": temp, "nodes": n, "chosen": n == pick["num_nodes"],
                     "speedup": statistics.median(r[0] for r in rs),
                     "tau": statistics.median(r[1] for r in rs),
                     "pred_tau": pred[n][0], "cost": pred[n][1], "pred_speedup": pred[n][0] / pred[n][1],
                     "identical": all(same) if same else None})
        r = rows[-1]
        print(f"{kind:10s} T={temp} N={n:3d}{'*' if r['chosen'] else ' '}  speedup {r['speedup']:.2f}x  "
              f"tau {r['tau']:.2f}  (pred tau {r['pred_tau']:.2f}, c {r['cost']:.2f}, "
              f"pred {r['pred_speedup']:.2f}x)  identical={r['identical']}", flush=True)

  out = {"date": time.strftime("%Y-%m-%d %H:%M"), "heads": args.heads, "accuracy": acc_rows,
         "cost_curve": cost, "chosen_nodes": pick["num_nodes"], "rows": rows, "args": vars(args)}
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(out, f, indent=1)
  lines = ["| set | T | nodes | speedup | tau | predicted tau | c(N+1) | predicted speedup | = AR |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['set']} | {r['temperature']} | {r['nodes']}{' (chosen)' if r['chosen'] else ''} | "
                 f"{r['speedup']:.2f}x | {r['tau']:.2f} | {r['pred_tau']:.2f} | {r['cost']:.2f} | "
                 f"{r['pred_speedup']:.2f}x | {'-' if r['identical'] is None else r['identical']} |")
  with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
