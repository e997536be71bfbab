"""Micro-benchmark: the GGUF-blocks matmul (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) against the fp32
kernel on SmolLM2-135M's dense shapes, M = 1, 4, 8, 16 rows (--rows).

    .venv/bin/python experiments/kernels/blocks_bench.py [--reps 21] [--calls 50] [--rows 1,4,8,16]
    .venv/bin/python experiments/kernels/blocks_bench.py --ab OLD_blocks.cc [--types Q4_1,Q8_0]

--ab: an A/B of two versions of the kernel in one process, through the libraries' ctypes entry
(specjax_blocks_f32, host pointers, no jit): OLD_blocks.cc (e.g. `git show REV:specjax/kernels/
blocks.cc > /tmp/old.cc`; pool.h is taken from this tree) is compiled with the same flags beside
the current build, and the two are timed in alternating batches of --calls calls (median of
--reps batches each, per call; the ~1 us a ctypes call costs is in both).

Each timing is one jitted lax.fori_loop of --calls products (each call's input depends on the
previous output, so none is hoisted or skipped), median of --reps runs, divided by --calls: the
time of one product inside a compiled program, dispatch excluded. GB/s counts the weight bytes
each call reads (the packed copy: fp32, or the blocks as stored). The fp32 kernel takes M <= 32,
so an M = 64 column (--rows) is XLA's dot. Random weights (the timing does not depend on the values).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from specjax import kernels  # noqa: E402
from specjax.kernels import blocks  # noqa: E402

from qdot_bench import timed  # noqa: E402 (this folder's benchmarks time products alike)

# (name, K, N): SmolLM2-135M's per-layer products and its head
SHAPES = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576),
          ("head", 576, 49152)]


def random_raw(rng, n, k, qtype):
  """Random GGUF bytes [N, K/block * bytes] with finite fp16 fields."""
  _, block, tb, fields = blocks.QTYPES[qtype]
  raw = rng.integers(0, 256, (n, k // block, tb), dtype=np.uint8)
  o = 0
  for size, count in fields:
    if size == 2:
      raw[..., o:o + 2 * count] = (rng.uniform(-0.05, 0.05, (n, k // block, count))
                                   .astype(np.float16).view(np.uint8).reshape(n, k // block, -1))
    o += size * count
  return raw.reshape(n, -1)


def build_other(source: str, out_dir: str) -> str:
  """Compiles another version of blocks.cc (with this tree's pool.h) as build.build does."""
  import shutil
  import subprocess

  from specjax.kernels import build
  here = os.path.join(os.path.dirname(build.__file__))
  shutil.copy(source, os.path.join(out_dir, "blocks.cc"))
  shutil.copy(os.path.join(here, "pool.h"), os.path.join(out_dir, "pool.h"))
  extra = build.LIBRARIES["blocks"][2]
  objs = []
  for part, flags in build._parts():
    obj = os.path.join(out_dir, part + ".o")
    subprocess.run([build.find_compiler(), *build.BASE_FLAGS, *flags, *extra.get("*", ()),
                    *extra.get(part, ()), f"-DSJ_PART={part}", "-I", jax.ffi.include_dir(),
                    "-c", os.path.join(out_dir, "blocks.cc"), "-o", obj], check=True)
    objs.append(obj)
  lib = os.path.join(out_dir, "libold.so")
  subprocess.run([build.find_compiler(), "-shared", "-pthread", *objs, "-o", lib], check=True)
  return lib


def ab(args):
  """Alternating batches of ctypes calls into the old and the current library."""
  import ctypes
  import tempfile

  from specjax.kernels import build
  tmp = tempfile.mkdtemp()
  libs = {"old": ctypes.CDLL(build_other(args.ab, tmp)),
          "new": ctypes.CDLL(build.build(library="blocks"))}
  for lib in libs.values():
    lib.specjax_blocks_f32.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                                       ctypes.c_long]
  print(f"A/B old={args.ab} new=this tree, ctypes, threads={libs['new'].specjax_blocks_threads()}"
        f" load average {open('/proc/loadavg').read().split()[0]}")
  rng = np.random.default_rng(0)
  rows = [int(r) for r in args.rows.split(",")]
  print(f"{'shape':>8} {'type':>5} " + " ".join(f"{'M=' + str(m) + ' old/new':>24}" for m in rows))
  for name, k, n in SHAPES:
    for qtype in args.types.split(","):
      if k % blocks.QTYPES[qtype][1]:
        continue
      packed = np.ascontiguousarray(blocks.pack_blocks(random_raw(rng, n, k, qtype), n, k, qtype))
      code = blocks.QTYPES[qtype][0]
      cells = []
      for m in rows:
        x = rng.standard_normal((m, k)).astype(np.float32)
        ys = {v: np.empty((m, n), np.float32) for v in libs}
        calls = max(3, min(args.calls, int(2e5 / (m * n * k / 16 / 1e3 + 1))))
        times = {v: [] for v in libs}
        for _ in range(args.reps):
          for v, lib in libs.items():
            f, y = lib.specjax_blocks_f32, ys[v]
            t = time.perf_counter()
            for _ in range(calls):
              f(code, x.ctypes.data, packed.ctypes.data, y.ctypes.data, m, k, n)
            times[v].append((time.perf_counter() - t) / calls)
        old, new = (float(np.median(times[v])) * 1e6 for v in ("old", "new"))
        cells.append(f"{old:8.1f} /{new:7.1f}us x{old / new:4.2f}")
      print(f"{name:>8} {qtype:>5} " + " ".join(cells), flush=True)
  print(f"load average at the end {open('/proc/loadavg').read().split()[0]}")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--reps", type=int, default=21)
  ap.add_argument("--calls", type=int, default=50)
  ap.add_argument("--rows", default="1,4,8,16", help="the M values, comma-separated")
  ap.add_argument("--types", default="Q4_1,Q4_0,Q8_0,Q4_K,Q6_K")
  ap.add_argument("--ab", metavar="OLD_BLOCKS_CC", help="A/B against another blocks.cc (ctypes)")
  args = ap.parse_args(argv)
  if args.ab:
    return ab(args)
  rows_m = [int(r) for r in args.rows.split(",")]
  print(f"blocks isa={blocks.isa()} matmul isa={kernels.isa()} threads={kernels.threads()} "
        f"load average={os.getloadavg()[0]:.2f}")
  rng = np.random.default_rng(0)
  print(f"{'shape':>8} {'type':>5} " + " ".join(f"{'M=' + str(m):>22}" for m in rows_m))
  for name, k, n in SHAPES:
    w = rng.standard_normal((k, n)).astype(np.float32) / 30
    packed32 = jnp.asarray(kernels.pack_weight(w))
    wj = jnp.asarray(w)
    rows = {}
    for m in rows_m:
      x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
      rows[m] = (timed(lambda x, w, p: kernels.dense(x, w, p), (x, wj, packed32), args.reps,
                       args.calls), packed32.nbytes)
    base = rows
    print(f"{name:>8} {'fp32':>5} " + " ".join(
        f"{t * 1e6:8.1f}us {b / t / 1e9:6.1f}GB/s     " for t, b in rows.values()))
    for qtype in args.types.split(","):
      if k % blocks.QTYPES[qtype][1]:
        continue  # (K = 576 is not a multiple of the K-quants' 256)
      packed = jnp.asarray(blocks.pack_blocks(random_raw(rng, n, k, qtype), n, k, qtype))
      cells = []
      for m in rows_m:
        x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
        t = timed(lambda x, p: blocks.blocks_dense(x, p, n, k, qtype), (x, packed), args.reps,
                  args.calls)
        cells.append(f"{t * 1e6:8.1f}us {packed.nbytes / t / 1e9:6.1f}GB/s x{base[m][0] / t:4.2f}")
      print(f"{name:>8} {qtype:>5} " + " ".join(cells))
  print("xR: the fp32 kernel's time / this one's (> 1: faster than fp32); fp32 at M > 32 is "
        "XLA's dot")


if __name__ == "__main__":
  main()
