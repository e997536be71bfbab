"""A CPU matmul on GGUF's quantized blocks through jax.ffi, beside its pure-JAX fallback.

    y[M,N] = x[M,K] @ dequant(W)^T,   W [N, K] as GGUF blocks along K,   M in [1, MAX_ROWS]

Why. A decode step reads every weight once, so its time is the weights' bytes: SmolLM2's GGUF
stores them as Q4_1 blocks (5 bits a weight; with the Q8_0 tied embedding about 96 MB) where
the fp32 copy we multiply by is 538 MB.
The kernel (blocks.cc) streams the blocks as stored, dequantises them in registers and multiplies
fp32 activations by exactly the weights they encode: the result is the fp32 product with gguf's
dequantised weight up to float summation order.

Block types (GGUF's layouts; d, m, dmin fp16):

    Q8_0   32 weights:  d, 32 int8 q                     34 bytes   w = d * q
    Q4_0   32 weights:  d, 16 bytes of 4-bit q           18 bytes   w = d * (q - 8)
    Q4_1   32 weights:  d, m, 16 bytes of 4-bit q        20 bytes   w = d * q + m
    Q4_K  256 weights:  d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit q
                        144 bytes   w = (d * sc) * q - (dmin * m) per 32 weights
    Q6_K  256 weights:  128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, d
                        210 bytes   w = (d * scale) * (q - 32) per 16 weights

(byte j of a Q4_0 / Q4_1 block holds element j in its low nibble and element j + 16 in its high
one; the K-quants' orders are gguf's, see blocks.cc). `pack_blocks` takes a GGUF tensor's raw
bytes ([N, K/block * block bytes], one row of blocks per output) and transposes each field of the
blocks across groups of 16 rows into [ceil(N/16), K/block, 16 * block bytes]: the same bytes, laid
out so that one vector load holds one k of 16 outputs (blocks.cc says why).

When the kernel runs. `blocks_dense(x, packed, n, k, qtype)` calls the kernel iff x is float32,
M = prod(x.shape[:-1]) is in [1, MAX_ROWS], SPECJAX_KERNELS is not off and the library is built
and loaded on a CPU with AVX-512 or AVX2+FMA+F16C; otherwise it dequantises in JAX (`dequantize`,
bit for bit gguf's values) and multiplies with XLA's dot. A failed build warns once
(KernelFallbackWarning). SPECJAX_KERNELS_ISA=avx512|avx2|scalar forces a path, as for the matmul.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels import matmul
from specjax.kernels.library import (ISAS, KernelFallbackWarning, Library,  # noqa: F401
                                     on_cpu, rows_of, switched_off)

TARGET = "specjax_blocks_f32"
MAX_ROWS = 64  # the largest M = B*T sent to the kernel; larger calls use the fallback
GROUP = 16     # output rows per packed group
# name -> (code in blocks.cc, weights per block (along K), GGUF bytes per block, the block's
# fields in stored order as (bytes per element, elements))
QTYPES = {
    "Q8_0": (0, 32, 34, ((2, 1), (1, 32))),
    "Q4_0": (1, 32, 18, ((2, 1), (1, 16))),
    "Q4_1": (2, 32, 20, ((2, 1), (2, 1), (1, 16))),
    "Q4_K": (3, 256, 144, ((2, 1), (2, 1), (1, 12), (1, 128))),
    "Q6_K": (4, 256, 210, ((1, 128), (1, 64), (1, 16), (2, 1))),
}


# ----------------------------------------------------------------------------- arguments


def qtype_name(qtype) -> str:
  """The block type's name: "Q4_1", "q4_1" and gguf's GGMLQuantizationType.Q4_1 give "Q4_1";
  a type the kernel lacks raises ValueError naming it and the supported ones."""
  name = getattr(qtype, "name", qtype)
  if isinstance(name, str) and name.upper() in QTYPES:
    return name.upper()
  raise ValueError(f"qtype={qtype!r}: unsupported block type; supported: {sorted(QTYPES)}")


def qtype_of(shape) -> str:
  """The block type of a packed copy, read off its shape [ng, K/block, 16 * block bytes] (every
  supported type has its own block size in bytes)."""
  for name, (_, _, tb, _) in QTYPES.items():
    if shape[-1] == GROUP * tb:
      return name
  raise ValueError(f"packed shape {tuple(shape)}: no supported block type has "
                   f"{shape[-1] / GROUP} bytes per block")


def check_shape(n: int, k: int, qtype) -> None:
  """N >= 1 outputs and K a positive multiple of the type's block, or a ValueError."""
  name = qtype_name(qtype)
  block = QTYPES[name][1]
  if not isinstance(n, (int, np.integer)) or n < 1:
    raise ValueError(f"n={n!r}: the number of outputs (weight rows) must be an int >= 1")
  if not isinstance(k, (int, np.integer)) or k < block or k % block:
    raise ValueError(f"k={k!r}: the reduced dimension must be a positive multiple of {block} "
                     f"({name}'s block runs along it)")


