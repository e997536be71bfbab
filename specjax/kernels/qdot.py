"""An integer-dot CPU kernel: int8 activations times Q4_1 or Q8_0 weight blocks (llama.cpp's
Q4_1 x Q8_1 and Q8_0 x Q8_0 arithmetic) through jax.ffi, beside its pure-JAX reference.

    y[M,N] = x[M,K] @ W,   W [K,N] as 32-k blocks of 4-bit q with an fp32 scale d and min m,
    w[k,n] = d[b,n] * q[b,i,n] + m[b,n] for k = 32 b + i,   M >= 1
(Q8_0: q[b,i,n] in -128..127 and no m.)

Why. A decode step reads every weight once, so its time is the weights' bytes; a quantized
self-draft reads a Q4_1 copy (0.75 bytes a weight as packed here, 0.625 where the scales are fp16
as a GGUF file's are, against 4 for fp32) and
multiplies it by int8 activations with the CPU's integer dot (AVX-512 VNNI's vpdpbusd), never
turning a weight back into a float.

The math (the kernel, qdot.cc, and `reference` compute exactly this; they differ only in float
summation order). Per row m and per 32-block b along K:

    amax = max |x|;  inv = 127 / amax if amax > 0 else 0   (float32)
    xq = round-half-to-even(x * inv) clipped to [-127, 127] (int8);  dx = amax / 127 (float32)
    sx = sum xq (int32);  isum[n] = sum_i q[b,i,n] * xq[i] (int32, exact)
    y[m,n] = sum_b  d[b,n] * dx * isum[n] + m[b,n] * dx * sx     (Q8_0: no m term)

so y is x's per-block int8 quantization times the dequantised weight; it is not x @ W exactly (the
activations lose about 1/254 of each block's range). Non-finite activations give unspecified
values.

Layout. `pack(q, d, m)` (q uint8 [K/32, 32, N] in 0..15, d and m float32 [K/32, N]) returns uint8
[ceil(N/16), K/32, 384]: per group of 16 outputs (zero-padded past N) and block, d[16] and m[16]
as little-endian float32, then 4 chunks of 64 bytes whose byte 4j + t holds q[4c + t] of column j
in its low nibble and q[16 + 4c + t] in its high one (chunk c): one 64-byte load feeds vpdpbusd for
16 outputs x 4 k (qdot.cc says more). `pack(q, d)` (no m: Q8_0, q int in -128..127) returns
[ceil(N/16), K/32, 576]: d[16], then 8 chunks of 64 bytes whose byte 4j + t holds q[4c + t] of
column j plus 128 (vpdpbusd's unsigned operand; the kernel takes 128 * sum(xq) back off, exactly).
Where every d and m is exactly an fp16 value (as a GGUF file's Q4_1 and Q4_0 scales are), the Q4_1
record keeps them as fp16 (`half=None`, the default, chooses so; `half=True` requires it):
[..., 320], d[16] and m[16] as little-endian fp16, then the same 4 chunks. The kernel widens them
exactly, so the result has the same bits as the 384-byte record's, from 17% fewer bytes (0.625 a
weight, the GGUF block's own size). A packed weight's last dimension (384, 320 or 576) says which
it is.

When the kernel runs. `dense(x, packed, n, k)` calls it iff M = prod(x.shape[:-1]) >= 1,
SPECJAX_KERNELS is not off and the library is built and loaded on a CPU with
AVX-512 F/BW/VL/VNNI or AVX2+FMA; otherwise it runs `reference` in XLA (the same result up to
float summation order). A failed build warns once (KernelFallbackWarning).
SPECJAX_KERNELS_ISA=avx512|avx2|scalar forces a path, as for the other kernels; every path gives
the same bits.
"""

from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels.library import (ISAS, KernelFallbackWarning, Library,  # noqa: F401
                                     on_cpu, rows_of, switched_off)

TARGET = "specjax_qdot_f32"
TARGET_NORM = "specjax_qdot_norm_f32"  # the same product of RMS-normed rows (`dense(norm=...)`)
MAX_ROWS = 64   # rows per pass over the weight; the kernel takes larger M in passes of this many
GROUP = 16      # output columns per packed group
BLOCK = 32      # k per block
RECORD = 384    # bytes per (group, block): d[16], m[16] float32, 256 bytes of nibbles (Q4_1)
RECORD_HALF = 320  # the same with d and m as fp16
RECORD8 = 576   # bytes per (group, block): d[16] float32, 512 bytes of q + 128 (Q8_0)


