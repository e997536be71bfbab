"""Training-free drafting on SmolLM2-135M, this CPU, batch 1, greedy (issue 4).

    .venv/bin/python experiments/training_free/run.py [--quick] [--sweep] [--prompts N]

Measures, in one process: the forward cost curve (tokens per forward -> ms), then per Spec-Bench
category and HumanEval the wall time of sj.Autoregressive(), sj.PromptLookup() and sj.Lookahead()
on the same prompts (interleaved per prompt, compile excluded), and reports medians: speedup over
autoregressive and tau (tokens per target call). --sweep adds a lookahead W/N/G sweep on a few
prompts. Prompts come from ../shared/data/prompts; without them a built-in list is used.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import specjax as sj  # noqa: E402
from specjax import calibrate  # noqa: E402
from specjax import methods as sj_methods  # noqa: E402

PROMPTS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "prompts")
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
CATEGORIES = ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag", "humaneval"]
FALLBACK = {
    "mt_bench": ["Write a short story about a robot learning to paint."],
    "summarization": ["Summarize: The city council met on Tuesday to discuss the new park. The park "
                      "will have a playground, a pond and a garden. The council voted to build the "
                      "park next year. The park will have a playground, a pond and a garden."],
    "humaneval": ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"],
}


def load_prompts(n: int) -> dict[str, list[tuple[str, bool]]]:
  """category -> [(prompt, chat)]; HumanEval is raw code completion, the rest chat."""
  out: dict[str, list[tuple[str, bool]]] = {}
  try:
    with open(os.path.join(PROMPTS, "spec_bench.jsonl")) as f:
      for line in f:
        r = json.loads(line)
        cat = "mt_bench" if r["category"] in MT_BENCH else r["category"]
        if len(out.setdefault(cat, [])) < n:
          out[cat].append((r["turns"][0], True))
    with gzip.open(os.path.join(PROMPTS, "humaneval.jsonl.gz"), "rt") as f:
      out["humaneval"] = [(json.loads(line)["prompt"], False) for _, line in zip(range(n), f)]
  except OSError:
    print(f"(prompts not found under {PROMPTS}: using the built-in fallback)")
    out = {k: [(p, k != "humaneval") for p in v] for k, v in FALLBACK.items()}
  return {c: out[c] for c in CATEGORIES if c in out}


def cost_curve(model, sizes, cache_len=512, filled=256, reps=5) -> dict[int, float]:
  """ms per target forward of T tokens on a cache holding `filled` tokens.

  Sizes are interleaved and the minimum of reps kept: on a shared machine the minimum is the
  least-disturbed estimate of what the forward costs.
  """
  fns = {t: calibrate.forward_probe(model, t, cache_len=cache_len, filled=filled) for t in sizes}
  times = {t: [] for t in sizes}
  for _ in range(reps):
    for t, (f, args) in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(f(model.params, *args))
      times[t].append(time.perf_counter() - t0)
  return {t: 1000 * min(v) for t, v in times.items()}


def run(model, prompt, chat, method, max_new):
  o = sj.generate(model, [prompt], method, max_new_tokens=max_new, chat=chat)
  if o.stats["compile_time_s"] > 0:  # a fresh program's first run is slow: a warm-up
    o = sj.generate(model, [prompt], method, max_new_tokens=max_new, chat=chat)
  return o.tokens[0], o.stats


def bench(model, prompts, methods, max_new, label="", repeat=1):
  """Interleaved per prompt; returns {method name: [(wall, tau, stats)] per prompt}. With
  repeat > 1 each (prompt, method) runs that many times and keeps its fastest run."""
  res = {name: [] for name in methods}
  for i, (p, chat) in enumerate(prompts):
    ref = None
    for name, m in methods.items():
      runs = [run(model, p, chat, m, max_new) for _ in range(repeat)]  # wall excludes compile
      toks, st = min(runs, key=lambda r: r[1]["wall_time_s"])
      if ref is None:
        ref = toks
      elif toks != ref:
        print(f"  !! {name} differs from autoregressive on {label} prompt {i}")
      res[name].append((st["wall_time_s"], st["mean_accepted"], st))
  return res


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="1 prompt per category, 64 tokens")
  ap.add_argument("--sweep", action="store_true", help="lookahead W/N/G sweep")
  ap.add_argument("--prompts", type=int, default=3)
  ap.add_argument("--max-new", type=int, default=128)
  ap.add_argument("--repeat", type=int, default=1, help="runs per prompt and method (fastest kept)")
  args = ap.parse_args()
  n, max_new = (1, 64) if args.quick else (args.prompts, args.max_new)
  model = sj.load_model("smollm2-135m")
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} cores; "
        f"{n} prompts per category, {max_new} new tokens, batch 1, greedy\n")

  sizes = [1, 2, 4, 8, 12, 16, 24, 32]
  curve = cost_curve(model, sizes)
  print("forward cost (cache 512, 256 filled):")
  print("| tokens per forward | " + " | ".join(str(t) for t in sizes) + " |")
  print("|---" * (len(sizes) + 1) + "|")
  print("| ms | " + " | ".join(f"{curve[t]:.1f}" for t in sizes) + " |")
  print("| x one token | " + " | ".join(f"{curve[t] / curve[1]:.2f}" for t in sizes) + " |\n")

  methods = {n: sj_methods.build(n, model) for n in ("autoregressive", "prompt-lookup", "lookahead")}
  prompts = load_prompts(n)
  allres = {name: [] for name in methods}
  rows = []
  for cat, ps in prompts.items():
    res = bench(model, ps, methods, max_new, cat, args.repeat)
    for name in methods:
      allres[name] += res[name]
    rows.append((cat, res))
    print(f"  {cat}: done", flush=True)
  rows.append(("overall", allres))

  def cell(res, name):
    ar = [w for w, _, _ in res["autoregressive"]]
    w = [x for x, _, _ in res[name]]
    sp = statistics.median(a / b for a, b in zip(ar, w))
    tau = statistics.median(t for _, t, _ in res[name])
    return f"{sp:.2f}x (tau {tau:.2f})"

  names = [m for m in methods if m != "autoregressive"]
  print("\nspeedup over autoregressive, median over prompts (tau = tokens per target call):")
  print("| category | AR tok/s | " + " | ".join(names) + " |")
  print("|---" * (len(names) + 2) + "|")
  for cat, res in rows:
    tps = statistics.median(st["tokens_per_second"] for _, _, st in res["autoregressive"])
    print(f"| {cat} | {tps:.1f} | " + " | ".join(cell(res, m) for m in names) + " |")
  la = [st for _, _, st in allres["lookahead"]]
  print(f"\nlookahead pool hit rate (median): {statistics.median(s['pool_hit_rate'] for s in la):.2f}")

  if args.sweep:
    cfgs = [(2, 2, 2), (2, 3, 2), (4, 3, 4), (3, 4, 3), (6, 4, 6)]
    sub = [prompts[c][0] for c in ("mt_bench", "summarization", "humaneval") if c in prompts]
    sweep = {"autoregressive": sj.Autoregressive()}
    sweep.update({f"W{w}N{nn}G{g}": sj.Lookahead(window=w, ngram=nn, guess=g) for w, nn, g in cfgs})
    res = bench(model, sub, sweep, max_new, "sweep")
    print(f"\nlookahead sweep ({len(sub)} prompts: mt_bench, summarization, humaneval):")
    print("| W,N,G | tokens/forward | cost x | tau | hit rate | predicted tau/cost | measured |")
    print("|---|---|---|---|---|---|---|")
    for name, m in sweep.items():
      if name == "autoregressive":
        continue
      t = m.tokens_per_step
      cost = np.interp(t, sizes, [curve[s] / curve[1] for s in sizes])
      tau = statistics.median(x for _, x, _ in res[name])
      hit = statistics.median(st["pool_hit_rate"] for _, _, st in res[name])
      print(f"| {m.window},{m.ngram},{m.guess} | {t} | {cost:.2f} | {tau:.2f} | {hit:.2f} | "
            f"{tau / cost:.2f}x | {cell(res, name).split(' ')[0]} |")


if __name__ == "__main__":
  main()