def packed_shape(n: int, k: int, qtype) -> tuple[int, int, int]:
  """[ceil(N/16), K/block, 16 * block bytes]: the packed layout's shape."""
  check_shape(n, k, qtype)
  _, block, tb, _ = QTYPES[qtype_name(qtype)]
  return -(-n // GROUP), k // block, GROUP * tb


# ----------------------------------------------------------------------------- packing


def pack_blocks(raw, n: int, k: int, qtype) -> np.ndarray:
  """A GGUF tensor's raw bytes (uint8, [N, K/block * block bytes] or flat) -> the kernel's layout
  [ceil(N/16), K/block, 16 * block bytes] uint8: each field of a block transposed across 16 rows
  (rows past N are zeros: zero scales, zero weights)."""
  name = qtype_name(qtype)
  ng, nblk, _ = packed_shape(n, k, name)
  _, _, tb, fields = QTYPES[name]
  raw = np.asarray(raw)
  if raw.dtype != np.uint8 or raw.size != n * nblk * tb:
    raise ValueError(f"raw: expected {n * nblk * tb} uint8 bytes ({n} rows of {nblk} {name} "
                     f"blocks of {tb} bytes), got {raw.size} of {raw.dtype}")
  rows = np.zeros((ng * GROUP, nblk, tb), np.uint8)
  rows[:n] = raw.reshape(n, nblk, tb)
  r = rows.reshape(ng, GROUP, nblk, tb).transpose(0, 2, 1, 3)  # [ng, nblk, 16 rows, tb]
  out, o = [], 0
  for size, count in fields:  # [.., 16 rows, count, size] -> [.., count, 16 rows, size]
    f = r[..., o:o + size * count].reshape(ng, nblk, GROUP, count, size)
    out.append(f.transpose(0, 1, 3, 2, 4).reshape(ng, nblk, -1))
    o += size * count
  return np.ascontiguousarray(np.concatenate(out, axis=-1))


def unpack_blocks(packed: jax.Array, n: int, k: int, qtype) -> jax.Array:
  """pack_blocks undone in JAX: [ng, K/block, record] -> the GGUF blocks [N * K/block, bytes]."""
  name = qtype_name(qtype)
  ng, nblk, record = packed_shape(n, k, name)
  _, _, tb, fields = QTYPES[name]
  p = jnp.asarray(packed)
  if p.shape != (ng, nblk, record) or p.dtype != jnp.uint8:
    raise ValueError(f"packed: expected uint8 {(ng, nblk, record)} for n={n}, k={k}, {name}; "
                     f"got {p.dtype} {tuple(p.shape)}")
  out, o = [], 0
  for size, count in fields:
    f = p[..., GROUP * o:GROUP * (o + size * count)].reshape(ng, nblk, count, GROUP, size)
    out.append(f.transpose(0, 1, 3, 2, 4).reshape(ng, nblk, GROUP, -1))
    o += size * count
  blocks = jnp.concatenate(out, axis=-1).transpose(0, 2, 1, 3)  # [ng, 16, nblk, tb]
  return blocks.reshape(ng * GROUP * nblk, tb)[:n * nblk]


def _half(b):
  """[..., 2] bytes -> [...] fp16 widened to fp32 (exact)."""
  return jax.lax.bitcast_convert_type(b, jnp.float16).astype(jnp.float32)


def _nibbles(q, axis):
  """Low nibbles, then high nibbles, along a new axis (gguf's order)."""
  return jnp.stack([q & 15, q >> 4], axis=axis)


def _dequant_blocks(b, name: str):
  """GGUF blocks [nb, bytes] -> weights [nb, block] float32, as gguf's numpy computes them. The
  optimization barriers keep a product rounded before the add that follows it: XLA's CPU backend
  would fuse the two into one FMA (one rounding), and gguf's numpy rounds twice."""
  nb = b.shape[0]
  if name == "Q8_0":
    q = jax.lax.bitcast_convert_type(b[:, 2:], jnp.int8).astype(jnp.float32)
    return _half(b[:, None, :2]) * q
  if name in ("Q4_0", "Q4_1"):
    off = 2 if name == "Q4_0" else 4
    q = _nibbles(b[:, off:], 1).reshape(nb, 32)
    if name == "Q4_0":
      return _half(b[:, None, :2]) * (q.astype(jnp.int8) - 8).astype(jnp.float32)
    dq = jax.lax.optimization_barrier(_half(b[:, None, :2]) * q.astype(jnp.float32))
    return dq + _half(b[:, None, 2:4])
  if name == "Q4_K":
    s = b[:, 4:16].reshape(nb, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = jnp.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)  # [nb, 8]
    mn = jnp.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    ds = (_half(b[:, None, 0:2]) * sc.astype(jnp.float32))[..., None]  # [nb, 8, 1]
    dm = (_half(b[:, None, 2:4]) * mn.astype(jnp.float32))[..., None]
    q = _nibbles(b[:, 16:].reshape(nb, 4, 32), 2).reshape(nb, 8, 32).astype(jnp.float32)
    return (jax.lax.optimization_barrier(ds * q) - dm).reshape(nb, 256)
  # Q6_K
  ql = _nibbles(b[:, :128].reshape(nb, 2, 64), 2).reshape(nb, 8, 32)
  qh = b[:, 128:192].reshape(nb, 2, 1, 32) >> jnp.array([0, 2, 4, 6], jnp.uint8)[:, None]
  q = (ql | ((qh & 3).reshape(nb, 8, 32) << 4)).astype(jnp.int8) - 32
  ds = _half(b[:, None, 208:210]) * jax.lax.bitcast_convert_type(b[:, 192:208], jnp.int8).astype(
      jnp.float32)  # [nb, 16]
  return (ds[..., None] * q.reshape(nb, 16, 16).astype(jnp.float32)).reshape(nb, 256)


def dequantize(packed: jax.Array, n: int, k: int, qtype) -> jax.Array:
  """The packed blocks [ng, K/block, record] -> the weight [N, K] float32 in JAX, with gguf's
  values bit for bit."""
  name = qtype_name(qtype)
  return _dequant_blocks(unpack_blocks(packed, n, k, name), name).reshape(n, k)


# ----------------------------------------------------------------------------- loading

def _detect_isa(lib) -> int:
  """The best path this CPU supports (0 scalar, 1 avx2+fma+f16c, 2 avx512). Tests replace this
  hook to simulate a CPU without vector instructions."""
  return lib.specjax_blocks_detected_isa()


LIBRARY = Library("blocks", "specjax_blocks", "SpecjaxBlocksF32", TARGET,
                  instead="dequantising in JAX instead",
                  lacking="this CPU has neither AVX-512 nor AVX2+FMA+F16C: the portable kernel "
                  "would be slower than dequantising in XLA", detect=lambda lib: _detect_isa(lib),
                  switchable=False)

# The module's loading and ISA control are its Library's (library.py).
load, available, isa, set_isa, threads = LIBRARY.api()


# ----------------------------------------------------------------------------- the op


def _fallback(x, packed, n: int, k: int, name: str):
  """x [..., K] @ dequantize(packed)^T in XLA: the path without the kernel."""
  w = dequantize(packed, n, k, name)  # [N, K]
  return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))


