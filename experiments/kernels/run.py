"""The CPU matmul kernel (specjax.kernels) vs XLA's dot on SmolLM2-135M, batch 1 (issues 10, 25).

    .venv/bin/python experiments/kernels/run.py [--quick] [--reps N] [--methods] [--prompts N]
        [--sizes 1,2,4,8,16,32,64] [--bf16] [--attention]
    .venv/bin/python experiments/kernels/run.py --ab OLD_matmul.cc [--reps 9] [--rows 1,2,...,64]
    .venv/bin/python experiments/kernels/run.py --peak

In one process: a memory-bandwidth probe (numpy sums over a 1 GB array, 1 and 2 threads); the
forward cost curve through `model.apply` (cache 512 slots, 256 filled, T = 1, 2, 4, 8, 16 tokens,
jitted; the kernel model and the XLA model interleaved rep by rep and every T inside a rep, medians
reported, so load from other processes on this shared 2-core machine hits both alike); weight bytes
read per token / time. --methods adds end-to-end decoding with the kernel on: sj.Autoregressive()
vs every registered method (as experiments/spec_bench builds them) on the same prompts,
interleaved per prompt (the protocol of experiments/training_free and experiments/draft_model).
--bf16 adds the bfloat16 model (XLA and the kernel's bf16 path) to the cost curve. --attention
adds the kernel model with XLA's attention in place of the attention kernel (specjax/kernels/
attention.py): the same weights and products, only the attention differs.

--ab: the kernel alone, before / after in one process: OLD_matmul.cc (e.g. `git show
REV:specjax/kernels/matmul.cc > /tmp/old.cc`) is compiled with this tree's flags (and pool.h)
beside the current build, and both (plus the current build's bf16 path) multiply SmolLM2-135M's
shapes through their host entry (ctypes, no jit), M = --rows, in alternating batches: median of
--reps batches, per call. Each batch cycles through enough copies of the weight to overflow the
L3 cache, as a forward (538 MB of weights) does. A last row adds the shapes up as one forward's
products (30 layers and the head). --cpu-time (with SPECJAX_KERNEL_THREADS=1) times the calling
thread's CPU time instead of the wall clock: on a loaded machine it leaves out the time other
processes hold the core, so it measures the kernel's own work per core.
"""

from __future__ import annotations

import argparse
import contextlib
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
from specjax import calibrate, kernels, packing  # noqa: E402


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


@contextlib.contextmanager
def xla_attention():
  """Forwards traced inside run attention on XLA (the attention kernel reports unavailable)."""
  from specjax.kernels import attention
  saved = attention.available
  attention.available = lambda: False
  try:
    yield
  finally:
    attention.available = saved


XLA_ATTENTION = "kernel, XLA attention"  # the --attention variant: dense kernel, XLA's attention


def forward_fns(model, sizes, cache_len=512, filled=256, name=""):
  """T -> (f, args): f(params, *args) -> logits [1,T,V] on a cache with `filled` entries
  (calibrate.forward_probe; traced with XLA's attention when name is XLA_ATTENTION)."""
  if name == XLA_ATTENTION:
    with xla_attention():
      return forward_fns(model, sizes, cache_len, filled)
  return {t: calibrate.forward_probe(model, t, cache_len=cache_len, filled=filled) for t in sizes}


def cost_curves(models: dict, sizes, reps: int) -> dict[str, dict[int, list[float]]]:
  """name -> T -> [ms per forward], the models and sizes interleaved within every rep."""
  fns = {name: forward_fns(m, sizes, name=name) for name, m in models.items()}
  times = {name: {t: [] for t in sizes} for name in models}
  for _ in range(reps):
    for name, m in models.items():
      for t in sizes:
        f, args = fns[name][t]
        t0 = time.perf_counter()
        jax.block_until_ready(f(m.params, *args))
        times[name][t].append(1000 * (time.perf_counter() - t0))
  return times


def check_outputs(models: dict, sizes) -> float:
  """Largest relative difference between the kernel's and XLA's logits over the curve's inputs
  (models: {XLA's name: model, the kernel's name: model})."""
  worst = 0.0
  ref_name, ker_name = list(models)
  for t in sizes:
    outs = {}
    for name, m in models.items():
      f, args = forward_fns(m, [t])[t]
      outs[name] = np.asarray(f(m.params, *args))
    d = np.abs(outs[ker_name] - outs[ref_name]).max() / np.abs(outs[ref_name]).max()
    worst = max(worst, float(d))
  return worst


def methods_bench(model, n_prompts: int, max_new: int, repeat: int, categories=None):
  """Every registered method that runs on the model, built exactly as the Spec-Bench experiment
  builds them (the shipped draft, gamma 3; layer-skip at layer 6 over the draft's vocabulary;
  Medusa's tree by `choose_budget` on this machine's cost curve; a small EAGLE-2 tree)."""
  from experiments.spec_bench.run import build_methods
  from experiments.training_free.run import bench, load_prompts

  methods, notes = build_methods(model)
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


