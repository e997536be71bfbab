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

A GGUF file's own blocks become a QWeight holding the same weights (`from_gguf`): the W4A8 target
(`load_model(..., weights="blocks", activations="int8")`) multiplies by them. Q4_0, Q4_1 and Q8_0
are read as they are. The others are re-expressed exactly in those forms, so every product stays
the integer arithmetic above, on the same kernel: Q5_0 (w = d (q - 16)) is a Q8_0 block; a Q4_K
super-block of 256 is eight Q4_1 blocks with float32 scales (d = D sc_j, m = -Dmin m_j: exact
products of an fp16 and a 6-bit integer); a Q6_K super-block, whose sixteen scales change every
16 k, is two Q8_0 weights holding the first and the second 16 of each block of 32, their products
added (`QSum`). Activations are llama.cpp's Q8_1 for every type (llama.cpp quantizes them per 256
as Q8_K for the K-quants: a coarser scale than these blocks of 32), so the K-quant products are
this module's arithmetic over the file's exact weights, not llama.cpp's bits. The Q6_K halves
cost twice a Q8_0 weight's bytes (2.25 a weight against the file's 0.82).

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


# GGUF block types that int8 activations multiply: name -> (elements, bytes) of one block. Q4_0,
# Q4_1 and Q8_0 are read as they are; the others are re-expressed, exactly, as blocks of 32 of
# those two forms (`from_gguf`): the same weights and the same integer products.
GGUF_TYPES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q5_0": (32, 22),
              "Q4_K": (256, 144), "Q6_K": (256, 210)}


@functools.partial(jax.tree_util.register_dataclass, data_fields=["parts"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class QSum:
  """A [K, N] weight that is the sum of QWeights of its shape, multiplied as the sum of their
  products in order: a GGUF Q6_K tensor, whose scales change every 16 k, is two Q8_0 weights,
  each holding one half of every block of 32 (the other half zero). Each part's product is exact
  in integers and a row's own, so the sum is too."""
  parts: tuple

  @property
  def n(self) -> int:
    return self.parts[0].n

  @property
  def k(self) -> int:
    return self.parts[0].k

  @property
  def packed(self):
    return self.parts[0].packed

  def product(self, x: jax.Array, norm=None) -> jax.Array:
    y = self.parts[0].product(x, norm)
    for part in self.parts[1:]:
      y = y + part.product(x, norm)
    return y


def _fp16(b: np.ndarray) -> np.ndarray:
  """uint8 [..., 2] (little-endian fp16) -> float32 [...], exact."""
  return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def recode(rows: np.ndarray, qtype: str) -> tuple[np.ndarray, str]:
  """A Q5_0 tensor's rows as Q8_0 rows of the same weights (w = d (q - 16): q - 16 in -16..15 is
  an int8 beside the same fp16 d, and llama.cpp's Q5_0 x Q8_0 integer sum is Q8_0 x Q8_0's), so
  a fused product whose parts are Q5_0 and Q8_0 is one Q8_0 product; other types as they are."""
  if qtype != "Q5_0":
    return rows, qtype
  blk = np.ascontiguousarray(rows).reshape(rows.shape[0], -1, 22)
  qh = np.ascontiguousarray(blk[..., 2:6]).view("<u4")  # [N, nb, 1]: bit j is element j's fifth
  qs = blk[..., 6:]
  low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16)  # elements 0..15, 16..31
  high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16)
  q = (low + 16 * high - 16).astype(np.int8)
  out = np.concatenate([blk[..., 0:2], q.view(np.uint8)], axis=-1)
  return out.reshape(rows.shape[0], -1), "Q8_0"


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """A Q4_K block's 12 scale bytes [..., 12] -> its 8 sub-blocks' 6-bit scales and mins
  [..., 8] (llama.cpp's get_scale_min_k4)."""
  s = s.astype(np.int32)
  lo_sc, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63
  hi_sc = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
  hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
  return (np.concatenate([lo_sc, hi_sc], -1).astype(np.float32),
          np.concatenate([lo_m, hi_m], -1).astype(np.float32))


def _q4_k(blk: np.ndarray):
  """Q4_K super-blocks [N, ns, 144] -> Q4_1 blocks of 32: (q [N, ns*8, 32], d, m [N, ns*8]).
  Sub-block j holds w = (D sc_j) q - (Dmin m_j) (D, Dmin fp16, sc_j, m_j 6-bit): D sc_j and Dmin
  m_j are exact in float32 (11 bits times 6), the Q4_1 block's d and -m."""
  n, ns = blk.shape[:2]
  dd, dmin = _fp16(blk[..., 0:2]), _fp16(blk[..., 2:4])
  sc, mn = _k_scales(blk[..., 4:16])
  qs = blk[..., 16:].reshape(n, ns, 4, 32)  # sub-block 2c: low nibbles of chunk c, 2c + 1: high
  q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, ns * 8, 32).astype(np.int8)
  return q, (dd[..., None] * sc).reshape(n, -1), (-(dmin[..., None] * mn)).reshape(n, -1)