def _ffi(x, packed, n: int, name: str):
  """x [..., K] (two dimensions or more) -> [..., N]: no reshape around the call (handler.h)."""
  return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.float32),
                          vmap_method="sequential")(x, packed, qtype=np.int32(QTYPES[name][0]))


def blocks_dense(x: jax.Array, packed: jax.Array, n: int, k: int, qtype) -> jax.Array:
  """x [..., K] float32 @ the packed GGUF weight [N, K] (pack_blocks) transposed -> [..., N].

  The kernel for M = prod(x.shape[:-1]) in [1, MAX_ROWS] when available, else dequantise-then-dot
  in XLA; the two agree up to float summation order. Not differentiable through the kernel."""
  name = qtype_name(qtype)
  shape = packed_shape(n, k, name)
  if x.shape[-1:] != (k,):
    raise ValueError(f"x: expected a last dimension of k={k}, got shape {tuple(x.shape)}")
  if tuple(packed.shape) != shape or packed.dtype != jnp.uint8:
    raise ValueError(f"packed: expected uint8 {shape} for n={n}, k={k}, {name}; got "
                     f"{packed.dtype} {tuple(packed.shape)}")
  m = int(np.prod(x.shape[:-1], dtype=np.int64))
  if (not 1 <= m <= MAX_ROWS or x.dtype != jnp.float32 or switched_off() or not available()):
    return _fallback(x.astype(jnp.float32), packed, n, k, name)
  return _ffi(rows_of(x), packed, n, name).reshape(*x.shape[:-1], n)


