"""Micro-benchmark: the int8 x Q4_1 integer-dot kernel (specjax.kernels.qdot) against the fp32
kernel (specjax.kernels.matmul) and the dequantising Q4_1 kernel (specjax.kernels.blocks) on
SmolLM2-135M's dense shapes, M = 1, 4, 8, 16 rows.

    .venv/bin/python experiments/kernels/qdot_bench.py [--reps 21] [--calls 50] [--no-blocks]
        [--stream MB]

Each timing is one jitted lax.fori_loop of --calls products (each call's input depends on the
previous output, so none is hoisted or skipped), median of --reps runs, divided by --calls: the
time of one product inside a compiled program, dispatch excluded. GB/s counts the weight bytes
each call reads (the packed copy: fp32 [nb, K, bw]; qdot's 384-byte records, 0.75 bytes a weight;
the blocks kernel's GGUF Q4_1 bytes, 0.625 a weight). Random weights (the timing does not depend
on the values).

Every call above reads the same weight, which a last-level cache holds after the first. A decode
step reads each weight once from memory (SmolLM2-135M's are ~100 MB). `--stream MB` times qdot
alone on weights read from memory: each shape's loop cycles through distinct copies of its
packed weight, at least MB of them (default 0: off; pass more than the last-level cache), and
the time is per product.

The shapes: SmolLM2-135M has E = 576, 9 query heads, 3 KV heads of 64, F = 1536
and a 49152-token vocabulary, so the fused QKV is 576 x 960, the attention output 576 x 576, the
fused gate/up 576 x 3072, the down projection 1536 x 576 and the head 576 x 49152.
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
from specjax.kernels import blocks, qdot  # noqa: E402

# (name, K, N): SmolLM2-135M's per-layer products and its head
SHAPES = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576),
          ("head", 576, 49152)]
ROWS = (1, 4, 8, 16)


def timed_stream(n, k, rows, rng, reps: int, calls: int, mbytes: int) -> tuple[float, int]:
  """(median seconds per product, bytes per product) for qdot over distinct copies of a random
  GGUF-like Q4_1 weight (fp16 scales) totalling at least `mbytes` MB, cycled through in order."""
  q, d, m = random_q41(rng, n, k)
  d, m = (a.astype(np.float16).astype(np.float32) for a in (d, m))
  one = qdot.pack(q, d, m)
  copies = max(1, -(-mbytes * 2**20 // one.nbytes))
  # separate arguments, each read where it lies (a slice of one stacked array would be copied)
  ws = [jnp.asarray(np.roll(one, i, axis=0)) for i in range(copies)]
  x = jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32))

  def sweep(x, ws):
    def body(i, carry):
      h, y = carry
      for w in ws:  # unrolled: one product per copy, each input depending on the last output
        y = qdot.dense(x + h * 1e-30, w, n, k)
        h = y[0, 0]
      return h, y
    return jax.lax.fori_loop(0, calls, body,
                             (jnp.float32(0), jnp.zeros((rows, n), jnp.float32)))[1]

  return median_seconds(jax.jit(sweep), (x, ws), reps) / (calls * copies), one.nbytes


def median_seconds(f, args, reps: int) -> float:
  """Median wall seconds of f(*args) over reps runs, after one run to compile."""
  f(*args).block_until_ready()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    f(*args).block_until_ready()
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def timed(fn, args, reps: int, calls: int) -> float:
  """Median seconds per product over reps runs of a compiled loop of `calls` products."""
  def loop(x, *rest):
    def body(i, carry):
      h, _ = carry
      y = fn(x + h * 1e-30, *rest)
      return y[0, 0], y
    return jax.lax.fori_loop(0, calls, body, (jnp.float32(0), fn(x, *rest)))[1]

  return median_seconds(jax.jit(loop), args, reps) / calls


def random_q41(rng, n, k):
  nblk = k // 32
  q = rng.integers(0, 16, (nblk, 32, n), dtype=np.uint8)
  d = rng.uniform(0.001, 0.01, (nblk, n)).astype(np.float32)
  m = rng.uniform(-0.05, 0.05, (nblk, n)).astype(np.float32)
  return q, d, m


def random_raw_q41(rng, n, k):
  """Random GGUF Q4_1 bytes [N, K/32 * 20] with finite fp16 d and m."""
  raw = rng.integers(0, 256, (n, k // 32, 20), dtype=np.uint8)
  raw[..., :4] = (rng.uniform(-0.05, 0.05, (n, k // 32, 2)).astype(np.float16)
                  .view(np.uint8).reshape(n, k // 32, 4))
  return raw.reshape(n, -1)


def cell(t, nbytes, base=None):
  s = f"{t * 1e6:8.1f}us {nbytes / t / 1e9:6.1f}GB/s"
  return s + (f" x{base / t:5.2f}" if base is not None else "       ")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--reps", type=int, default=21)
  ap.add_argument("--calls", type=int, default=50)
  ap.add_argument("--no-blocks", action="store_true", help="skip the dequantising Q4_1 kernel")
  ap.add_argument("--stream", type=int, default=0, metavar="MB",
                  help="time qdot alone on weights read from memory: distinct copies of at least "
                  "MB megabytes per shape (0: off)")
  args = ap.parse_args(argv)
  if not qdot.available():
    raise SystemExit("specjax.kernels.qdot is unavailable here (see its warning)")
  print(f"qdot isa={qdot.isa()} threads={qdot.threads()} matmul isa={kernels.isa()} "
        f"blocks isa={blocks.isa()} load average={os.getloadavg()[0]:.2f}")
  rng = np.random.default_rng(0)
  if args.stream:
    print(f"qdot on fp16-scale Q4_1 weights from memory (copies of >= {args.stream} MB per shape)")
    print(f"{'shape':>8} " + " ".join(f"{'M=' + str(m):>22}" for m in ROWS))
    for name, k, n in SHAPES:
      cells = []
      for m in ROWS:
        t, nbytes = timed_stream(n, k, m, rng, args.reps, args.calls, args.stream)
        cells.append(cell(t, nbytes))
      print(f"{name:>8} " + " ".join(cells))
    print(f"load average at the end={os.getloadavg()[0]:.2f}")
    return
  print(f"{'shape':>8} {'kernel':>6} " + " ".join(f"{'M=' + str(m):>29}" for m in ROWS))
  for name, k, n in SHAPES:
    xs = {m: jnp.asarray(rng.standard_normal((m, k)).astype(np.float32)) for m in ROWS}
    w = rng.standard_normal((k, n)).astype(np.float32) / 30
    packed32, wj = jnp.asarray(kernels.pack_weight(w)), jnp.asarray(w)
    base = {m: timed(lambda x, w, p: kernels.dense(x, w, p), (xs[m], wj, packed32), args.reps,
                     args.calls) for m in ROWS}
    print(f"{name:>8} {'fp32':>6} " + " ".join(cell(base[m], packed32.nbytes) for m in ROWS))
    del packed32, wj
    pq = jnp.asarray(qdot.pack(*random_q41(rng, n, k)))
    ts = {m: timed(lambda x, p: qdot.dense(x, p, n, k), (xs[m], pq), args.reps, args.calls)
          for m in ROWS}
    print(f"{name:>8} {'qdot':>6} " + " ".join(cell(ts[m], pq.nbytes, base[m]) for m in ROWS))
    if not args.no_blocks:
      pb = jnp.asarray(blocks.pack_blocks(random_raw_q41(rng, n, k), n, k, "Q4_1"))
      ts = {m: timed(lambda x, p: blocks.blocks_dense(x, p, n, k, "Q4_1"), (xs[m], pb),
                     args.reps, args.calls) for m in ROWS}
      print(f"{name:>8} {'blocks':>6} " + " ".join(cell(ts[m], pb.nbytes, base[m]) for m in ROWS))
  print("xR: the fp32 kernel's time / this one's (> 1: faster than fp32); blocks = the "
        f"dequantising Q4_1 kernel; load average at the end={os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
  main()
