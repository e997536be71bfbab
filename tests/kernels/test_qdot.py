"""specjax.kernels.qdot: the int8-activation x Q4_1 / Q8_0 integer-dot kernel against a plain
numpy implementation of its math, on every instruction-set path this CPU has, its JAX reference
(the fallback), the packed layouts, and its argument errors.

Random Q4_1 blocks (q in 0..15, d and m of both signs; float32 scales in 384-byte records, or fp16
scales, some subnormal, in 320-byte ones) and Q8_0 blocks (q over all of -128..127, d of both
signs), standard-normal activations with zero rows and zero blocks, odd N (a partial last group of
16 outputs), K an odd number of blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.kernels import qdot

from tests.helpers.kernels import isa_fixture, isa_paths, random_q41

needs_kernel = pytest.mark.skipif(not qdot.available(),
                                  reason="specjax.kernels.qdot unavailable (see its warning)")


isa_path = isa_fixture(qdot)
# 4: Q4_1 with float32 scales (384-byte records); "4h": Q4_1 with fp16 scales (320); 8: Q8_0
BITS = (4, "4h", 8)


def fp16_scales(rng, d, m):
  """d and m rounded to fp16 values, a few of each made fp16 subnormals (below 2**-14)."""
  d, m = d.astype(np.float16), m.astype(np.float16)
  for a in (d, m):
    pick = rng.random(a.shape) < 0.05
    a[pick] = (rng.integers(1, 1024, pick.sum()) * rng.choice([-1, 1], pick.sum()) *
               2.0 ** -24).astype(np.float16)
  return d.astype(np.float32), m.astype(np.float32)


def random_blocks(rng, n: int, k: int, bits=4):
  """(q, d, m): Q4_1 blocks (random_q41; bits "4h": their scales fp16 values), or Q8_0 blocks with
  m None: q int8 [K/32, 32, N] over the whole int8 range (-128 and 127 in every block), d of both
  signs."""
  if bits == 4:
    return random_q41(rng, n, k)
  if bits == "4h":
    q, d, m = random_q41(rng, n, k)
    return (q, *fp16_scales(rng, d, m))
  q, d, _ = random_q41(rng, n, k)
  q = rng.integers(-128, 128, q.shape).astype(np.int8)
  q[:, 0], q[:, 1] = -128, 127
  return q, d, None


def random_x(rng, rows: int, k: int) -> np.ndarray:
  """Standard-normal activations; row 1 (if any) all zeros, and block 0 of the last row zeros."""
  x = rng.standard_normal((rows, k)).astype(np.float32)
  if rows > 1:
    x[1] = 0
  if rows > 2:
    x[-1, :32] = 0
  return x


def numpy_qdot(x, q, d, m):
  """The math, in numpy: (y float64 [M, N], sum of |terms| [M, N], xq int [M, K/32, 32], dx)."""
  rows, k = x.shape
  xb = x.reshape(rows, k // 32, 32).astype(np.float32)
  amax = np.abs(xb).max(-1)
  with np.errstate(divide="ignore"):
    inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
  xq = np.clip(np.rint(xb * inv[..., None]), -127, 127).astype(np.int64)  # rint: half to even
  dx = (amax / np.float32(127)).astype(np.float32)
  isum = np.einsum("mbi,bin->mbn", xq, q.astype(np.int64))
  t1 = d.astype(np.float64)[None] * dx.astype(np.float64)[..., None] * isum
  t2 = (0 if m is None else
        m.astype(np.float64)[None] * (dx.astype(np.float64) * xq.sum(-1))[..., None])
  return (t1 + t2).sum(1), (np.abs(t1) + np.abs(t2)).sum(1), xq, dx


def assert_close(y, x, q, d, m):
  ref, scale, _, _ = numpy_qdot(x, q, d, m)
  y = np.asarray(y, np.float64)
  assert y.shape == ref.shape
  err = np.abs(y - ref) - 1e-5 * scale
  assert (err <= 1e-30).all(), float((np.abs(y - ref) / np.maximum(scale, 1e-30)).max())


# (M, N, K): partial groups, an odd number of blocks, the last two above the threaded size
SHAPES = [(1, 1, 32), (3, 17, 96), (8, 45, 160), (17, 301, 608), (64, 203, 576)]


@needs_kernel
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("isa_path", isa_paths(qdot), indirect=True)
def test_parity_with_numpy(isa_path, bits):
  """M in {1, 3, 8, 17, 64}, odd N, K an odd number of blocks, zero rows and blocks: within 1e-5
  of the sum of |terms| of the numpy math, and the activations quantized exactly as numpy does."""
  rng = np.random.default_rng(0)
  f = jax.jit(qdot.dense, static_argnums=(2, 3))
  for rows, n, k in SHAPES:
    q, d, m = random_blocks(rng, n, k, bits)
    x = random_x(rng, rows, k)
    packed = jnp.asarray(qdot.pack(q, d, m))
    assert packed.shape[-1] == {4: 384, "4h": 320, 8: 576}[bits]
    y = f(x, packed, n, k)
    assert y.shape == (rows, n) and y.dtype == jnp.float32
    assert_close(y, x, q, d, m)
    if rows > 1:
      assert not np.asarray(y)[1].any()  # a zero row gives zeros
    _, _, xq, dx = numpy_qdot(x, q, d, m)
    kq, kdx = qdot.quantize_rows(x)
    np.testing.assert_array_equal(kq.reshape(xq.shape), xq)
    np.testing.assert_array_equal(kdx, dx)


@needs_kernel
def test_activations_round_half_to_even():
  """x * 127 / amax exactly halfway rounds to even (vcvtps2dq's default mode, numpy's rint,
  jnp.round), on every path and in the JAX reference; all-zero blocks give zeros."""
  x = np.zeros((2, 64), np.float32)
  ties = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.25, -3.75], np.float32)
  x[0, 0], x[0, 1:11] = 127, ties  # amax = 127: inv = 1, x * inv = x
  x[1, 32:] = np.linspace(-1, 1, 32, dtype=np.float32)
  want = np.zeros((2, 64), np.int8)
  want[0, 0], want[0, 1:11] = 127, [0, 2, 2, 0, -2, -2, 126, -126, 3, -4]
  want[1, 32:] = np.rint(x[1, 32:] * np.float32(127)).astype(np.int8)
  before = qdot.isa()
  try:
    for name in isa_paths(qdot):
      qdot.set_isa(name)
      xq, dx = qdot.quantize_rows(x)
      np.testing.assert_array_equal(xq, want, err_msg=name)
      np.testing.assert_array_equal(dx, np.float32([[1, 0], [0, np.float32(1) / 127]]))
  finally:
    qdot.set_isa(before)
  jq, jdx, _ = qdot.quantize_activations(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(jq).reshape(2, 64), want)
  np.testing.assert_array_equal(jdx, dx)


@needs_kernel
def test_odd_inputs():
  """M = 0 gives [0, N] (the reference path); bfloat16 activations run as float32; a numpy packed
  array works as well as a jax one."""
  rng = np.random.default_rng(8)
  n, k = 24, 64
  q, d, m = random_q41(rng, n, k)
  packed = qdot.pack(q, d, m)
  assert qdot.dense(jnp.zeros((0, k)), packed, n, k).shape == (0, n)
  x = random_x(rng, 4, k)
  xb = jnp.asarray(x, jnp.bfloat16)
  y = qdot.dense(xb, packed, n, k)
  assert y.dtype == jnp.float32
  np.testing.assert_array_equal(y, qdot.dense(np.asarray(xb.astype(jnp.float32)), packed, n, k))


@needs_kernel
@pytest.mark.parametrize("bits", BITS)
def test_paths_give_the_same_bits(bits):
  """Every path folds the blocks with the same fmas in the same order: identical results."""
  rng = np.random.default_rng(1)
  rows, n, k = 13, 99, 224
  q, d, m = random_blocks(rng, n, k, bits)
  packed = jnp.asarray(qdot.pack(q, d, m))
  x = random_x(rng, rows, k)
  before = qdot.isa()
  try:
    outs = {}
    for name in isa_paths(qdot):
      qdot.set_isa(name)
      outs[name] = np.asarray(qdot.dense(x, packed, n, k))
  finally:
    qdot.set_isa(before)
  for name, y in outs.items():
    np.testing.assert_array_equal(y, outs[before], err_msg=name)


@needs_kernel
@pytest.mark.parametrize("bits", BITS)
def test_rows_do_not_depend_on_the_batch(bits):
  """A row's result is the same bits alone or with 63 others (row tiles of any size)."""
  rng = np.random.default_rng(2)
  n, k = 77, 224
  q, d, m = random_blocks(rng, n, k, bits)
  packed = jnp.asarray(qdot.pack(q, d, m))
  x = random_x(rng, 64, k)
  full = np.asarray(qdot.dense(x, packed, n, k))
  for rows in (1, 3, 8, 9, 17, 33):
    np.testing.assert_array_equal(np.asarray(qdot.dense(x[:rows], packed, n, k)), full[:rows])
  np.testing.assert_array_equal(np.asarray(qdot.dense(x[5:6], packed, n, k)), full[5:6])


