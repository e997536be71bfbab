"""specjax.kernels.blocks: the GGUF-blocks matmul against gguf's own dequantisation (the installed
`gguf` package's numpy reference) times an fp32 matmul, on every instruction-set path this CPU has,
its fallback, and its argument errors.

Random blocks: random bytes for the quants (and the K-quants' sub-block scales) and random fp16
fields of both signs (d, m, dmin), odd N (a partial last group of 16 outputs), K an odd number of
blocks (for 32-weight blocks not a multiple of 64 or 256).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from specjax.kernels import blocks

from tests.helpers.kernels import isa_fixture, isa_paths, random_raw

TYPES = sorted(blocks.QTYPES)
needs_kernel = pytest.mark.skipif(not blocks.available(),
                                  reason="specjax.kernels.blocks unavailable (see its warning)")


isa_path = isa_fixture(blocks)


def reference(raw: np.ndarray, qtype: str) -> np.ndarray:
  """gguf's dequantised weight [N, K] float32."""
  return gguf_dequantize(raw, GGMLQuantizationType[qtype]).astype(np.float32)


def _err(y, x, w):
  """max over outputs of |y - x @ w.T| / (|x_m| |w_n|), against the exact (float64) product: the
  error on the scale of each output's norm, not of its value (which cancellation can make tiny)."""
  x64, w64 = x.astype(np.float64), w.astype(np.float64)
  exact = x64 @ w64.T
  scale = np.linalg.norm(x64, axis=1)[:, None] * np.linalg.norm(w64, axis=1)[None, :]
  return float((np.abs(np.asarray(y, np.float64) - exact) / scale).max())


# (M, N, blocks along K): the last above the threaded size
SHAPES = [(1, 1, 1), (3, 17, 3), (16, 45, 5), (33, 301, 19), (64, 1001, 49)]


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("isa_path", isa_paths(blocks), indirect=True)
def test_parity_with_gguf(isa_path, qtype):
  """M in {1, 3, 16, 33, 64}, odd N, K an odd number of blocks, the largest above the threaded
  size: within 1e-5 of the exact product with gguf's dequantised weight, the bar numpy's fp32
  matmul meets."""
  rng = np.random.default_rng(TYPES.index(qtype))
  f = jax.jit(blocks.blocks_dense, static_argnums=(2, 3, 4))
  block = blocks.QTYPES[qtype][1]
  for m, n, nblk in SHAPES:
    k = nblk * block if block == 32 else min(nblk, 7) * block
    raw = random_raw(rng, n, k, qtype)
    w = reference(raw, qtype)
    x = rng.standard_normal((m, k)).astype(np.float32)
    packed = jnp.asarray(blocks.pack_blocks(raw, n, k, qtype))
    y = f(x, packed, n, k, qtype)
    assert y.shape == (m, n) and y.dtype == jnp.float32
    assert _err(y, x, w) < 1e-5, (isa_path, qtype, m, n, k)
    assert _err(x @ w.T, x, w) < 1e-5  # the bar fp32 numpy meets


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES)
def test_rows_do_not_depend_on_the_batch(qtype):
  """A row's result is the same bits whether computed alone or with 63 others (row tiles of
  different sizes sum in one order)."""
  rng = np.random.default_rng(7)
  n, k = 77, 7 * blocks.QTYPES[qtype][1]
  packed = jnp.asarray(blocks.pack_blocks(random_raw(rng, n, k, qtype), n, k, qtype))
  x = rng.standard_normal((64, k)).astype(np.float32)
  full = np.asarray(blocks.blocks_dense(x, packed, n, k, qtype))
  for m in (1, 3, 17, 33):
    np.testing.assert_array_equal(np.asarray(blocks.blocks_dense(x[:m], packed, n, k, qtype)),
                                  full[:m])


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_is_ggufs_bit_for_bit(qtype):
  """The fallback's weight is gguf's dequantised weight exactly (incl. a partial group)."""
  rng = np.random.default_rng(3)
  n, k = 37, 3 * blocks.QTYPES[qtype][1]
  raw = random_raw(rng, n, k, qtype)
  w = np.asarray(jax.jit(blocks.dequantize, static_argnums=(1, 2, 3))(
      blocks.pack_blocks(raw, n, k, qtype), n, k, qtype))
  np.testing.assert_array_equal(w, reference(raw, qtype))


@pytest.mark.parametrize("qtype", TYPES)
def test_fallback_when_switched_off_and_for_many_rows(monkeypatch, qtype):
  """SPECJAX_KERNELS=0, and M > MAX_ROWS, dequantise in XLA: exactly XLA's dot with gguf's
  weight, and no kernel call in the program."""
  rng = np.random.default_rng(4)
  n, k = 45, 5 * blocks.QTYPES[qtype][1]
  raw = random_raw(rng, n, k, qtype)
  w = reference(raw, qtype)
  packed = jnp.asarray(blocks.pack_blocks(raw, n, k, qtype))
  x = rng.standard_normal((blocks.MAX_ROWS + 1, k)).astype(np.float32)
  lower = lambda x: jax.jit(blocks.blocks_dense, static_argnums=(2, 3, 4)).lower(
      x, packed, n, k, qtype).as_text()
  assert blocks.TARGET not in lower(x)
  assert _err(blocks.blocks_dense(x, packed, n, k, qtype), x, w) < 1e-5
  monkeypatch.setenv("SPECJAX_KERNELS", "0")
  assert blocks.TARGET not in lower(x[:3])
  xla = jax.lax.dot_general(x[:3], w, (((1,), (1,)), ((), ())))  # XLA's dot of gguf's weight
  np.testing.assert_array_equal(blocks.blocks_dense(x[:3], packed, n, k, qtype), xla)
  monkeypatch.delenv("SPECJAX_KERNELS")
  if blocks.available():  # (another M: the switch is read at trace time, and traces are cached)
    assert blocks.TARGET in lower(x[:5])


