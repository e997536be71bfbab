"""One layer's decode attention (specjax/kernels/attention.cc) by itself: microseconds per call
for the shapes decoding gives it, SmolLM2-135M's heads (3 kv heads x 3 queries x 64), a cache of
512 slots with 256 visible, the new tokens a causal chain.

    .venv/bin/python experiments/kernels/attention_bench.py [--calls 300] [--threads 2]

Shapes: B x T = 1 x 1 (a decode step), 1 x 8 and 1 x 16 (a verification block), 16 x 1 (a batch
of 16 decode steps, each row its own cache), 1 x 64 (a long block). Each shape is one jitted call
of `attention._kernel`, compiled and run once, then timed `--calls` times; the median is printed.
To compare two versions of the kernel, run the script from a checkout of each, one after the
other on a quiet machine (each checkout builds its own library).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

SHAPES = ((1, 1), (1, 8), (1, 16), (16, 1), (1, 64))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--calls", type=int, default=300)
  ap.add_argument("--threads", type=int, default=2, help="kernel threads (SPECJAX_KERNEL_THREADS)")
  args = ap.parse_args(argv)
  os.environ["SPECJAX_KERNEL_THREADS"] = str(args.threads)

  import jax
  import jax.numpy as jnp
  import numpy as np

  from specjax.kernels import attention

  if not attention.available():
    sys.exit("the attention kernel is unavailable on this machine")
  rng = np.random.default_rng(0)
  k, g, s, d, filled = 3, 3, 512, 64, 256
  print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, path {attention.isa()}, "
        f"{args.threads} threads, load average {os.getloadavg()[0]:.2f}")
  for b, t in SHAPES:
    q = rng.standard_normal((b, t, k, g, d)).astype(np.float32)
    kc, vc = (rng.standard_normal((b, k, s, d)).astype(np.float32) for _ in range(2))
    kn, vn = (rng.standard_normal((b, t, k, d)).astype(np.float32) for _ in range(2))
    mask = np.zeros((b, t, s + t), bool)
    mask[:, :, :filled] = True
    mask[:, :, s:] = np.tril(np.ones((t, t), bool))
    ops = [jnp.asarray(a) for a in (q, kc, vc, kn, vn, mask)]
    f = jax.jit(lambda *a: attention._kernel(*a, 0.125, 0.0))
    jax.block_until_ready(f(*ops))
    times = []
    for _ in range(args.calls):
      t0 = time.perf_counter()
      jax.block_until_ready(f(*ops))
      times.append(time.perf_counter() - t0)
    print(f"B={b:2d} T={t:2d}: {1e6 * statistics.median(times):7.1f} us per call")
  print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
  main()
