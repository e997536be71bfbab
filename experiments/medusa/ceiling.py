"""What tau a set of Medusa heads can reach at all, and how much better heads a tau goal needs.

    python experiments/medusa/ceiling.py [--heads smollm2-135m-medusa] [--nodes 4,8,16,32,64]
                                         [--goal 2.3 --at 16] [--json OUT]

Reads only the heads' held-out per-rank accuracies (`tree.per_rank_accuracy`, from the training
header) and prints, for each tree size, the tau that `build_tree`'s best tree of that size
predicts under independent heads (tau = 1 + the sum of the nodes' path probabilities; the same
model the budget chooser uses, which matched the measured MT-Bench greedy tau of the shipped
heads within 0.02). Then the factor s by which every accuracy would have to grow (each capped at
1) for the best --at-node tree to predict --goal, with the head-1 top-1 that implies, and the same
figures for the Vicuna-7B accuracies Medusa reports (`tree.prior_accuracies`) for reference.

No model is loaded and nothing is timed: the figures follow from the heads' header alone.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def predicted_tau(acc: np.ndarray, nodes: int) -> float:
  from specjax import tree

  return 1.0 + tree.expected_accepted(tree.build_tree(acc, nodes), acc)


def needed_scale(acc: np.ndarray, goal: float, nodes: int, hi: float = 64.0) -> float:
  """The smallest s with predicted_tau(min(s * acc, 1), nodes) >= goal (bisection; the predicted
  tau never falls as accuracies grow). Infinity when even s = hi does not reach it."""
  def tau(s):
    return predicted_tau(np.minimum(acc * s, 1.0), nodes)

  if tau(1.0) >= goal:
    return 1.0
  if tau(hi) < goal:
    return float("inf")
  lo = 1.0
  for _ in range(60):
    mid = 0.5 * (lo + hi)
    lo, hi = (mid, hi) if tau(mid) < goal else (lo, mid)
  return hi


def analyse(acc: np.ndarray, nodes: list[int], goal: float, at: int) -> dict:
  s = needed_scale(acc, goal, at)
  return {"per_rank_accuracy": acc.round(4).tolist(),
          "predicted_tau": {int(n): round(predicted_tau(acc, n), 4) for n in nodes},
          "goal": goal, "at_nodes": at, "needed_scale": s,
          "needed_head1_top1": float(min(acc[0, 0] * s, 1.0)) if np.isfinite(s) else None}


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--heads", default="smollm2-135m-medusa", help="shipped name or .npz")
  ap.add_argument("--nodes", default="4,8,16,32,64")
  ap.add_argument("--goal", type=float, default=2.3)
  ap.add_argument("--at", type=int, default=16, help="the tree size the goal is for")
  ap.add_argument("--json", default=None)
  a = ap.parse_args(argv)
  import specjax as sj
  from specjax import tree

  heads = sj.load_heads(a.heads)
  k = heads.config.num_heads
  acc = tree.per_rank_accuracy(heads.meta, k)
  if acc is None:
    sys.exit(f"{a.heads}: no held-out accuracies in the header (untrained heads?)")
  nodes = [int(n) for n in a.nodes.split(",")]
  out = {"heads": a.heads, "measured": analyse(acc, nodes, a.goal, a.at),
         "vicuna7b_prior": analyse(tree.prior_accuracies(k, acc.shape[1]), nodes, a.goal, a.at)}
  for name, r in (("heads", out["measured"]), ("Vicuna-7B (Medusa's figures)", out["vicuna7b_prior"])):
    taus = " ".join(f"{n}:{t:.2f}" for n, t in r["predicted_tau"].items())
    print(f"{name}: head-1 top-1 {r['per_rank_accuracy'][0][0]:.3f}; predicted tau by nodes {taus}")
    need = r["needed_head1_top1"]
    if r["needed_scale"] == 1.0:
      print(f"  already predicts tau >= {a.goal} at {a.at} nodes")
    else:
      print(f"  tau {a.goal} at {a.at} nodes needs every accuracy x{r['needed_scale']:.2f}"
            + (f" (head-1 top-1 {need:.3f})" if need is not None else " (no scale up to 64 does)"))
  if a.json:
    with open(a.json, "w") as f:
      json.dump(out, f, indent=1)
  return out


if __name__ == "__main__":
  main()
