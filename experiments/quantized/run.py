"""Quantized self-drafting (sj.QuantizedDraft) on SmolLM2-135M fp32, this CPU, batch 1, greedy.

    .venv/bin/python experiments/quantized/run.py [--quick] [--prompts N] [--max-new N] [--set S]

In one process: autoregressive decoding and sj.QuantizedDraft variants on the same chat prompts
(the built-in sample, specjax.prompts "builtin"), interleaved per prompt, compile excluded (each
program runs once on the prompt before it is timed). Reports per variant tokens/s (total new
tokens / total wall time), the speedup over autoregressive, tau (tokens per target call), the
acceptance at each draft position (alpha_i: d_i accepted given d_1..d_{i-1} were), that every
output equals autoregressive's, and c = one draft forward / one target decode step.

4-bit variants run on the integer-dot kernel (specjax/kernels/qdot.py) where it is available;
`--pure-jax` adds the same variants with the kernel hidden, i.e. kernels/quant.py's pure-JAX
int8 path (XLA's integer dot). --quick: 3 prompts, 64 new tokens, fewer variants. "+lookup k"
variants are multi-level: prompt lookup drafts k tokens for the quantized draft (lookup=k).
--set: the prompt set (specjax.prompts names; "builtin" by default, e.g. "humaneval" for code).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import specjax as sj  # noqa: E402
from specjax import decode, prompts  # noqa: E402
from specjax.kernels import quant  # noqa: E402
from specjax.methods.draft import measure_cost_ratio  # noqa: E402


def variants(quick: bool) -> dict:
  out = {"q4 shared g4": dict(bits=4, gamma=4), "q8 shared g4": dict(bits=8, gamma=4),
         "q4 shared g4 +lookup 3": dict(bits=4, gamma=4, lookup=3),
         "q4 shared g6 +lookup 4": dict(bits=4, gamma=6, lookup=4)}
  if not quick:
    out.update({"q4 shared g6": dict(bits=4, gamma=6), "q4 own g4": dict(bits=4, gamma=4,
                                                                        cache="own")})
  return {k: sj.QuantizedDraft(**v) for k, v in out.items()}


def run_all(model, texts, methods: dict, max_new: int) -> dict:
  """name -> {"tokens": [...], "wall": s, "new": n, "calls": n, "stats": [...]} (interleaved)."""
  res = {n: {"tokens": [], "wall": 0.0, "new": 0, "calls": 0, "stats": []} for n in methods}
  for text in texts:
    for name, m in methods.items():
      kw = dict(max_new_tokens=max_new, chat=True, stop_at_eos=False)
      sj.generate(model, [text], m, **kw)  # compile (first prompt) and warm
      out = sj.generate(model, [text], m, **kw)
      r = res[name]
      r["tokens"].append(out.tokens[0])
      r["wall"] += out.stats["wall_time_s"]
      r["new"] += out.stats["new_tokens"]
      r["calls"] += sum(out.stats["target_calls_per_row"])
      r["stats"].append(out.stats)
  return res


def alphas(stats: list) -> list:
  """Per draft position, accepted / reached, summed over prompts."""
  if "reached_at" not in stats[0]:
    return []
  reached = [sum(s["reached_at"][i] for s in stats) for i in range(len(stats[0]["reached_at"]))]
  acc = [sum(s["accepted_at"][i] for s in stats) for i in range(len(reached))]
  return [round(a / r, 3) if r else None for a, r in zip(acc, reached)]


def table(res: dict, costs: dict) -> list[dict]:
  base = res["autoregressive"]
  rows = []
  for name, r in res.items():
    tps = r["new"] / r["wall"]
    rows.append({"method": name, "tokens_per_s": round(tps, 1),
                 "speedup": round(tps / (base["new"] / base["wall"]), 2),
                 "tau": round(r["new"] / max(1, r["calls"]), 2), "alpha_by_position": alphas(
                     r["stats"]), "c": costs.get(name), "identical": r["tokens"] == base["tokens"]})
  return rows


def print_table(rows: list[dict]) -> None:
  print(f"{'method':26s} {'tok/s':>7s} {'speedup':>7s} {'tau':>5s} {'c':>5s} ident  alpha by position")
  for r in rows:
    c = "" if r["c"] is None else f"{r['c']:.2f}"
    print(f"{r['method']:26s} {r['tokens_per_s']:7.1f} {r['speedup']:7.2f} {r['tau']:5.2f} {c:>5s} "
          f"{str(r['identical']):5s}  {r['alpha_by_position']}")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--prompts", type=int, default=None)
  ap.add_argument("--max-new", type=int, default=None)
  ap.add_argument("--set", default="builtin", help="prompt set (specjax.prompts name)")
  ap.add_argument("--pure-jax", action="store_true", help="also run the variants without qdot")
  ap.add_argument("--out", default=None, help="write the table as JSON here")
  args = ap.parse_args()
  n = args.prompts or (3 if args.quick else 4)
  max_new = args.max_new or (64 if args.quick else 96)
  model = sj.load_model("smollm2-135m")
  texts = prompts.load(args.set, n)
  qdot = quant._qdot()
  print(f"model {model!r}; {n} {args.set} prompts, {max_new} new tokens; qdot kernel: "
        f"{'available (' + qdot.isa() + ')' if qdot else 'unavailable'}")
  t0 = time.perf_counter()
  methods = {"autoregressive": sj.Autoregressive(), **variants(args.quick)}
  costs = {k: round(measure_cost_ratio(model, m)["c"], 2) for k, m in methods.items()
           if k != "autoregressive" and not m.lookup}
  res = run_all(model, texts, methods, max_new)
  if args.pure_jax and qdot is not None:
    quant._qdot = lambda: None  # hide the kernel: the pure-JAX int8 path (experiment only)
    decode.compile_cache.clear()
    pj = {k + " (pure JAX)": m for k, m in variants(True).items() if m.bits == 4 and not m.lookup}
    costs.update({k: round(measure_cost_ratio(model, m)["c"], 2) for k, m in pj.items()})
    res.update({k: v for k, v in run_all(model, texts, pj, max_new).items()})
  rows = table(res, costs)
  print_table(rows)
  print(f"(total {time.perf_counter() - t0:.0f} s; load average {open('/proc/loadavg').read().strip()})")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