@needs_kernel
@pytest.mark.parametrize("isa_path", isa_paths(qdot), indirect=True)
def test_fp16_scales_give_the_float32_records_bits(isa_path):
  """The same blocks packed with fp16 scales (320-byte records) and with float32 ones (384): the
  same bits on every path, subnormal fp16 scales included, for 1 to 64 rows."""
  rng = np.random.default_rng(9)
  n, k = 53, 192
  q, d, m = random_blocks(rng, n, k, "4h")
  half, full = qdot.pack(q, d, m), qdot.pack(q, d, m, half=False)
  assert half.shape == (4, 6, 320) and full.shape == (4, 6, 384)
  x = random_x(rng, 64, k)
  for rows in (1, 5, 16, 64):
    y = np.asarray(qdot.dense(x[:rows], jnp.asarray(half), n, k))
    np.testing.assert_array_equal(y, np.asarray(qdot.dense(x[:rows], jnp.asarray(full), n, k)))
  assert_close(y, x, q, d, m)


def test_pack_unpack_round_trip():
  """unpack(pack(q, d, m)) gives q, d and m back exactly (a partial last group included)."""
  rng = np.random.default_rng(3)
  n, k = 37, 96
  q, d, m = random_q41(rng, n, k)
  packed = qdot.pack(q, d, m)
  assert packed.shape == qdot.packed_shape(n, k) == (3, 3, 384) and packed.dtype == np.uint8
  uq, ud, um = qdot.unpack(packed, n, k)
  np.testing.assert_array_equal(np.asarray(uq), q)
  np.testing.assert_array_equal(np.asarray(ud), d)
  np.testing.assert_array_equal(np.asarray(um), m)
  # byte 4j + t of chunk c: q[4c + t] of column j (low nibble), q[16 + 4c + t] (high)
  rec = packed[0, 1]
  assert rec[128 + 64 * 2 + 4 * 5 + 3] == q[1, 4 * 2 + 3, 5] | (q[1, 16 + 4 * 2 + 3, 5] << 4)
  np.testing.assert_array_equal(rec[:64].view(np.float32), d[1, :16])