def _q6_k(blk: np.ndarray):
  """Q6_K super-blocks [N, ns, 210] -> (q [N, ns*8, 32] int8 in -32..31, d16 [N, ns*16]): w =
  (D sc_j) q over sub-blocks j of 16 (D fp16, sc_j int8: D sc_j exact in float32)."""
  n, ns = blk.shape[:2]
  ql, qh = blk[..., 0:128].astype(np.int16), blk[..., 128:192].astype(np.int16)
  sc = np.ascontiguousarray(blk[..., 192:208]).view(np.int8).astype(np.float32)
  dd = _fp16(blk[..., 208:210])
  halves = []
  for h in range(2):  # 128 elements each: ql[64 h:], qh[32 h:]
    a, b = ql[..., 64 * h:64 * h + 32], ql[..., 64 * h + 32:64 * h + 64]
    hb = qh[..., 32 * h:32 * h + 32]
    halves += [(a & 0xF) | ((hb & 3) << 4), (b & 0xF) | (((hb >> 2) & 3) << 4),
               (a >> 4) | (((hb >> 4) & 3) << 4), (b >> 4) | (((hb >> 6) & 3) << 4)]
  q = (np.concatenate(halves, axis=-1) - 32).astype(np.int8).reshape(n, ns * 8, 32)
  return q, (dd[..., None] * sc).reshape(n, -1)


def _qweight(q: np.ndarray, d: np.ndarray, m, bits: int, k: int, pack: bool) -> QWeight:
  """q [N, nb, 32], d and m [N, nb] (output-major, as decoded) -> the QWeight [K, N]."""
  q = np.ascontiguousarray(q.transpose(1, 2, 0))  # [nb, 32, N]
  d = np.ascontiguousarray(d.T)
  m = None if m is None else np.ascontiguousarray(m.T)
  packed = None
  if pack:
    from specjax.kernels import qdot
    packed = jnp.asarray(qdot.pack(q, d, m))
  return QWeight(jnp.asarray(q), jnp.asarray(d), None if m is None else jnp.asarray(m), packed,
                 bits, k)


def from_gguf(rows: np.ndarray, n: int, k: int, qtype: str, *,
              pack: bool | None = None) -> QWeight | QSum:
  """A GGUF tensor's stored blocks -> the QWeight [K, N] that holds the same numbers (a QSum for
  Q6_K).

  rows: uint8 [N, K/block * bytes], one row of blocks per output (gguf_file.gguf_blocks). Q4_1
  block: d, m (fp16), 16 bytes whose low nibbles are elements 0..15 and high nibbles 16..31; Q4_0:
  d and the 16 bytes (m = -8 d); Q8_0: d (fp16), 32 int8; Q5_0: `recode`d to Q8_0. The K-quants
  (super-blocks of 256, llama.cpp's layouts) become blocks of 32 with float32 scales: Q4_K the
  Q4_1 blocks of its eight sub-blocks (d = D sc_j, m = -Dmin m_j); Q6_K, whose sixteen sub-blocks
  of 16 each have a scale, two Q8_0 weights (the first and the second 16 of every block of 32),
  their products summed (QSum). fp16 scales widen to float32 exactly, and the K-quants' scale
  products are exact in float32: the weights are the file's, and every product stays integer.
  pack: as for `quantize_weight`."""
  if qtype not in GGUF_TYPES:
    raise ValueError(f"qtype={qtype!r}: int8 activations multiply {sorted(GGUF_TYPES)} blocks")
  rows, qtype = recode(rows, qtype)
  per, size = GGUF_TYPES[qtype]
  nb = k // per
  if k % per or rows.shape != (n, nb * size):
    raise ValueError(f"rows {rows.shape} are not {n} rows of {nb} {qtype} blocks (K={k})")
  blk = np.ascontiguousarray(rows).reshape(n, nb, size)
  if pack is None:
    pack = _pack_by_default(4)
  if qtype == "Q4_K":
    return _qweight(*_q4_k(blk), 4, k, pack)
  if qtype == "Q6_K":
    q, d16 = _q6_k(blk)
    first, second = q.copy(), q.copy()
    first[..., 16:], second[..., :16] = 0, 0
    return QSum((_qweight(first, d16[..., 0::2], None, 8, k, pack),
                 _qweight(second, d16[..., 1::2], None, 8, k, pack)))
  d = _fp16(blk[..., 0:2])
  if qtype == "Q8_0":
    return _qweight(blk[..., 2:].view(np.int8), d, None, 8, k, pack)
  q0 = qtype == "Q4_0"
  m = -8 * d if q0 else _fp16(blk[..., 2:4])
  qs = blk[..., 2 if q0 else 4:]
  q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int8)  # [N, nb, 32]
  return _qweight(q, d, m, 4, k, pack)


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


def dequantize(qw: QWeight | QSum) -> jax.Array:
  """The weight the blocks stand for, [K, N] float32: d q + m (Q4_1) or d q (Q8_0); a QSum's
  parts added in order."""
  if isinstance(qw, QSum):
    w = dequantize(qw.parts[0])
    for part in qw.parts[1:]:
      w = w + dequantize(part)
    return w
  w = qw.d[:, None, :] * qw.q.astype(jnp.float32)
  if qw.m is not None:
    w = w + qw.m[:, None, :]
  return w.reshape(-1, qw.n)[:qw.k]
