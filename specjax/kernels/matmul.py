"""A weight-streaming CPU matmul through jax.ffi, beside its pure-JAX fallback (`_xla`).

    y[M,N] = x[M,K] @ W,   M = B*T in [1, MAX_ROWS],   W packed once into [nb, K, bw]
                                                       (bf16: [nb, ceil(K/2), 2 * bw])

Why. A decode step reads every weight once, and for few rows the arithmetic is small: a forward
of T tokens should cost about what a forward of one costs. XLA's CPU backend runs one row on a
bandwidth-bound matrix-vector path but 2-16 rows on its general GEMM path, which repacks the weight
on every call (2 tokens ~1.3-1.5x, 16 tokens ~2.4-2.8x one token on SmolLM2-135M). The kernel
(matmul.cc) instead streams each contiguous column block of the pre-packed weight once per call
and updates register tiles of up to 6-8 rows from it (further tiles re-read the block from L2), on
AVX-512, AVX2+FMA or a portable path picked at run time, split over a small persistent thread pool
(see experiments/kernels/README.md). Past ~16 rows the fp32 product is bound by the FMA units, not
the bytes: the register tiles reach up to ~90% of one core's measured FMA peak.

bfloat16 weights (a model loaded with dtype=jnp.bfloat16): the packed copy holds each column's
pairs (k = 2p, 2p + 1) side by side, half the bytes, and the kernel multiplies bf16 activations by
it in AVX512-BF16's `vdpbf16ps` arithmetic (two exact products per fp32 lane, the odd one then
the even one added to the fp32 accumulator, pair by pair, denormals flushed). Float32 activations
(the model's: model.py keeps its residual stream in float32 at every weight dtype) are rounded to
bf16 on the way in and the fp32 sums come out as they are, as llama.cpp runs a BF16 tensor; bf16
activations get their result rounded to bf16, as XLA's bf16 dot does. The sums equal XLA's up to
fp32 summation order, and a row's result never depends on the other rows of the call. The
instruction itself runs on a CPU with AVX512-BF16; the AVX2 and scalar paths compute the same
arithmetic from fp32 FMAs, so every path gives the same bits.

This file knows matrices, not models: `pack_weight` lays one [K, N] weight out for the kernel and
`dense` multiplies by it. Which of a model's weights get packed copies, and where those copies
live, is specjax/packing.py.

When the kernel runs. `dense(x, w, packed)` calls the kernel at trace time iff a packed copy is
present, w and the copy are both float32 (or both bfloat16), x is float32 or w's dtype, and
M = prod(x.shape[:-1]) <= MAX_ROWS; otherwise, and whenever it is differentiated (a custom_vjp
whose forward rule is XLA's dot), it is XLA's dot on the original weight. If the kernel cannot be built (no compiler, a failed build) or the CPU has neither AVX-512
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
                                     on_cpu, rows_of, switched_off)

MAX_ROWS = 64  # the largest M = B*T sent to the kernel; larger calls (prefill) use XLA
TARGET = "specjax_dense_f32"
TARGET_BF16 = "specjax_dense_bf16"
BLOCK_WIDTHS = (64, 48, 32, 16)


# ----------------------------------------------------------------------------- loading

def _detect_isa(lib) -> int:
  """The best path this CPU supports (0 scalar, 1 avx2+fma, 2 avx512). Tests replace this hook
  to simulate a CPU without vector instructions."""
  return lib.specjax_kernel_detected_isa()


_BF16_REGISTERED = []


def _setup(lib):
  """The bf16 entry point beside the fp32 one (the Library registers only its main target)."""
  if not _BF16_REGISTERED:  # once per process, as the Library does for TARGET
    jax.ffi.register_ffi_target(TARGET_BF16, jax.ffi.pycapsule(lib.SpecjaxDenseBF16),
                                platform="cpu")
    _BF16_REGISTERED.append(True)


LIBRARY = Library("matmul", "specjax_kernel", "SpecjaxDenseF32", TARGET, instead="using XLA's dot",
                  lacking="this CPU has neither AVX-512 nor AVX2+FMA: the portable kernel would "
                  "be slower than XLA", detect=lambda lib: _detect_isa(lib), setup=_setup)

# The module's loading and ISA control are its Library's (library.py).
load, available, isa, set_isa, threads = LIBRARY.api()


# ----------------------------------------------------------------------------- the packed layout


def block_width(n: int, num_threads: int) -> int:
  """Column-block width for an N-column weight: the widest block that splits N's blocks evenly
  over the threads (576 columns on 2 threads: 12 blocks of 48 rather than 9 of 64)."""
  def cost(bw):
    nb = -(-n // bw)
    return -(-nb // num_threads) * bw, -bw
  return min(BLOCK_WIDTHS, key=cost)


def pack_weight(w: np.ndarray, *, transposed: bool = False, num_threads: int | None = None,
                bw: int | None = None, dtype=None) -> np.ndarray:
  """A dense weight [K, N] (or [N, K] with transposed=True, e.g. a tied embedding) -> the
  kernel's layout: float32 [nb, K, bw], column block j holding W[:, j*bw:(j+1)*bw] row by row,
  zero-padded past N; or, for dtype bfloat16 (the default when w is bfloat16), [nb, ceil(K/2),
  2 * bw] with W[2p, c] and W[2p+1, c] side by side (a zero row pads an odd K)."""
  w = np.asarray(w)
  if w.ndim != 2:
    raise ValueError(f"pack_weight: expected a 2-D weight, got shape {w.shape}")
  dtype = np.dtype(dtype or (jnp.bfloat16 if w.dtype == jnp.bfloat16 else np.float32))
  if dtype not in (np.dtype(np.float32), np.dtype(jnp.bfloat16)):
    raise ValueError(f"pack_weight: dtype={dtype}: expected float32 or bfloat16")
  wk = (w.T if transposed else w).astype(dtype, copy=False)  # [K, N]
  k, n = wk.shape
  bw = bw or block_width(n, num_threads or threads())
  nb = -(-n // bw)
  out = np.zeros((nb, k, bw), dtype)
  full = n // bw
  if full:
    out[:full] = wk[:, :full * bw].reshape(k, full, bw).transpose(1, 0, 2)
  if n > full * bw:
    out[full, :, :n - full * bw] = wk[:, full * bw:]
  if dtype == np.float32:
    return out
  if k % 2:
    out = np.concatenate([out, np.zeros((nb, 1, bw), dtype)], axis=1)
  # [nb, K, bw] -> [nb, K/2, 2, bw] -> [nb, K/2, bw, 2]: a column's pair in one 32-bit lane
  return np.ascontiguousarray(out.reshape(nb, -1, 2, bw).transpose(0, 1, 3, 2)).reshape(nb, -1, 2 * bw)


# ----------------------------------------------------------------------------- the op


def _xla(x, w, transposed: bool):
  """x [..., K] @ w [K, ...] (or w [N, K] transposed) as XLA's dot: the fallback, and the
  reference the kernel is tested against. Float32 x and a half-precision w: x rounded to w's
  dtype, the sums and the result in float32 (`wide`)."""
  dims = (((x.ndim - 1,), (1 if transposed else 0,)), ((), ()))
  if wide(x, w):
    return jax.lax.dot_general(x.astype(w.dtype), w, dims, preferred_element_type=jnp.float32)
  return jax.lax.dot_general(x, w, dims)


def wide(x, w) -> bool:
  """Whether x @ w takes float32 activations into a half-precision (bf16, f16) weight's
  product: x rounded to w's dtype, float32 sums and result."""
  return x.dtype == jnp.float32 and w.dtype in (jnp.bfloat16, jnp.float16)