def test_pack_unpack_round_trip_fp16_scales():
  """Q4_1 blocks whose scales are fp16 values pack to 320-byte records (d, m as fp16, then the
  same nibbles) unless half=False; unpack gives them back exactly. half=True on scales that
  would round, or on Q8_0, is a named error."""
  rng = np.random.default_rng(3)
  n, k = 37, 96
  q, d, m = random_blocks(rng, n, k, "4h")
  packed = qdot.pack(q, d, m)
  assert packed.shape == qdot.packed_shape(n, k, half=True) == (3, 3, 320)
  assert qdot.bits_of(packed) == 4
  np.testing.assert_array_equal(packed, qdot.pack(q, d, m, half=True))
  full = qdot.pack(q, d, m, half=False)
  np.testing.assert_array_equal(packed[..., 64:], full[..., 128:])  # the same nibbles
  for p in (packed, full):
    uq, ud, um = qdot.unpack(p, n, k)
    np.testing.assert_array_equal(np.asarray(uq), q)
    np.testing.assert_array_equal(np.asarray(ud), d)
    np.testing.assert_array_equal(np.asarray(um), m)
  rec = packed[0, 1]
  np.testing.assert_array_equal(rec[:32].view(np.float16), d[1, :16])
  np.testing.assert_array_equal(rec[32:64].view(np.float16), m[1, :16])
  d2 = d.copy()
  d2[2, 5] = np.float32(0.1)  # not an fp16 value
  assert qdot.pack(q, d2, m).shape[-1] == 384
  big = m.copy()
  big[0, 0] = 1e6  # past fp16's range
  assert qdot.pack(q, d, big).shape[-1] == 384
  with pytest.raises(ValueError, match="half=True: d and m must be fp16 values"):
    qdot.pack(q, d2, m, half=True)
  with pytest.raises(ValueError, match="half=True: only Q4_1"):
    qdot.pack(q.astype(np.int8), d, half=True)
  with pytest.raises(ValueError, match="half=1"):
    qdot.pack(q, d, m, half=1)