# SmolLM2-135M's products (K, N) and how many a forward runs: per layer fused QKV, attention
# output, fused gate/up, down; the tied head.
SHAPES = [("qkv", 576, 960, 30), ("o", 576, 576, 30), ("gate_up", 576, 3072, 30),
          ("down", 1536, 576, 30), ("head", 576, 49152, 1)]


def build_other(source: str, out_dir: str) -> str:
  """Compiles another version of matmul.cc (with this tree's pool.h) as build.build does."""
  import shutil
  import subprocess

  from specjax.kernels import build
  shutil.copy(source, os.path.join(out_dir, "matmul.cc"))
  shutil.copy(os.path.join(os.path.dirname(build.__file__), "pool.h"), out_dir)
  objs = []
  for part, flags in build._parts():
    obj = os.path.join(out_dir, part + ".o")
    subprocess.run([build.find_compiler(), *build.BASE_FLAGS, *flags, f"-DSJ_PART={part}", "-I",
                    jax.ffi.include_dir(), "-c", os.path.join(out_dir, "matmul.cc"), "-o", obj],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    objs.append(obj)
  lib = os.path.join(out_dir, "libold.so")
  subprocess.run([build.find_compiler(), "-shared", "-pthread", *objs, "-o", lib], check=True)
  return lib


def ab_variants(old_source: str):
  """name -> (call(x, packed, y, m, k, n, bw), weight dtype) for the old fp32, the new fp32 and
  the new bf16 entry points."""
  import ctypes
  import tempfile

  from specjax.kernels import build
  old = ctypes.CDLL(build_other(old_source, tempfile.mkdtemp()))
  new = ctypes.CDLL(build.build(library="matmul"))
  fns = {"old fp32": (old.specjax_dense_f32, np.float32),
         "new fp32": (new.specjax_dense_f32, np.float32)}
  if new.specjax_kernel_detected_bf16():
    fns["new bf16"] = (new.specjax_dense_bf16, jnp.bfloat16)
  for fn, _ in fns.values():
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 4
  return fns, new.specjax_kernel_threads()


def ab_shape(fns, k, n, rows, reps, rng, clock=time.perf_counter) -> dict:
  """(variant, M) -> median seconds per call of y[M,N] = x[M,K] @ W, cold weights."""
  bw = kernels.block_width(n, 2)
  w = rng.standard_normal((k, n)).astype(np.float32) / 30
  copies = max(1, int(64e6 // (k * n * 4)))
  packs = {v: [np.ascontiguousarray(kernels.pack_weight(w, bw=bw, dtype=dt))
               for _ in range(copies)] for v, (_, dt) in fns.items()}
  calls = max(copies, 4)
  out = {}
  for m in rows:
    x32 = rng.standard_normal((m, k)).astype(np.float32)
    xs = {v: np.ascontiguousarray(x32.astype(dt)) for v, (_, dt) in fns.items()}
    y = np.empty((m, n), np.float32)
    ys = {}
    for v in ("old fp32", "new fp32"):  # the same sums in the same order: the same bits
      ys[v] = np.empty((m, n), np.float32)
      fns[v][0](xs[v].ctypes.data, packs[v][0].ctypes.data, ys[v].ctypes.data, m, k, n, bw)
    if not np.array_equal(ys["old fp32"], ys["new fp32"]):
      print(f"  ({k}x{n}, M={m}: the new fp32 result differs from the old's)")
    times = {v: [] for v in fns}
    for _ in range(reps):
      for v, (fn, _) in fns.items():
        x, ps = xs[v], packs[v]
        t0 = clock()
        for i in range(calls):
          fn(x.ctypes.data, ps[i % copies].ctypes.data, y.ctypes.data, m, k, n, bw)
        times[v].append((clock() - t0) / calls)
    for v in fns:
      out[v, m] = statistics.median(times[v])
  return out


def peak():
  """This core's fp32 FMA, vdpbf16ps and vpdpbusd ceilings and qdot.cc's instruction mix
  (peak.cc: registers only, thread CPU time) and
  the memory's read bandwidth with 1 and 2 threads."""
  import subprocess
  import tempfile

  from specjax.kernels import build
  exe = os.path.join(tempfile.mkdtemp(), "peak")
  subprocess.run([build.find_compiler(), "-O3", "-mavx512f", "-mavx512bw", "-mavx512vnni",
                  "-mavx512bf16",
                  os.path.join(os.path.dirname(__file__), "peak.cc"), "-o", exe], check=True)
  print(subprocess.run([exe], check=True, capture_output=True, text=True).stdout.strip())
  from specjax import bench
  for mib in (512, 96):  # a buffer past the caches; one the size of SmolLM2's GGUF blocks
    print(f"memory read, {mib} MiB (bench.measure_read_bandwidth, every core): "
          f"{bench.measure_read_bandwidth(mib << 20) / 1e9:.1f} GB/s")


def ab(args):
  """The kernel alone, before / after (and bf16), per shape and M; see the module docstring."""
  fns, nthreads = ab_variants(args.ab)
  if args.cpu_time and nthreads != 1:
    sys.exit("--cpu-time measures the calling thread only: set SPECJAX_KERNEL_THREADS=1")
  clock = time.thread_time if args.cpu_time else time.perf_counter
  rows = [int(r) for r in args.rows.split(",")]
  print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: A/B old={args.ab} new=this tree, "
        f"ctypes, {nthreads} threads, {'CPU' if args.cpu_time else 'wall'} time, load average "
        f"{os.getloadavg()[0]:.2f}")
  rng = np.random.default_rng(0)
  total = {key: 0.0 for key in ((v, m) for v in fns for m in rows)}
  print("| shape | variant | " + " | ".join(f"M={m}" for m in rows) + " |")
  print("|---" * (len(rows) + 2) + "|")
  for name, k, n, count in SHAPES:
    med = ab_shape(fns, k, n, rows, args.reps, rng, clock)
    for v in fns:
      cells = []
      for m in rows:
        t = med[v, m]
        total[v, m] += count * t
        speed = f", x{med['old fp32', m] / t:.2f}" if v != "old fp32" else ""
        cells.append(f"{t * 1e6:.0f} us, {2 * m * k * n / t / 1e9:.0f} GF/s{speed}")
      print(f"| {name} {k}x{n} | {v} | " + " | ".join(cells) + " |", flush=True)
  for v in fns:
    cells = [f"{total[v, m] * 1e3:.1f} ms, c {total[v, m] / total[v, rows[0]]:.2f}" for m in rows]
    print(f"| forward's products | {v} | " + " | ".join(cells) + " |")
  print(f"load average at the end {os.getloadavg()[0]:.2f}; c = time(M) / time(M={rows[0]}) of "
        f"the same variant; xR = old fp32 / this")


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
  ap.add_argument("--sizes", default="1,2,4,8,16,32,64", help="the cost curve's T values")
  ap.add_argument("--bf16", action="store_true", help="the bfloat16 model in the curve too")
  ap.add_argument("--attention", action="store_true", help="also the kernel model with XLA's "
                  "attention instead of the attention kernel (specjax/kernels/attention.py)")
  ap.add_argument("--ab", metavar="OLD_MATMUL_CC", help="the kernel alone, A/B against another "
                  "matmul.cc (ctypes)")
  ap.add_argument("--rows", default="1,2,4,8,16,32,64", help="the M values of --ab")
  ap.add_argument("--cpu-time", action="store_true", help="--ab on one kernel thread, timed by "
                  "the thread's CPU time (leaves out the time other processes hold the core)")
  ap.add_argument("--peak", action="store_true", help="only this core's arithmetic ceilings "
                  "and the memory's read bandwidth (peak.cc; needs AVX512-BF16)")
  args = ap.parse_args(argv)
  if args.peak:
    return peak()
  if args.ab:
    return ab(args)
  reps = 5 if args.quick else args.reps
  sizes = [int(t) for t in args.sizes.split(",")]

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
  if args.attention:
    models[XLA_ATTENTION] = ker
  if args.bf16:
    xla16 = sj.load_model("smollm2-135m", kernels=False, dtype=jnp.bfloat16)
    models.update({"xla bf16": xla16, "kernel bf16": packing.pack(xla16)})
  if not args.skip_curve:
    curve(models, sizes, reps, bw)
  if args.methods:
    del xla, models
    n, max_new = (1, 64) if args.quick else (args.prompts, args.max_new)
    methods_bench(ker, n, max_new, args.repeat,
                  [c for c in args.categories.split(",") if c] or None)


def curve(models, sizes, reps, bw):
  for xla, ker in (("xla", "kernel"), ("xla bf16", "kernel bf16")):
    if ker in models:
      print(f"max relative logit difference {ker} vs {xla} over T={sizes}: "
            f"{check_outputs({xla: models[xla], ker: models[ker]}, sizes):.2e}")
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
  for xla, ker in (("xla", "kernel"), ("xla bf16", "kernel bf16")):
    if ker in models:
      print(f"| {ker} / {xla} | " + " | ".join(f"{med[ker][t] / med[xla][t]:.2f}" for t in sizes)
            + " |")
  if XLA_ATTENTION in models:
    print(f"| kernel / {XLA_ATTENTION} | " + " | ".join(
        f"{med['kernel'][t] / med[XLA_ATTENTION][t]:.2f}" for t in sizes) + " |")
  if "kernel bf16" in models:
    print("| kernel bf16 / kernel | " + " | ".join(
        f"{med['kernel bf16'][t] / med['kernel'][t]:.2f}" for t in sizes) + " |")
  for name, m in models.items():
    nbytes = m.num_param_bytes
    print(f"{name}: {nbytes / 1e6:.0f} MB of weights per forward / {med[name][1]:.1f} ms = "
          f"{nbytes / med[name][1] / 1e6:.1f} GB/s at T=1 "
          f"({nbytes / med[name][1] / 1e6 / bw['2 threads']:.0%} of the 2-thread probe)")


if __name__ == "__main__":
  main()
