"""Micro-benchmark: the GGUF-blocks matmul (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) against the fp32
kernel on SmolLM2-135M's dense shapes, M = 1, 8, 32, 64 rows.

    .venv/bin/python experiments/kernels/blocks_bench.py [--reps 21] [--calls 50]

Each timing is one jitted lax.fori_loop of --calls products (each call's input depends on the
previous output, so none is hoisted or skipped), median of --reps runs, divided by --calls: the
time of one product inside a compiled program, dispatch excluded. GB/s counts the weight bytes
each call reads (the packed copy: fp32, or the blocks as stored). The fp32 kernel takes M <= 32,
so its M = 64 column is XLA's dot. Random weights (the timing does not depend on the values).
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

# (name, K, N): SmolLM2-135M's per-layer products and its head
SHAPES = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576),
          ("head", 576, 49152)]
ROWS = (1, 8, 32, 64)


def timed(fn, args, reps: int, calls: int) -> float:
  """Median seconds per product over reps runs of a compiled loop of `calls` products."""
  def loop(x, *rest):
    def body(i, carry):
      h, _ = carry
      y = fn(x + h * 1e-30, *rest)
      return y[0, 0], y
    return jax.lax.fori_loop(0, calls, body, (jnp.float32(0), fn(x, *rest)))[1]

  f = jax.jit(loop)
  f(*args).block_until_ready()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    f(*args).block_until_ready()
    times.append(time.perf_counter() - t)
  return float(np.median(times)) / calls


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


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--reps", type=int, default=21)
  ap.add_argument("--calls", type=int, default=50)
  args = ap.parse_args(argv)
  print(f"blocks isa={blocks.isa()} matmul isa={kernels.isa()} threads={kernels.threads()} "
        f"load average={os.getloadavg()[0]:.2f}")
  rng = np.random.default_rng(0)
  print(f"{'shape':>8} {'type':>5} " + " ".join(f"{'M=' + str(m):>22}" for m in ROWS))
  for name, k, n in SHAPES:
    w = rng.standard_normal((k, n)).astype(np.float32) / 30
    packed32 = jnp.asarray(kernels.pack_weight(w))
    wj = jnp.asarray(w)
    rows = {}
    for m in ROWS:
      x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
      rows[m] = (timed(lambda x, w, p: kernels.dense(x, w, p), (x, wj, packed32), args.reps,
                       args.calls), packed32.nbytes)
    base = rows
    print(f"{name:>8} {'fp32':>5} " + " ".join(
        f"{t * 1e6:8.1f}us {b / t / 1e9:6.1f}GB/s     " for t, b in rows.values()))
    for qtype in ("Q4_1", "Q4_0", "Q8_0", "Q4_K", "Q6_K"):
      if k % blocks.QTYPES[qtype][1]:
        continue  # (K = 576 is not a multiple of the K-quants' 256)
      packed = jnp.asarray(blocks.pack_blocks(random_raw(rng, n, k, qtype), n, k, qtype))
      cells = []
      for m in ROWS:
        x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
        t = timed(lambda x, p: blocks.blocks_dense(x, p, n, k, qtype), (x, packed), args.reps,
                  args.calls)
        cells.append(f"{t * 1e6:8.1f}us {packed.nbytes / t / 1e9:6.1f}GB/s x{base[m][0] / t:4.2f}")
      print(f"{name:>8} {qtype:>5} " + " ".join(cells))
  print("xR: the fp32 kernel's time / this one's (> 1: faster than fp32); fp32 M=64 is XLA's dot")


if __name__ == "__main__":
  main()