def test_pack_unpack_round_trip_q8():
  """Q8_0 (pack without m): [.., 576] records of d and q + 128; unpack gives q, d and None."""
  rng = np.random.default_rng(3)
  n, k = 37, 96
  q, d, _ = random_blocks(rng, n, k, 8)
  packed = qdot.pack(q, d)
  assert packed.shape == qdot.packed_shape(n, k, 8) == (3, 3, 576) and qdot.bits_of(packed) == 8
  uq, ud, um = qdot.unpack(packed, n, k)
  assert um is None and np.asarray(uq).dtype == np.int8
  np.testing.assert_array_equal(np.asarray(uq), q)
  np.testing.assert_array_equal(np.asarray(ud), d)
  rec = packed[0, 1]  # byte 4j + t of chunk c: q[4c + t] of column j, plus 128
  assert rec[64 + 64 * 5 + 4 * 7 + 2] == int(q[1, 4 * 5 + 2, 7]) + 128
  np.testing.assert_array_equal(rec[:64].view(np.float32), d[1, :16])
  assert (packed[2, :, 64:].reshape(3, 8, 16, 4)[:, :, 5:] == 128).all()  # padded columns: q = 0
  with pytest.raises(ValueError, match=r"q: expected values in -128..127"):
    qdot.pack(q.astype(np.int16) * 2, d)


