"""A weight-streaming CPU matmul through jax.ffi, beside its pure-JAX fallback (`_xla`).

    y[M,N] = x[M,K] @ W,   M = B*T in [1, MAX_ROWS],   W packed once into [nb, K, bw]

Why. A decode step reads every weight once, and for 1..32 rows the arithmetic is small: a forward
of T tokens should cost about what a forward of one costs. XLA's CPU backend runs one row on a
bandwidth-bound matrix-vector path but 2-16 rows on its general GEMM path, which repacks the weight
on every call (2 tokens ~1.3-1.5x, 16 tokens ~2.4-2.8x one token on SmolLM2-135M). The kernel
(matmul.cc) instead streams each contiguous column block of the pre-packed weight once per call
and updates M rows of accumulators from it, on AVX-512, AVX2+FMA or a portable path picked at run
time, split over a small persistent thread pool (see experiments/kernels/README.md).

This file knows matrices, not models: `pack_weight` lays one [K, N] weight out for the kernel and
`dense` multiplies by it. Which of a model's weights get packed copies, and where those copies
live, is specjax/packing.py.

When the kernel runs. `dense(x, w, packed)` calls the kernel at trace time iff a packed copy is
present, x is float32 and M = prod(x.shape[:-1]) <= MAX_ROWS; otherwise, and whenever it is
differentiated (a custom_vjp whose forward rule is XLA's dot), it is XLA's dot on the original
weight. If the kernel cannot be built (no compiler, a failed build) or the CPU has neither AVX-512
nor AVX2+FMA, specjax warns once (KernelFallbackWarning) and stays on XLA: same tokens, XLA's
speed. Results match XLA to float32 rounding (the kernel sums k in order with FMAs), and a row's
result does not depend on how many rows share the call.

Environment: SPECJAX_KERNELS=0 (off), SPECJAX_KERNELS_ISA=avx512|avx2|scalar (force a path),
SPECJAX_KERNEL_THREADS (default: min(cores, 4)), SPECJAX_CXX (compiler), SPECJAX_CACHE (build
cache root; see build.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels.library import (ENV, ISAS, KernelFallbackWarning, Library,  # noqa: F401
                                     switched_off)

MAX_ROWS = 32  # the largest M = B*T sent to the kernel; larger calls (prefill) use XLA
TARGET = "specjax_dense_f32"
BLOCK_WIDTHS = (64, 48, 32, 16)


# ----------------------------------------------------------------------------- loading

def _detect_isa(lib) -> int:
  """The best path this CPU supports (0 scalar, 1 avx2+fma, 2 avx512). Tests replace this hook
  to simulate a CPU without vector instructions."""
  return lib.specjax_kernel_detected_isa()


LIBRARY = Library("matmul", "specjax_kernel", "SpecjaxDenseF32", TARGET, instead="using XLA's dot",
                  lacking="this CPU has neither AVX-512 nor AVX2+FMA: the portable kernel would "
                  "be slower than XLA", detect=lambda lib: _detect_isa(lib))


def load(cxx: str | None = None, cache_dir: str | None = None):
  """The loaded kernel library (ctypes.CDLL), building it on first use; None if unavailable.
  Tried once per process: a failure warns once (KernelFallbackWarning) and is remembered."""
  return LIBRARY.load(cxx, cache_dir)


def available() -> bool:
  """Whether the kernel is built, loaded and worth using on this CPU (builds it on first call)."""
  return LIBRARY.available()


def isa() -> str | None:
  """The instruction-set path in use ("avx512", "avx2", "scalar"), or None if unavailable."""
  return LIBRARY.isa()


def set_isa(name: str) -> str:
  """Forces a path the CPU supports (tests run all of them); returns the path now in use."""
  return LIBRARY.set_isa(name)


def threads() -> int:
  """The kernel's thread-pool size (1 when it is unavailable)."""
  return LIBRARY.threads()


