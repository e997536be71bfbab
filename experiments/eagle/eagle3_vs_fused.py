"""Summary of the equal-budget comparison: the native EAGLE-3 head against the fused-taps EAGLE head.

    python experiments/eagle/eagle3_vs_fused.py --runs runs/cmp-fused,runs/cmp-eagle3 \
        --heads runs/cmp-fused.npz,runs/cmp-eagle3.npz --tau tau_mt.json,tau_he.json \
        [--labels fused,eagle3] [--json experiments/eagle/eagle3_vs_fused.json]

Reads what the runs left and prints (and writes as JSON) one row per head: the held-out top-1 by
depth at every evaluation of its training run (`specjax train`'s log.jsonl, split "heldout"; a
run continued with --init in a second run directory is given as "first+second", whose steps then
count on from the first's; the exported file's own held-out numbers close the curve when the run
stopped between evaluations), the parameter count of its own tensors and of what it reads from the
target, and the tau rows of `experiments/eagle/tau.py --json` files for those heads. Nothing here
trains or decodes.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from specjax.heads import load_heads
from specjax.training.trainer import read_log


def _depths(r: dict) -> list[float]:
  return [r["top1"]] + [r[f"top1_{d}"] for d in range(2, 16) if f"top1_{d}" in r]


def held_out_curve(runs: str, heads_meta: dict | None = None) -> list[dict]:
  """[{step, run, top1: [depth 1, depth 2, ...]}] from the held-out log lines of "dir" or
  "dir1+dir2+..." (phases, steps counted on), closed by heads_meta's held_out at its steps."""
  out, offset = [], 0
  for run_dir in runs.split("+"):
    last = 0
    for r in read_log(run_dir):
      last = max(last, r["step"])
      if r.get("split") == "heldout":
        out.append(dict(step=offset + r["step"], run=run_dir, top1=_depths(r)))
    offset += last
  held, steps = (heads_meta or {}).get("held_out"), (heads_meta or {}).get("steps")
  if held and steps is not None and (not out or out[-1]["step"] != offset - last + steps):
    out.append(dict(step=offset - last + steps, run="export", top1=_depths(held)))
  return out


def train_seconds_per_step(runs: str) -> float | None:
  """Median seconds per step between logged train lines (the first, compiling, left out)."""
  rates = []
  for run_dir in runs.split("+"):
    rows = [r for r in read_log(run_dir) if r.get("split") == "train"]
    rates += [(b["seconds"] - a["seconds"]) / (b["step"] - a["step"])
              for a, b in zip(rows[1:], rows[2:]) if b["step"] > a["step"]]
  return float(np.median(rates)) if rates else None


def param_counts(path: str) -> dict:
  """(the file's training notes, the head's own parameters (trained) by tensor, and the target
  LM-head weights it scores with)."""
  h = load_heads(path)
  sizes = {k: int(np.prod(v.shape)) for k, v in h.params.items()}
  c = h.config
  vd = c.vocab_subset or c.vocab_size
  return h.meta, dict(kind=c.kind, taps=list(c.taps), draft_vocab=vd, own=sum(sizes.values()),
                     own_lm_head=sizes.get("lm", 0),
                     reads_target_lm_rows=0 if "lm" in sizes else vd * c.hidden_size,
                     tensors=sizes)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--runs", required=True, help="comma-separated run directories (a continued "
                  "run: first+second)")
  ap.add_argument("--heads", required=True, help="comma-separated exported heads, same order")
  ap.add_argument("--labels", default="fused,eagle3")
  ap.add_argument("--tau", default="", help="comma-separated tau.py --json files")
  ap.add_argument("--json", help="write the summary here")
  args = ap.parse_args(argv)
  runs, heads = args.runs.split(","), args.heads.split(",")
  labels = args.labels.split(",")
  taus = [json.load(open(p)) for p in args.tau.split(",") if p]
  out = []
  for label, run, path in zip(labels, runs, heads):
    rows = [r for t in taus for r in t["rows"]
            if os.path.normpath(r["heads"]) == os.path.normpath(path)]
    meta, params = param_counts(path)
    curve = held_out_curve(run, meta)
    out.append(dict(label=label, run=run, heads=path, held_out=curve,
                    seconds_per_step=train_seconds_per_step(run), params=params,
                    tau=[{k: r[k] for k in ("set", "nodes", "tau", "depth_acceptance",
                                            "identical")} for r in rows]))
    p = out[-1]["params"]
    print(f"{label}: {p['kind']} own params {p['own']:,} (LM head {p['own_lm_head']:,}; reads "
          f"{p['reads_target_lm_rows']:,} target LM-head weights), "
          f"{out[-1]['seconds_per_step'] or float('nan'):.2f} s/step")
    for c in curve:
      print(f"  step {c['step']} ({c['run']}): held-out top-1 by depth "
            + "/".join(f"{x:.3f}" for x in c["top1"]))
    for r in out[-1]["tau"]:
      print(f"  {r['set']} N={r['nodes']}: tau {r['tau']:.3f} "
            + "/".join(f"{x:.2f}" for x in r["depth_acceptance"])
            + ("" if r["identical"] else " NOT IDENTICAL"))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"heads": out}, f, indent=1)
  return out


if __name__ == "__main__":
  main()