@needs_kernel
def test_leading_dims_and_loop():
  """[B,T,K] inputs give [B,T,N]; thousands of calls in a lax.fori_loop match the fallback."""
  rng = np.random.default_rng(5)
  n = k = 64
  raw = random_raw(rng, n, k, "Q8_0")
  packed = jnp.asarray(blocks.pack_blocks(raw, n, k, "Q8_0"))
  x = rng.standard_normal((2, 3, k)).astype(np.float32)
  y = blocks.blocks_dense(x, packed, n, k, "Q8_0")
  assert y.shape == (2, 3, n)
  w = reference(raw, "Q8_0")
  assert _err(y.reshape(6, n), x.reshape(6, k), w) < 1e-5

  # Each of 500 chained calls is checked against XLA's product of the same input. (Comparing two
  # separate 500-step trajectories assumed the kernel summed in XLA's order: this map is chaotic
  # (gain ~30), and two sums that round differently, each within 1e-5 of the exact product, part
  # after a few steps.)
  def loop(h):
    def body(i, c):
      h, err = c
      y = blocks.blocks_dense(h, packed, n, k, "Q8_0")
      return jnp.tanh(y), jnp.maximum(err, jnp.max(jnp.abs(y - h @ w.T)))
    return jax.lax.fori_loop(0, 500, body, (h, jnp.float32(0)))

  h, err = jax.jit(loop)(x[0])
  assert np.isfinite(np.asarray(h)).all() and np.abs(np.asarray(h)).mean() > 0.5
  assert float(err) < 1e-5 * np.sqrt(k) * np.linalg.norm(w, axis=1).max()  # |h| <= sqrt(k)


def test_bad_input_raises_before_compiling():
  """An unsupported block type, K not a multiple of 32, bytes of the wrong size and a wrong x
  raise ValueError naming the argument, in Python, before anything is traced or built."""
  raw = np.zeros((16, 20), np.uint8)
  with pytest.raises(ValueError, match=r"qtype='Q5_K'.*supported: \['Q4_0', 'Q4_1', 'Q4_K', "
                     r"'Q6_K', 'Q8_0'\]"):
    blocks.pack_blocks(raw, 16, 32, "Q5_K")
  with pytest.raises(ValueError, match="k=288: .*multiple of 256"):
    blocks.pack_blocks(raw, 16, 288, "Q6_K")
  with pytest.raises(ValueError, match="qtype=.*F16"):
    blocks.blocks_dense(jnp.zeros((1, 32)), jnp.zeros((1, 1, 320), jnp.uint8), 16, 32,
                        GGMLQuantizationType.F16)
  with pytest.raises(ValueError, match="k=48: .*multiple of 32"):
    blocks.pack_blocks(raw, 16, 48, "Q4_1")
  with pytest.raises(ValueError, match="raw: expected 320 uint8 bytes"):
    blocks.pack_blocks(raw[:, :10], 16, 32, "Q4_1")
  packed = jnp.asarray(blocks.pack_blocks(raw, 16, 32, "Q4_1"))
  assert packed.shape == (1, 1, 320)
  with pytest.raises(ValueError, match="x: expected a last dimension of k=32"):
    blocks.blocks_dense(jnp.zeros((1, 64)), packed, 16, 32, "q4_1")
  with pytest.raises(ValueError, match="packed: expected uint8"):
    blocks.blocks_dense(jnp.zeros((1, 32)), packed, 16, 32, "Q8_0")


def test_fallback_without_compiler(monkeypatch, tmp_path):
  """No compiler: one KernelFallbackWarning, then the dequantise-in-XLA path, same values."""
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  monkeypatch.setenv("SPECJAX_CXX", "/nonexistent/g++")
  blocks.LIBRARY.reset()
  try:
    rng = np.random.default_rng(6)
    n, k = 20, 64
    raw = random_raw(rng, n, k, "Q4_0")
    packed = jnp.asarray(blocks.pack_blocks(raw, n, k, "Q4_0"))
    x = rng.standard_normal((2, k)).astype(np.float32)
    with pytest.warns(blocks.KernelFallbackWarning, match="not found"):
      assert not blocks.available()
    assert _err(blocks.blocks_dense(x, packed, n, k, "Q4_0"), x, reference(raw, "Q4_0")) < 1e-5
  finally:
    monkeypatch.undo()
    blocks.LIBRARY.reset()