def test_reference_and_switched_off(monkeypatch):
  """SPECJAX_KERNELS=0 runs the JAX reference: no kernel call in the program, the numpy math's
  values; with the kernel on, it agrees with the reference."""
  rng = np.random.default_rng(4)
  n, k = 45, 160
  q, d, m = random_q41(rng, n, k)
  packed = jnp.asarray(qdot.pack(q, d, m))
  x = random_x(rng, 5, k)
  lower = lambda x: jax.jit(qdot.dense, static_argnums=(2, 3)).lower(x, packed, n, k).as_text()
  monkeypatch.setenv("SPECJAX_KERNELS", "0")
  assert not qdot.available()
  assert qdot.TARGET not in lower(x[:3])
  off = qdot.dense(x[:3], packed, n, k)
  assert_close(off, x[:3], q, d, m)
  assert_close(qdot.dense(x[:1], packed, n, k), x[:1], q, d, m)  # (one row: a batched dot)
  monkeypatch.delenv("SPECJAX_KERNELS")
  if qdot.available():  # (another M: the switch is read at trace time, and traces are cached)
    assert qdot.TARGET in lower(x[:5])
    np.testing.assert_allclose(qdot.dense(x[:3], packed, n, k), off, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_rows_past_one_pass(bits):
  """M above MAX_ROWS is one kernel call (not XLA's integer dot, not one call per 64 rows: a
  sampling test's 12,000 rows once made a program of hundreds of calls per product) that takes
  the rows in passes of MAX_ROWS, each row the bits it has alone."""
  rng = np.random.default_rng(5)
  n, k = 37, 96
  q, d, m = random_blocks(rng, n, k, bits)
  packed = jnp.asarray(qdot.pack(q, d, m))
  x = random_x(rng, 2 * qdot.MAX_ROWS + 3, k).reshape(1, -1, k)
  text = jax.jit(qdot.dense, static_argnums=(2, 3)).lower(x, packed, n, k).as_text()
  assert text.count(qdot.TARGET) == 1
  y = np.asarray(qdot.dense(x, packed, n, k))[0]
  assert_close(y, x[0], q, d, m)
  alone = np.stack([np.asarray(qdot.dense(x[0, i:i + 1], packed, n, k))[0] for i in (0, 63, 64,
                                                                                      130)])
  np.testing.assert_array_equal(y[[0, 63, 64, 130]], alone)


@needs_kernel
def test_leading_dims_vmap_and_loop():
  """[B,T,K] inputs give [B,T,N]; vmap (sequential) and calls inside a lax.fori_loop give the
  eager call's bits."""
  rng = np.random.default_rng(5)
  n = k = 64
  q, d, m = random_q41(rng, n, k)
  packed = jnp.asarray(qdot.pack(q, d, m))
  x = random_x(rng, 6, k).reshape(2, 3, k)
  y = qdot.dense(x, packed, n, k)
  assert y.shape == (2, 3, n)
  assert_close(y.reshape(6, n), x.reshape(6, k), q, d, m)
  yv = jax.vmap(lambda r: qdot.dense(r, packed, n, k))(x)
  np.testing.assert_array_equal(yv, y)

  # hundreds of calls inside one compiled loop: each gives the eager call's bits
  y0 = np.asarray(qdot.dense(x[0], packed, n, k))
  acc = jax.jit(lambda h: jax.lax.fori_loop(
      0, 300, lambda i, a: jnp.maximum(a, qdot.dense(h + 0.0 * i, packed, n, k)),
      jnp.full((3, n), -jnp.inf)))(x[0])
  np.testing.assert_array_equal(acc, y0)


def test_bad_input_raises_before_compiling():
  """Wrong shapes, dtypes and values raise ValueError naming the argument, in Python."""
  q = np.zeros((2, 32, 16), np.uint8)
  d = np.zeros((2, 16), np.float32)
  with pytest.raises(ValueError, match=r"q: expected \[K/32, 32, N\]"):
    qdot.pack(q[:, :16], d, d)
  with pytest.raises(ValueError, match="q: expected values in 0..15"):
    qdot.pack(q + 16, d, d)
  with pytest.raises(ValueError, match="q: expected integers"):
    qdot.pack(q.astype(np.float32), d, d)
  with pytest.raises(ValueError, match=r"m: expected shape \(2, 16\)"):
    qdot.pack(q, d, d[:1])
  with pytest.raises(ValueError, match="d: expected a float array"):
    qdot.pack(q, d.astype(np.int32), d)
  packed = jnp.asarray(qdot.pack(q, d, d))
  assert packed.shape == (1, 2, 320)  # zeros are fp16 values
  packed = jnp.asarray(qdot.pack(q, d, d, half=False))
  assert packed.shape == (1, 2, 384)
  with pytest.raises(ValueError, match="k=48: .*multiple of 32"):
    qdot.dense(jnp.zeros((1, 48)), packed, 16, 48)
  with pytest.raises(ValueError, match="n=0"):
    qdot.dense(jnp.zeros((1, 64)), packed, 0, 64)
  with pytest.raises(ValueError, match="x2: expected a last dimension of k=64"):
    qdot.dense(jnp.zeros((1, 32)), packed, 16, 64)
  with pytest.raises(ValueError, match="x2: expected a float array"):
    qdot.dense(jnp.zeros((1, 64), jnp.int32), packed, 16, 64)
  with pytest.raises(ValueError, match=r"packed: expected uint8 \(1, 2, 384\) or \(1, 2, 320\) "
                     r"\(Q4_1\) or \(1, 2, 576\)"):
    qdot.dense(jnp.zeros((1, 64)), packed[:, :1], 16, 64)
  with pytest.raises(ValueError, match="packed: expected uint8"):
    qdot.dense(jnp.zeros((1, 64)), packed.astype(jnp.int8), 16, 64)
  with pytest.raises(ValueError, match=r"packed: expected uint8 \(2, 2, 384\)"):
    qdot.dense(jnp.zeros((1, 64)), packed, 17, 64)


def test_fallback_without_compiler(monkeypatch, tmp_path):
  """No compiler: one KernelFallbackWarning, then the JAX reference, same values."""
  monkeypatch.delenv("SPECJAX_KERNELS", raising=False)  # (switched off, it would not even try)
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  monkeypatch.setenv("SPECJAX_CXX", "/nonexistent/g++")
  qdot.LIBRARY.reset()
  try:
    rng = np.random.default_rng(6)
    n, k = 20, 64
    q, d, m = random_q41(rng, n, k)
    packed = jnp.asarray(qdot.pack(q, d, m))
    x = random_x(rng, 2, k)
    with pytest.warns(qdot.KernelFallbackWarning, match="not found"):
      assert not qdot.available()
    assert_close(qdot.dense(x, packed, n, k), x, q, d, m)
  finally:
    monkeypatch.undo()
    qdot.LIBRARY.reset()


def numpy_norm(x, scale, eps):
  """The fused RMSNorm's arithmetic in numpy float32 (qdot.norm_reference's docstring): each
  operation rounded once, the squares' sum a pairwise tree over a power-of-two width."""
  x = np.asarray(x, np.float32)
  n = x.shape[-1]
  sq = np.pad(x * x, ((0, 0), (0, (1 << max(0, n - 1).bit_length()) - n)))
  while sq.shape[-1] > 1:
    half = sq.shape[-1] // 2
    sq = (sq[:, :half] + sq[:, half:]).astype(np.float32)
  mean = (sq[:, 0] * np.float32(1.0 / n)).astype(np.float32)
  inv = (np.float32(1) / np.sqrt((mean + np.float32(eps)).astype(np.float32))).astype(np.float32)
  return (np.asarray(scale, np.float32) * (x * inv[:, None])).astype(np.float32)


@needs_kernel
@pytest.mark.parametrize("isa_path", isa_paths(qdot), indirect=True)
def test_fused_norm_is_the_numpy_arithmetic(isa_path):
  """The kernel's RMSNorm alone gives numpy's float32 bits (widths below, at and past a power of
  two, below one block, a zero row); a product with the norm fused gives the bits of the product
  of numpy's normed rows, for 1 to 64 rows, whichever rows share the call."""
  rng = np.random.default_rng(11)
  for n in (1, 7, 32, 64, 100, 576, 640):
    x = (rng.standard_normal((5, n)) * rng.uniform(0.01, 30, (5, 1))).astype(np.float32)
    x[2] = 0
    scale = rng.standard_normal(n).astype(np.float32)
    np.testing.assert_array_equal(qdot.norm_rows(x, scale, 1e-6), numpy_norm(x, scale, 1e-6))
  for bits in BITS:
    for nn in (224, 200):  # the norm's width the activations' K, or less (K = 224 the blocks)
      q, d, m = random_blocks(rng, 77, 224, bits)
      packed = jnp.asarray(qdot.pack(q, d, m))
      x = np.zeros((64, 224), np.float32)
      x[:, :nn] = rng.standard_normal((64, nn)) * 4
      scale = rng.standard_normal(nn).astype(np.float32)
      want = np.zeros_like(x)
      want[:, :nn] = numpy_norm(x[:, :nn], scale, 1e-5)
      want = np.asarray(qdot.dense(want, packed, 77, 224))
      g = jax.jit(lambda x, p, s: qdot.dense(x, p, 77, 224, norm=(s, 1e-5)))
      for rows in (1, 3, 16, 64):
        np.testing.assert_array_equal(np.asarray(g(x[:rows], packed, scale)), want[:rows])


@needs_kernel
def test_fused_norm_fallback_and_bad_scale(monkeypatch):
  """Switched off, the norm runs in XLA (norm_reference) before the reference product: the same
  up to float rounding; a scale that does not fit K is refused before compiling."""
  rng = np.random.default_rng(12)
  q, d, m = random_blocks(rng, 40, 96, 4)
  packed = jnp.asarray(qdot.pack(q, d, m))
  x = np.zeros((3, 96), np.float32)
  x[:, :90] = rng.standard_normal((3, 90))
  scale = jnp.asarray(rng.standard_normal(90).astype(np.float32))
  y = np.asarray(qdot.dense(x, packed, 40, 96, norm=(scale, 1e-5)))
  normed = np.zeros_like(x)
  normed[:, :90] = numpy_norm(x[:, :90], scale, 1e-5)
  assert_close(y, normed, q, d, m)
  monkeypatch.setenv("SPECJAX_KERNELS", "0")
  off = np.asarray(qdot.dense(x, packed, 40, 96, norm=(scale, 1e-5)))
  np.testing.assert_allclose(off, y, rtol=1e-4, atol=1e-4)
  for bad in (jnp.ones(60), jnp.ones(97), jnp.ones((2, 48))):
    with pytest.raises(ValueError, match="norm: expected a scale"):
      qdot.dense(x, packed, 40, 96, norm=(bad, 1e-5))