def _reset_for_tests():
  """Forgets the load attempt, so the next call retries (tests of the fallback paths)."""
  LIBRARY.reset()


# ----------------------------------------------------------------------------- the packed layout


def block_width(n: int, num_threads: int) -> int:
  """Column-block width for an N-column weight: the widest block that splits N's blocks evenly
  over the threads (576 columns on 2 threads: 12 blocks of 48 rather than 9 of 64)."""
  def cost(bw):
    nb = -(-n // bw)
    return -(-nb // num_threads) * bw, -bw
  return min(BLOCK_WIDTHS, key=cost)


def pack_weight(w: np.ndarray, *, transposed: bool = False, num_threads: int | None = None,
                bw: int | None = None) -> np.ndarray:
  """A dense weight [K, N] (or [N, K] with transposed=True, e.g. a tied embedding) -> the
  kernel's layout [nb, K, bw] float32: column block j holds W[:, j*bw:(j+1)*bw] row by row,
  zero-padded past N."""
  w = np.asarray(w, np.float32)
  if w.ndim != 2:
    raise ValueError(f"pack_weight: expected a 2-D weight, got shape {w.shape}")
  wk = w.T if transposed else w  # [K, N] (a view)
  k, n = wk.shape
  bw = bw or block_width(n, num_threads or threads())
  nb = -(-n // bw)
  out = np.zeros((nb, k, bw), np.float32)
  full = n // bw
  if full:
    out[:full] = wk[:, :full * bw].reshape(k, full, bw).transpose(1, 0, 2)
  if n > full * bw:
    out[full, :, :n - full * bw] = wk[:, full * bw:]
  return out


# ----------------------------------------------------------------------------- the op


def _xla(x, w, transposed: bool):
  """x [..., K] @ w [K, ...] (or w [N, K] transposed) as XLA's dot: the fallback, and the
  reference the kernel is tested against."""
  return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1 if transposed else 0,)), ((), ())))


def _ffi(x2, packed, n: int):
  return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32),
                          vmap_method="sequential")(x2, packed)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _kernel(x2, w2, packed, transposed):
  """x2 [M,K] -> [M,N] through the kernel. w2 (the original weight, [K,N] or [N,K]) is only read
  when differentiated: the forward rule is then XLA's dot, so gradients never see the kernel."""
  return _ffi(x2, packed, w2.shape[0] if transposed else w2.shape[1])


def _kernel_fwd(x2, w2, packed, transposed):
  return _xla(x2, w2, transposed), (x2, w2)


def _kernel_bwd(transposed, res, g):
  x2, w2 = res
  if transposed:  # w2 [N,K]
    return g @ w2, g.T @ x2, None
  return g @ w2.T, x2.T @ g, None


_kernel.defvjp(_kernel_fwd, _kernel_bwd)


def dense(x: jax.Array, w: jax.Array, packed: jax.Array | None = None, *,
          transposed: bool = False) -> jax.Array:
  """x [..., K] @ w [K, *out] -> [..., *out]; transposed: w [N, K] -> [..., N] (a tied head).

  packed [nb, K, bw]: w's packed copy (pack_weight); with it, and M = prod(x.shape[:-1]) in
  [1, MAX_ROWS] and float32 operands, the product runs in the kernel, else in XLA's dot.
  """
  k = x.shape[-1]
  out = w.shape[:1] if transposed else w.shape[1:]
  m = int(np.prod(x.shape[:-1], dtype=np.int64))
  if (packed is None or not 1 <= m <= MAX_ROWS or x.dtype != jnp.float32
      or w.dtype != jnp.float32 or packed.dtype != jnp.float32 or not available()):
    return _xla(x, w, transposed)
  w2 = w if transposed else w.reshape(k, -1)
  y = _kernel(x.reshape(m, k), w2, packed, transposed)
  return y.reshape(*x.shape[:-1], *out)