@jax.custom_vjp
def _blocks_op(x, w2, packed):
  """x [..., K] @ w2 [K,N] read from w2's GGUF blocks (w2 only read when differentiated)."""
  n, k = w2.shape[1], x.shape[-1]
  return blocks_dense(x, packed, n, k, qtype_of(packed.shape))


def _blocks_fwd(x, w2, packed):
  return matmul._xla(x, w2, False), (x, w2)


def _blocks_bwd(res, g):
  x, w2 = res
  return g @ w2.T, matmul.over_rows(x, g), None


_blocks_op.defvjp(_blocks_fwd, _blocks_bwd)


def dense(x: jax.Array, w: jax.Array, packed: jax.Array | None = None, *,
          transposed: bool = False) -> jax.Array:
  """`kernels.dense` for either kind of packed copy: x [..., K] @ w [K, *out] (or w [N, K]
  transposed) -> [..., *out].

  packed uint8: w's GGUF blocks (pack_blocks, same values as w): the blocks kernel for M =
  prod(x.shape[:-1]) in [1, MAX_ROWS] when it is available, else XLA's dot on w (prefill, other
  devices; the same weights, so the same numbers up to summation order). A copy that multiplies
  itself (kernels/quant.py's QWeight, a quantized self-draft's [K, N] weight): its `product`, w
  not read. Any other packed copy (or none): matmul.dense. Gradients of the first two kinds flow
  through XLA's dot on w.
  """
  k = x.shape[-1]
  out = w.shape[:1] if transposed else w.shape[1:]
  if callable(getattr(packed, "product", None)):
    return packed.product(x).astype(x.dtype).reshape(*x.shape[:-1], *out)
  if getattr(packed, "dtype", None) != jnp.uint8:  # none, or the fp32 kernel's layout
    return matmul.dense(x, w, packed, transposed=transposed)
  m = int(np.prod(x.shape[:-1], dtype=np.int64))
  if not 1 <= m <= MAX_ROWS or x.dtype != jnp.float32 or switched_off() or not available():
    return matmul._xla(x, w, transposed)
  w2 = w.T if transposed else w.reshape(k, -1)
  y = on_cpu(_blocks_op, lambda a, b, p: matmul._xla(a, b, False), rows_of(x), w2, packed)
  return y.reshape(*x.shape[:-1], *out)
