"""Dense products in low precision, in pure JAX: 4- or 8-bit weight blocks times int8 activations.

    y[M,N] ~ x[M,K] @ W[K,N],   W cast once to blocks of 32 along K,   x cast to int8 per call

What a quantized self-draft (specjax/methods/quantized.py) multiplies by. This file is the
reference and the fallback on every device (on a TPU or GPU it is the path itself); on a CPU with
the integer-dot kernel (kernels/qdot.py: AVX-512 VNNI / AVX2), products of 1..64 rows (4- and
8-bit) run there instead, on the same math up to float summation order.

The math. K is zero-padded to a multiple of 32 (weights and activations: the pads multiply zeros
and add nothing); block b holds k = 32 b + i, i in [0, 32).

  weights, cast once (per block b, per output column n; w_i = W[32 b + i, n]):
    Q4_1 (bits=4)  d = (max w - min w) / 15,  m = min w,  q_i = round((w_i - m) / d) in 0..15
                   (q = 0 where d = 0), so w_i ~ d q_i + m. Weights dequantised from a GGUF Q4_1
                   tensor come back as the same q (and d, m up to float rounding).
    Q8_0 (bits=8)  d = max |w| / 127,  q_i = round(w_i / d) in -127..127 (0 where d = 0), w ~ d q.

  activations, per call (per row, per block; llama.cpp's Q8_1):
    amax = max |x_i|,  inv = 127 / amax if amax > 0 else 0   (float32)
    xq_i = round-half-to-even(x_i * inv) clipped to [-127, 127]   (int8)
    dx = amax / 127   (float32),   sx = sum_i xq_i   (int32)

  the product (isum = sum_i q_i xq_i, an exact int32 from `lax.dot_general` on int8 operands):
    Q4_1   y[m,n] = sum_b  (d[b,n] dx[m,b]) isum[m,b,n] + m[b,n] (dx[m,b] sx[m,b])
    Q8_0   y[m,n] = sum_b  (d[b,n] dx[m,b]) isum[m,b,n]
  with the blocks summed as a fixed pairwise tree (kernels/reduce.py): every step is exact or
  elementwise, so a row's result does not depend on how many rows share the call.

A GGUF file's own Q4_1 and Q8_0 blocks become a QWeight as they are (`from_gguf`): the W4A8
target (`load_model(..., weights="blocks", activations="int8")`) multiplies by them.

A quantized weight (`QWeight`, a pytree) knows how to multiply itself (`QWeight.product`), so
`kernels.dense(x, w, packed)` takes one in place of a float packed copy without this module being
imported below it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels.qdot import quantize_activations  # noqa: F401 (llama.cpp's Q8_1)
from specjax.kernels.reduce import fixed_sum

BLOCK = 32  # k per block
BITS = (4, 8)  # Q4_1, Q8_0


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q", "d", "m", "packed"],
                   meta_fields=["bits", "k"])
@dataclasses.dataclass(frozen=True)
class QWeight:
  """A [K, N] weight in blocks of 32 along K (see the module docstring)."""
  q: jax.Array  # [Kp/32, 32, N] int8: 0..15 (bits 4) or -127..127 (bits 8); Kp = K rounded up to 32
  d: jax.Array  # [Kp/32, N] float32 scales
  m: jax.Array | None  # [Kp/32, N] float32 block minima (bits 4), None (bits 8)
  packed: jax.Array | None  # the integer-dot kernel's copy of (q, d, m) (on a CPU), or None
  bits: int
  k: int  # K before padding

  @property
  def n(self) -> int:
    return self.q.shape[-1]

  def product(self, x: jax.Array, norm=None) -> jax.Array:
    """x [..., K] -> [..., N] float32 (`qdense`; norm: its RMSNorm before the product)."""
    return qdense(x, self, norm)


def _padded(k: int) -> int:
  return -(-k // BLOCK) * BLOCK


def _check_bits(bits) -> None:
  if isinstance(bits, bool) or bits not in BITS:
    raise ValueError(f"bits={bits!r}: expected one of {BITS} (Q4_1 or Q8_0 blocks)")


@functools.partial(jax.jit, static_argnums=1)
def _cast(w: jax.Array, bits: int):
  """w [Kp, N] float32 -> (q [Kp/32, 32, N] int8, d [Kp/32, N], m [Kp/32, N] or None)."""
  wb = w.reshape(-1, BLOCK, w.shape[-1])  # [Kp/32, 32, N]
  if bits == 4:
    lo, hi = jnp.min(wb, axis=1), jnp.max(wb, axis=1)
    d = (hi - lo) / 15
    inv = jnp.where(d > 0, 1 / jnp.where(d > 0, d, 1), 0)
    q = jnp.clip(jnp.round((wb - lo[:, None]) * inv[:, None]), 0, 15)
    return q.astype(jnp.int8), d, lo
  amax = jnp.max(jnp.abs(wb), axis=1)
  inv = jnp.where(amax > 0, 127 / jnp.where(amax > 0, amax, 1), 0)
  q = jnp.clip(jnp.round(wb * inv[:, None]), -127, 127)
  return q.astype(jnp.int8), amax / 127, None


def _qdot():
  """The integer-dot kernel module if it is here and usable, else None."""
  try:
    from specjax.kernels import qdot
  except ImportError:  # pragma: no cover -- a checkout without the kernel
    return None
  return qdot if qdot.available() else None


def _pack_by_default(bits: int) -> bool:
  """Whether a weight gets the integer-dot kernel's copy when the caller does not say: where the
  default device is a CPU and the kernel is available."""
  return jax.default_backend() == "cpu" and _qdot() is not None


def quantize_weight(w, bits: int = 4, *, pack: bool | None = None) -> QWeight:
  """w [K, N] (any float) -> QWeight of 4-bit (Q4_1) or 8-bit (Q8_0) blocks, cast once.

  pack: also lay the blocks out for the integer-dot kernel. None = where the default device is a
  CPU and the kernel is available."""
  _check_bits(bits)
  w = jnp.asarray(w, jnp.float32)
  if w.ndim != 2 or w.shape[0] < 1 or w.shape[1] < 1:
    raise ValueError(f"w: expected a 2-D weight [K, N], got shape {w.shape}")
  k = w.shape[0]
  w = jnp.pad(w, ((0, _padded(k) - k), (0, 0)))
  q, d, m = _cast(w, bits)
  if pack is None:
    pack = _pack_by_default(bits)
  packed = None
  if pack:
    from specjax.kernels import qdot
    packed = jnp.asarray(qdot.pack(np.asarray(q), np.asarray(d),
                                   None if m is None else np.asarray(m)))
  return QWeight(q, d, m, packed, bits, k)


# GGUF block types read as they are: name -> (bits, bytes per block of 32). A Q4_0 block (w =
# d (q - 8)) is the Q4_1 block with m = -8 d (exact in float32).
GGUF_TYPES = {"Q4_0": (4, 18), "Q4_1": (4, 20), "Q8_0": (8, 34)}


def from_gguf(rows: np.ndarray, n: int, k: int, qtype: str, *, pack: bool | None = None) -> QWeight:
  """A GGUF tensor's stored blocks -> the QWeight [K, N] that holds the same numbers.

  rows: uint8 [N, K/32 * bytes], one row of blocks per output (gguf_file.gguf_blocks). Q4_1 block:
  d, m (fp16), 16 bytes whose low nibbles are elements 0..15 and high nibbles 16..31; Q4_0: d
  and the 16 bytes (m = -8 d); Q8_0: d (fp16), 32 int8. fp16 scales widen to float32 exactly.
  pack: as for `quantize_weight`."""
  if qtype not in GGUF_TYPES:
    raise ValueError(f"qtype={qtype!r}: int8 activations multiply {sorted(GGUF_TYPES)} blocks")
  bits, size = GGUF_TYPES[qtype]
  nb = k // BLOCK
  if k % BLOCK or rows.shape != (n, nb * size):
    raise ValueError(f"rows {rows.shape} are not {n} rows of {nb} {qtype} blocks (K={k})")
  blk = np.ascontiguousarray(rows).reshape(n, nb, size)
  d = blk[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32).T  # [nb, N]
  if bits == 4:
    q0 = qtype == "Q4_0"
    m = -8 * d if q0 else blk[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32).T
    qs = blk[:, :, 2 if q0 else 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int8)  # [N, nb, 32]
  else:
    m = None
    q = blk[:, :, 2:].view(np.int8)
  q = np.ascontiguousarray(q.transpose(1, 2, 0))  # [nb, 32, N]
  if pack is None:
    pack = _pack_by_default(bits)
  packed = None
  if pack:
    from specjax.kernels import qdot
    packed = jnp.asarray(qdot.pack(q, d, m))
  return QWeight(jnp.asarray(q), jnp.asarray(d), None if m is None else jnp.asarray(m), packed,
                 bits, k)


def _reference(x2: jax.Array, qw: QWeight) -> jax.Array:
  """x2 [M, Kp] float32 -> [M, N] float32 in XLA: the math of the module docstring.

  A single row is multiplied as two (itself twice): XLA's CPU integer dot takes a slow path for
  one row, much slower than for two (measured: docs/performance.md)."""
  if x2.shape[0] == 1:
    return _reference(jnp.concatenate([x2, x2]), qw)[:1]
  xq, dx, sx = quantize_activations(x2)
  isum = jax.lax.dot_general(xq, qw.q, (((2,), (1,)), ((1,), (0,))),
                             preferred_element_type=jnp.int32)  # [Kp/32, M, N]
  y = (qw.d[:, None, :] * dx.T[:, :, None]) * isum.astype(jnp.float32)
  if qw.m is not None:
    y = y + qw.m[:, None, :] * (dx * sx.astype(jnp.float32)).T[:, :, None]
  return fixed_sum(y, axis=0)  # blocks in a fixed order: a row's sum is the same whatever M is


def qdense(x: jax.Array, qw: QWeight, norm=None) -> jax.Array:
  """x [..., K] (any float; computed in float32) times the quantized weight -> [..., N] float32.
  norm: None, or (scale [K], eps): x's rows are RMS-normed first (qdot.norm_reference), inside
  the kernel's call where it runs.

  On the integer-dot kernel where qw carries its packed copy and the kernel is available (any
  M = prod(x.shape[:-1]): the kernel takes a prefill's rows in passes of qdot.MAX_ROWS), else
  `_reference` in XLA (the same up to float summation order)."""
  if x.shape[-1] != qw.k:
    raise ValueError(f"x: expected a last dimension of K={qw.k}, got shape {x.shape}")
  lead = x.shape[:-1]
  rows = int(np.prod(lead, dtype=np.int64))
  kp = _padded(qw.k)
  qdot = _qdot() if qw.packed is not None else None
  if qdot is not None and rows >= 1:
    # x keeps its leading dimensions into the kernel (no reshape around it: kernels/handler.h).
    pad = [(0, 0)] * (x.ndim - 1) + [(0, kp - qw.k)]
    return qdot.dense(jnp.pad(x.astype(jnp.float32), pad), qw.packed, qw.n, kp, norm)
  if norm is not None:
    from specjax.kernels.qdot import norm_reference
    x = norm_reference(x, *norm)
  x2 = jnp.pad(x.reshape(rows, qw.k).astype(jnp.float32), ((0, 0), (0, kp - qw.k)))
  return _reference(x2, qw).reshape(*lead, qw.n)


def dequantize(qw: QWeight) -> jax.Array:
  """The weight the blocks stand for, [K, N] float32: d q + m (Q4_1) or d q (Q8_0)."""
  w = qw.d[:, None, :] * qw.q.astype(jnp.float32)
  if qw.m is not None:
    w = w + qw.m[:, None, :]
  return w.reshape(-1, qw.n)[:qw.k]