# ----------------------------------------------------------------------------- arguments


def check_shape(n, k) -> None:
  """N >= 1 outputs and K a positive multiple of 32, or a ValueError naming the argument."""
  if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
    raise ValueError(f"n={n!r}: the number of outputs must be an int >= 1")
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < BLOCK or k % BLOCK:
    raise ValueError(f"k={k!r}: the reduced dimension must be a positive multiple of {BLOCK} "
                     "(the Q4_1 blocks run along it)")


def packed_shape(n: int, k: int, bits: int = 4, half: bool = False) -> tuple[int, int, int]:
  """[ceil(N/16), K/32, 384] (bits 4, Q4_1; 320 with half scales) or [..., 576] (bits 8, Q8_0):
  the packed layout."""
  check_shape(n, k)
  record = (RECORD_HALF if half else RECORD) if bits == 4 else RECORD8
  return -(-int(n) // GROUP), int(k) // BLOCK, record


def _exact_in_fp16(a: np.ndarray) -> bool:
  """Whether every value of float32 a is an fp16 value (NaNs compared by their bits)."""
  with np.errstate(over="ignore"):  # a value past fp16's range becomes inf: not exact
    return bool(np.array_equal(a.astype(np.float16).astype(np.float32), a, equal_nan=True))


# ----------------------------------------------------------------------------- packing


def pack(q, d, m=None, *, half: bool | None = None) -> np.ndarray:
  """Q4_1 blocks -> the kernel's layout [ceil(N/16), K/32, 384 or 320] uint8; without m, Q8_0
  blocks -> [ceil(N/16), K/32, 576].

  q: integers [K/32, 32, N] in 0..15 (Q4_1) or -128..127 (Q8_0) (block b's 32 quants of each
  output, k = 32 b + i); d, m: floats [K/32, N] (each block's scale and min per output), taken as
  float32. half (Q4_1): store d and m as fp16 (320-byte records); None: where every one of them is
  an fp16 value, so the record holds the same numbers either way.
  """
  q, d = np.asarray(q), np.asarray(d)
  lo, hi = (0, 15) if m is not None else (-128, 127)
  if q.ndim != 3 or q.shape[1] != BLOCK or q.shape[0] < 1 or q.shape[2] < 1:
    raise ValueError(f"q: expected [K/32, 32, N] with K/32 >= 1 and N >= 1, got shape {q.shape}")
  if not np.issubdtype(q.dtype, np.integer):
    raise ValueError(f"q: expected integers in {lo}..{hi}, got dtype {q.dtype}")
  if q.size and (q.min() < lo or q.max() > hi):
    raise ValueError(f"q: expected values in {lo}..{hi}, got [{q.min()}, {q.max()}]")
  nblk, _, n = q.shape
  fields = (("d", d),) if m is None else (("d", d), ("m", np.asarray(m)))
  for name, a in fields:
    if a.shape != (nblk, n):
      raise ValueError(f"{name}: expected shape {(nblk, n)} (K/32, N) to match q, got {a.shape}")
    if not np.issubdtype(a.dtype, np.floating):
      raise ValueError(f"{name}: expected a float array, got dtype {a.dtype}")
  if half is not None and not isinstance(half, bool):
    raise ValueError(f"half={half!r}: expected True, False or None")
  if half and m is None:
    raise ValueError("half=True: only Q4_1 records (with m) keep their scales as fp16")
  ng = -(-n // GROUP)
  pad = ng * GROUP - n
  if m is not None:
    d32, m32 = np.asarray(d, np.float32), np.asarray(m, np.float32)
    exact = _exact_in_fp16(d32) and _exact_in_fp16(m32)
    if half and not exact:
      raise ValueError("half=True: d and m must be fp16 values (a GGUF block's scales are); these "
                       "would round")
    half = exact if half is None else half

  def field(a, dt="<f4"):  # [nblk, N] -> [ng, nblk, 16 * size] bytes (little-endian)
    a = np.pad(np.asarray(a, np.float32).astype(dt), ((0, 0), (0, pad)))
    a = a.reshape(nblk, ng, GROUP).transpose(1, 0, 2)
    return np.ascontiguousarray(a).view(np.uint8).reshape(ng, nblk, -1)

  if m is None:  # Q8_0: q + 128, k = 4 c + t
    qp = np.pad((q.astype(np.int16) + 128).astype(np.uint8), ((0, 0), (0, 0), (0, pad)),
                constant_values=128)                                 # padded columns: q = 0
    qp = qp.reshape(nblk, 8, 4, ng, GROUP).transpose(3, 0, 1, 4, 2)  # [ng, nblk, c, j, t]
    return np.ascontiguousarray(np.concatenate([field(d), qp.reshape(ng, nblk, 512)], axis=-1))
  qp = np.pad(q.astype(np.uint8), ((0, 0), (0, 0), (0, pad)))      # [nblk, 32, ng*16]
  qp = qp.reshape(nblk, 2, 4, 4, ng, GROUP)                         # k = 16 h + 4 c + t
  qp = qp.transpose(4, 0, 1, 2, 5, 3)                               # [ng, nblk, h, c, j, t]
  nib = (qp[:, :, 0] | (qp[:, :, 1] << 4)).reshape(ng, nblk, 256)
  dt = "<f2" if half else "<f4"
  return np.ascontiguousarray(np.concatenate([field(d, dt), field(m, dt), nib], axis=-1))


def bits_of(packed) -> int:
  """4 (Q4_1) or 8 (Q8_0): what a packed weight holds, read off its last dimension."""
  return 8 if packed.shape[-1] == RECORD8 else 4


def unpack(packed, n: int, k: int):
  """pack undone in JAX: the packed layout -> (q [K/32, 32, N], d, m float32 [K/32, N]); q uint8
  0..15 for Q4_1, int8 with m None for Q8_0."""
  p = jnp.asarray(packed)
  _check_packed(p, n, k)
  ng, nblk, record = p.shape
  size, dt = (2, jnp.float16) if record == RECORD_HALF else (4, jnp.float32)

  def field(i):  # the i-th scale field (d, m), widened to float32 exactly
    o = i * GROUP * size
    f = jax.lax.bitcast_convert_type(p[..., o:o + GROUP * size].reshape(ng, nblk, GROUP, size), dt)
    return f.astype(jnp.float32).transpose(1, 0, 2).reshape(nblk, ng * GROUP)[:, :n]

  if bits_of(p) == 8:
    b = (p[..., 64:].reshape(ng, nblk, 8, GROUP, 4).astype(jnp.int16) - 128).astype(jnp.int8)
    q = b.transpose(1, 2, 4, 0, 3).reshape(nblk, BLOCK, ng * GROUP)[..., :n]
    return q, field(0), None
  b = p[..., 2 * GROUP * size:].reshape(ng, nblk, 4, GROUP, 4)      # [ng, nblk, c, j, t]
  q = jnp.stack([b & 15, b >> 4], axis=2)                           # [ng, nblk, h, c, j, t]
  q = q.transpose(1, 2, 3, 5, 0, 4).reshape(nblk, BLOCK, ng * GROUP)[..., :n]
  return q, field(0), field(1)


def _check_packed(p, n, k):
  shapes = [packed_shape(n, k, bits, half) for bits, half in ((4, False), (4, True), (8, False))]
  if tuple(p.shape) not in shapes or p.dtype != jnp.uint8:
    raise ValueError(f"packed: expected uint8 {shapes[0]} or {shapes[1]} (Q4_1) or {shapes[2]} "
                     f"(Q8_0) for n={n}, k={k}; got {p.dtype} {tuple(p.shape)}")


# ----------------------------------------------------------------------------- loading

def _detect_isa(lib) -> int:
  """The best path this CPU supports (0 scalar, 1 avx2+fma+f16c, 2 avx512 f/bw/vl/vnni). Tests replace
  this hook to simulate a CPU without vector instructions."""
  return lib.specjax_qdot_detected_isa()


def _declare(lib) -> None:
  lib.specjax_qdot_quantize.restype = None
  lib.specjax_qdot_quantize.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
  lib.specjax_qdot_norm_rows.restype = None
  lib.specjax_qdot_norm_rows.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                                         ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p]


LIBRARY = Library("qdot", "specjax_qdot", "SpecjaxQdotF32", TARGET,
                  instead="using its JAX reference instead",
                  lacking="this CPU has neither AVX-512 VNNI nor AVX2+FMA: the portable kernel "
                  "would be slower than the reference in XLA", detect=lambda lib: _detect_isa(lib),
                  setup=_declare, more=(("SpecjaxQdotNormF32", TARGET_NORM),))

# The module's loading and ISA control are its Library's (library.py).
load, available, isa, set_isa, threads = LIBRARY.api()


def quantize_rows(x) -> tuple[np.ndarray, np.ndarray]:
  """The kernel's activation quantization alone, on the path in use (tests): x float32 [M, K] ->
  (xq int8 [M, K], dx float32 [M, K/32])."""
  lib = LIBRARY.require()
  x = np.ascontiguousarray(x, np.float32)
  if x.ndim != 2 or x.shape[1] % BLOCK:
    raise ValueError(f"x: expected [M, K] with K a multiple of {BLOCK}, got shape {x.shape}")
  m, k = x.shape
  xq = np.zeros((m, k), np.int8)
  dx = np.zeros((m, k // BLOCK), np.float32)
  dxs = np.zeros((m, k // BLOCK), np.float32)
  lib.specjax_qdot_quantize(x.ctypes.data, m, k, xq.ctypes.data, dx.ctypes.data, dxs.ctypes.data)
  return xq, dx


def norm_rows(x, scale, eps: float) -> np.ndarray:
  """The kernel's RMSNorm alone, on the path in use (tests): x float32 [M, N], scale [N] ->
  [M, N] (see `norm_reference` for the arithmetic)."""
  lib = LIBRARY.require()
  x = np.ascontiguousarray(x, np.float32)
  scale = np.ascontiguousarray(scale, np.float32)
  if x.ndim != 2 or scale.shape != x.shape[1:]:
    raise ValueError(f"x [M, N] and scale [N] expected, got {x.shape} and {scale.shape}")
  out = np.zeros_like(x)
  lib.specjax_qdot_norm_rows(x.ctypes.data, x.shape[0], x.shape[1], scale.ctypes.data,
                             float(eps), out.ctypes.data)
  return out


# ----------------------------------------------------------------------------- the op


def norm_reference(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """The RMSNorm `dense(norm=...)` applies to x's rows [..., N] before the product, in XLA (the
  fallback): scale * (x * (1 / sqrt(mean(x * x) + eps))), the mean's sum a pairwise tree over the
  squares zero-padded to a power of two, times float32(1 / N). The kernel (qdot.cc,
  norm_row_impl) rounds each of these operations once, with a correctly rounded sqrt and
  division; XLA may fuse a square into the tree's first addition and computes 1 / sqrt as an
  approximate rsqrt, so the two agree up to float rounding, as the products do."""
  x = x.astype(jnp.float32)
  n = x.shape[-1]
  width = 1 << max(0, n - 1).bit_length()
  sq = jnp.pad(x * x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
  while sq.shape[-1] > 1:
    half = sq.shape[-1] // 2
    sq = sq[..., :half] + sq[..., half:]
  mean = sq * jnp.float32(1.0 / n)
  return scale.astype(jnp.float32) * (x * (jnp.float32(1) / jnp.sqrt(mean + jnp.float32(eps))))


def quantize_activations(x: jax.Array):
  """x [M, Kp] float32 (Kp a multiple of 32) -> (xq int8 [M, Kp/32, 32], dx float32 [M, Kp/32],
  sx int32 [M, Kp/32]): per row, per block, llama.cpp's Q8_1 in JAX (the math above; sx the
  block's sum of xq, for the weights' offsets)."""
  mrows, kp = x.shape
  xb = x.reshape(mrows, kp // BLOCK, BLOCK)
  amax = jnp.max(jnp.abs(xb), axis=-1)
  pos = amax > 0
  inv = jnp.where(pos, jnp.float32(127) / jnp.where(pos, amax, 1), jnp.float32(0))
  xq = jnp.clip(jnp.round(xb * inv[..., None]), -127, 127).astype(jnp.int8)  # half to even
  return xq, amax / jnp.float32(127), jnp.sum(xq.astype(jnp.int32), axis=-1)


def reference(x2, packed, n: int, k: int) -> jax.Array:
  """The product in XLA: the fallback. isum is a float32 dot, exact (every partial sum is an
  integer below 32 * 128 * 127 < 2**24) and faster on XLA's CPU backend than an int32 one; for
  one row all blocks in one batched dot, else a scan over the blocks (folded in order, as the
  kernel folds them). Q8_0 weights take m = 0."""
  q, d, mn = unpack(packed, n, k)
  if mn is None:
    mn = jnp.zeros_like(d)
  xq, dx, sx = quantize_activations(x2)
  dxs = dx * sx.astype(jnp.float32)  # [M, nblk]
  xq, q = xq.transpose(1, 0, 2).astype(jnp.float32), q.astype(jnp.float32)  # [nblk, M, 32]
  hi = jax.lax.Precision.HIGHEST
  if x2.shape[0] == 1:  # (batched over blocks: faster for one row only, on XLA's CPU backend)
    isum = jax.lax.dot_general(xq, q, (((2,), (1,)), ((0,), (0,))), precision=hi)  # [nblk, M, N]
    return jnp.sum((d[:, None, :] * dx.T[:, :, None]) * isum + mn[:, None, :] * dxs.T[:, :, None],
                   axis=0)

  def step(y, blk):
    qb, db, mb, xqb, dxb, dxsb = blk
    isum = jax.lax.dot_general(xqb, qb, (((1,), (0,)), ((), ())), precision=hi)  # [M, N]
    y = y + (db[None, :] * dxb[:, None]) * isum
    return y + mb[None, :] * dxsb[:, None], None

  y0 = jnp.zeros((x2.shape[0], n), jnp.float32)
  return jax.lax.scan(step, y0, (q, d, mn, xq, dx.T, dxs.T))[0]


def _ffi(x, packed, n: int, norm=None):
  """x [..., K] (two dimensions or more) -> [..., N]: no reshape around the call (handler.h)."""
  out = jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.float32)
  if norm is None:
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x, packed)
  scale, eps = norm
  return jax.ffi.ffi_call(TARGET_NORM, out, vmap_method="sequential")(
      x, scale.astype(jnp.float32), packed, eps=np.float32(eps))


def dense(x2: jax.Array, packed: jax.Array, n: int, k: int, norm=None) -> jax.Array:
  """x2 [..., K] (float; computed in float32) times the packed Q4_1 weight [K, N] -> [..., N]
  float32, with x2's rows quantized to int8 per 32-block (the math above).

  norm: None, or (scale [Nn], eps) with K = Nn rounded up to a block: x2's rows (their first Nn
  values; the rest zeros) are RMS-normed first (`norm_reference`'s arithmetic), inside the
  kernel's call: a layer's norm and its product in one operation instead of six.

  The kernel for M = prod(x2.shape[:-1]) >= 1 when available (MAX_ROWS rows per pass over the
  weight), else `reference` in XLA; the two agree up to float summation order. Not
  differentiable."""
  check_shape(n, k)
  shape = getattr(x2, "shape", None)
  dtype = getattr(x2, "dtype", None)
  if shape is None or dtype is None:
    raise ValueError(f"x2: expected an array [..., K], got {type(x2).__name__}")
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"x2: expected a float array, got dtype {dtype}")
  if len(shape) < 1 or tuple(shape[-1:]) != (k,):
    raise ValueError(f"x2: expected a last dimension of k={k}, got shape {tuple(shape)}")
  if not hasattr(packed, "shape") or not hasattr(packed, "dtype"):
    raise ValueError(f"packed: expected an array, got {type(packed).__name__}")
  _check_packed(packed, n, k)
  m = int(np.prod(shape[:-1], dtype=np.int64))
  x = rows_of(jnp.asarray(x2).astype(jnp.float32))
  out = (*shape[:-1], n)

  if norm is not None:
    nn = int(np.shape(norm[0])[0]) if np.ndim(norm[0]) == 1 else -1
    if nn < 1 or -(-nn // BLOCK) * BLOCK != k:
      raise ValueError(f"norm: expected a scale [N] with k={k} N rounded up to {BLOCK}, got "
                       f"shape {tuple(np.shape(norm[0]))}")

  def ref(a, p):
    if norm is not None:
      a = jnp.pad(norm_reference(a[..., :nn], norm[0], norm[1]),
                  [(0, 0)] * (a.ndim - 1) + [(0, k - nn)])
    return reference(a.reshape(m, k), p, n, k).reshape(*a.shape[:-1], n)

  if m < 1 or not available():
    y = ref(x, packed)
  else:
    y = on_cpu(lambda a, p: _ffi(a, p, n, norm), ref, x, packed)
  return y.reshape(out)