def over_rows(a, b):
  """a [..., P]^T @ b [..., Q] -> [P, Q], summed over every leading dimension (a weight's
  gradient from activations of any batch shape)."""
  lead = tuple(range(a.ndim - 1))
  return jax.lax.dot_general(a, b, ((lead, lead), ((), ())))


def _ffi(x, packed, n: int):
  target = TARGET_BF16 if packed.dtype == jnp.bfloat16 else TARGET
  return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.float32),
                          vmap_method="sequential")(x, packed)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _kernel(x, w2, packed, transposed):
  """x [..., K] -> [..., N] through the kernel (fp32 accumulation; rounded to x's dtype, or,
  float32 x into a bf16 copy, x rounded to bf16 and the result in float32). w2 (the original
  weight, [K,N] or [N,K]) is only read when differentiated: the forward rule is then XLA's dot,
  so gradients never see the kernel."""
  n = w2.shape[0] if transposed else w2.shape[1]
  if wide(x, packed):
    return _ffi(x.astype(packed.dtype), packed, n)
  return _ffi(x, packed, n).astype(x.dtype)


def _kernel_fwd(x, w2, packed, transposed):
  return _xla(x, w2, transposed), (x, w2)


def _kernel_bwd(transposed, res, g):
  x, w2 = res
  if transposed:  # w2 [N,K]
    return (g @ w2).astype(x.dtype), over_rows(g, x).astype(w2.dtype), None
  return (g @ w2.T).astype(x.dtype), over_rows(x, g).astype(w2.dtype), None


_kernel.defvjp(_kernel_fwd, _kernel_bwd)


def _on_kernel(x, w, packed) -> bool:
  """Whether the kernel takes this product: w and its packed copy float32 or bfloat16 alike, x
  float32 or w's dtype."""
  if packed is None or not w.dtype == packed.dtype or x.dtype not in (w.dtype, jnp.float32):
    return False
  return w.dtype in (jnp.float32, jnp.bfloat16) and available()


def dense(x: jax.Array, w: jax.Array, packed: jax.Array | None = None, *,
          transposed: bool = False) -> jax.Array:
  """x [..., K] @ w [K, *out] -> [..., *out]; transposed: w [N, K] -> [..., N] (a tied head).

  packed: w's packed copy (pack_weight); with it, M = prod(x.shape[:-1]) in [1, MAX_ROWS], w
  of its dtype (float32 or bfloat16) and x float32 or w's dtype, the product runs in the kernel,
  else in XLA's dot. Float32 x and a bf16 (or f16) w: x is rounded to w's dtype on the way in,
  and the float32 sums come out unrounded (`wide`), on either path.
  """
  k = x.shape[-1]
  out = w.shape[:1] if transposed else w.shape[1:]
  m = int(np.prod(x.shape[:-1], dtype=np.int64))
  if not 1 <= m <= MAX_ROWS or not _on_kernel(x, w, packed):
    return _xla(x, w, transposed)
  w2 = w if transposed else w.reshape(k, -1)
  y = on_cpu(lambda a, b, p: _kernel(a, b, p, transposed), lambda a, b, p: _xla(a, b, transposed),
             rows_of(x), w2, packed)
  return y.reshape(*x.shape[:-1], *out)
