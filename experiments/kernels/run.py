"""The CPU matmul kernel (specjax.kernels) vs XLA's dot on SmolLM2-135M, batch 1 (issue 10).

    .venv/bin/python experiments/kernels/run.py [--quick] [--reps N] [--methods] [--prompts N]

In one process: a memory-bandwidth probe (numpy sums over a 1 GB array, 1 and 2 threads); the
forward cost curve through `model.apply` (cache 512 slots, 256 filled, T = 1, 2, 4, 8, 16 tokens,
jitted; the kernel model and the XLA model interleaved rep by rep and every T inside a rep, medians
reported, so load from other processes on this shared 2-core machine hits both alike); weight bytes
read per token / time. --methods adds end-to-end decoding with the kernel on: sj.Autoregressive()
vs every registered method (as experiments/spec_bench builds them) on the same prompts,
interleaved per prompt (the protocol of experiments/training_free and experiments/draft_model).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import specjax as sj  # noqa: E402
from specjax import cache as kv  # noqa: E402
from specjax import kernels, packing  # noqa: E402


def bandwidth_probe(gb: float = 1.0, reps: int = 5) -> dict[str, float]:
  """GB/s reading a `gb` GB float32 array with a numpy reduction (max: vectorised and cheap per
  byte, unlike float32 sum's pairwise adds), on one thread and on two threads over halves (numpy
  releases the GIL inside the reduction). Best of reps."""
  a = np.ones(int(gb * 1e9) // 4, np.float32)
  halves = np.array_split(a, 2)
  out = {}
  best = min(_timed(lambda: a.max()) for _ in range(reps))
  out["1 thread"] = a.nbytes / best / 1e9

  def two():
    ts = [threading.Thread(target=h.max) for h in halves]
    for t in ts:
      t.start()
    for t in ts:
      t.join()

  best = min(_timed(two) for _ in range(reps))
  out["2 threads"] = a.nbytes / best / 1e9
  return out


def _timed(f) -> float:
  t0 = time.perf_counter()
  f()
  return time.perf_counter() - t0


def forward_fns(model, sizes, cache_len=512, filled=256):
  """T -> (jitted f(params, cache) -> logits [1,T,V], cache) on a cache with `filled` entries."""
  fns = {}
  for t in sizes:
    cache = kv.rollback(model.init_cache(1, cache_len), jnp.array([filled]))
    toks = jnp.zeros((1, t), jnp.int32)
    pos = filled + jnp.arange(t)[None]
    mask = kv.causal_mask(cache.lengths, t, cache_len)
    f = jax.jit(lambda p, c, toks=toks, pos=pos, mask=mask: model.apply(p, toks, pos, c, mask)[0])
    jax.block_until_ready(f(model.params, cache))
    fns[t] = (f, cache)
  return fns


def cost_curves(models: dict, sizes, reps: int) -> dict[str, dict[int, list[float]]]:
  """name -> T -> [ms per forward], the models and sizes interleaved within every rep."""
  fns = {name: forward_fns(m, sizes) for name, m in models.items()}
  times = {name: {t: [] for t in sizes} for name in models}
  for _ in range(reps):
    for name, m in models.items():
      for t in sizes:
        f, cache = fns[name][t]
        t0 = time.perf_counter()
        jax.block_until_ready(f(m.params, cache))
        times[name][t].append(1000 * (time.perf_counter() - t0))
  return times


def check_outputs(models: dict, sizes) -> float:
  """Largest relative difference between the kernel's and XLA's logits over the curve's inputs."""
  worst = 0.0
  ref_name, ker_name = list(models)
  for t in sizes:
    outs = {}
    for name, m in models.items():
      f, cache = forward_fns(m, [t])[t]
      outs[name] = np.asarray(f(m.params, cache))
    d = np.abs(outs[ker_name] - outs[ref_name]).max() / np.abs(outs[ref_name]).max()
    worst = max(worst, float(d))
  return worst


def methods_bench(model, n_prompts: int, max_new: int, repeat: int, categories=None):
  """Every registered method that runs on the model, built exactly as the Spec-Bench experiment
  builds them (the shipped draft, gamma 3; layer-skip at layer 6 over the draft's vocabulary;
  Medusa's tree by `choose_budget` on this machine's cost curve; a small EAGLE-2 tree)."""
  from experiments.spec_bench.run import build_methods
  from experiments.training_free.run import bench, load_prompts

  methods, notes = build_methods(model, model.name)
  for name, note in notes.items():
    print(f"# {name}: {note}")
  prompts = load_prompts(n_prompts)
  if categories:
    prompts = {c: prompts[c] for c in categories if c in prompts}
  rows, allres = [], {name: [] for name in methods}
  for cat, ps in prompts.items():
    res = bench(model, ps, methods, max_new, cat, repeat)
    for name in methods:
      allres[name] += res[name]
    rows.append((cat, res))
    print(f"  {cat}: done", flush=True)
  rows.append(("overall", allres))
  names = [m for m in methods if m != "autoregressive"]
  print("\nspeedup over autoregressive (kernel on for all), median over prompts "
        "(tau = tokens per target call):")
  print("| category | AR tok/s | " + " | ".join(names) + " |")
  print("|---" * (len(names) + 2) + "|")
  for cat, res in rows:
    ar = [w for w, _, _ in res["autoregressive"]]
    tps = statistics.median(st["tokens_per_second"] for _, _, st in res["autoregressive"])
    cells = []
    for name in names:
      sp = statistics.median(a / w for a, (w, _, _) in zip(ar, res[name]))
      tau = statistics.median(t for _, t, _ in res[name])
      cells.append(f"{sp:.2f}x (tau {tau:.2f})")
    print(f"| {cat} | {tps:.1f} | " + " | ".join(cells) + " |")


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="fewer reps; methods on 1 prompt, 64 tokens")
  ap.add_argument("--reps", type=int, default=15)
  ap.add_argument("--methods", action="store_true", help="also time the decoding methods")
  ap.add_argument("--prompts", type=int, default=3)
  ap.add_argument("--max-new", type=int, default=128)
  ap.add_argument("--repeat", type=int, default=1)
  ap.add_argument("--skip-curve", action="store_true", help="only the methods (with --methods)")
  ap.add_argument("--categories", default="", help="comma-separated subset (default: all)")
  args = ap.parse_args(argv)
  reps = 5 if args.quick else args.reps
  sizes = [1, 2, 4, 8, 16]

  xla = sj.load_model("smollm2-135m", kernels=False)
  ker = packing.pack(xla)
  if not packing.is_packed(ker):
    sys.exit("the kernel is unavailable here (see the warning above)")
  print(f"{time.strftime('%Y-%m-%d')}, jax {jax.__version__}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores (load average {os.getloadavg()[0]:.1f}); kernel path {kernels.isa()}, "
        f"{kernels.threads()} threads")
  bw = bandwidth_probe()
  print("memory bandwidth (numpy max over 1 GB, best of 5): "
        + ", ".join(f"{k} {v:.1f} GB/s" for k, v in bw.items()))

  models = {"xla": xla, "kernel": ker}
  if not args.skip_curve:
    curve(models, sizes, reps, xla.num_param_bytes, bw)
  if args.methods:
    del xla, models
    n, max_new = (1, 64) if args.quick else (args.prompts, args.max_new)
    methods_bench(ker, n, max_new, args.repeat,
                  [c for c in args.categories.split(",") if c] or None)


def curve(models, sizes, reps, weight_bytes, bw):
  print(f"max relative logit difference kernel vs XLA over T={sizes}: "
        f"{check_outputs(models, sizes):.2e}")
  times = cost_curves(models, sizes, reps)
  med = {name: {t: statistics.median(v) for t, v in d.items()} for name, d in times.items()}
  print(f"\nforward cost through model.apply (cache 512, 256 filled), median of {reps} interleaved "
        f"reps; c(T) = ms(T) / ms(1) of the same path:")
  print("| path | " + " | ".join(f"T={t}" for t in sizes) + " |")
  print("|---" * (len(sizes) + 1) + "|")
  for name in models:
    print(f"| {name} ms | " + " | ".join(f"{med[name][t]:.1f}" for t in sizes) + " |")
  for name in models:
    print(f"| {name} c(T) | " + " | ".join(f"{med[name][t] / med[name][1]:.2f}" for t in sizes) + " |")
  print("| kernel / xla | " + " | ".join(f"{med['kernel'][t] / med['xla'][t]:.2f}" for t in sizes) + " |")
  for name in models:
    print(f"{name}: {weight_bytes / 1e6:.0f} MB of weights per forward / {med[name][1]:.1f} ms = "
          f"{weight_bytes / med[name][1] / 1e6:.1f} GB/s at T=1 "
          f"({weight_bytes / med[name][1] / 1e6 / bw['2 threads']:.0%} of the 2-thread probe)")


if __name__ == "__main__":
  main()
