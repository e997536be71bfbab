"""specjax.kernels: the CPU matmul kernel against XLA's dot, inside the model (packed by
specjax.packing) and every method, and its fallbacks (no compiler, an unsupported CPU, the switch
off), which must give the same tokens.

The kernel is built once per machine into the user cache (a few seconds the first time); the
fallback tests build nothing (a missing compiler fails before compiling).
"""

from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax import cache as kv
from specjax import kernels, packing
from specjax.kernels import matmul

from tests.helpers.kernels import isa_fixture, isa_paths
from tests.helpers.lossless import GREEDY_METHODS
from tests.helpers.models import random_prompts, tiny_config, tiny_model

_USER_CACHE = os.environ.get("SPECJAX_CACHE")
needs_kernel = pytest.mark.skipif(not kernels.available(),
                                  reason="specjax.kernels unavailable here (see its warning)")


isa_path = isa_fixture(kernels)


def _rel(a, ref):
  return float(np.abs(np.asarray(a, np.float64) - ref).max() / np.abs(ref).max())


# M values the jitted tests compile (each shape is a compile): small, odd, either side of 32,
# the largest.
ROWS = (1, 2, 3, 5, 8, 13, 16, 24, 31, 33, 47, 64)


@needs_kernel
@pytest.mark.parametrize("isa_path", isa_paths(kernels), indirect=True)
def test_parity_random_shapes(isa_path):
  """M from 1 to 64 with odd K and N (column tails in the last block), every block width, plain
  and transposed weights, threaded and single-threaded sizes: within 1e-5 of the exact product."""
  rng = np.random.default_rng(0)
  f = jax.jit(kernels.dense, static_argnames="transposed")
  for i, m in enumerate(ROWS):
    k = int(rng.integers(1, 700)) | 1
    n = int(rng.integers(1, 1100)) | 1
    if i % 4 == 0:
      k, n = 1537, 961  # > the threaded threshold, K in three chunks
    transposed = i % 3 == 0
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k) if transposed else (k, n)).astype(np.float32)
    packed = jnp.asarray(kernels.pack_weight(w, transposed=transposed, bw=kernels.BLOCK_WIDTHS[i % 4]))
    ref = x.astype(np.float64) @ (w.T if transposed else w).astype(np.float64)
    y = f(x, w, packed, transposed=transposed)
    assert y.shape == (m, n)
    assert _rel(y, ref) < 1e-5, (isa_path, m, k, n, transposed)
    assert _rel(jnp.dot(x, w.T if transposed else w), ref) < 1e-5  # the bar XLA itself meets


def _host_dense(x, packed, n, bf16=False):
  """The library's host entry (no XLA, no compile): y [M,N] for x [M,K] and a packed copy."""
  import ctypes

  lib = kernels.load()
  fn = lib.specjax_dense_bf16 if bf16 else lib.specjax_dense_f32
  fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 4
  x, packed = np.ascontiguousarray(x), np.ascontiguousarray(packed)
  y = np.full((x.shape[0], n), np.nan, np.float32)
  bw = packed.shape[2] // (2 if bf16 else 1)
  fn(x.ctypes.data, packed.ctypes.data, y.ctypes.data, x.shape[0], x.shape[1], n, bw)
  return y


@needs_kernel
@pytest.mark.parametrize("isa_path", isa_paths(kernels), indirect=True)
def test_every_row_count_and_rows_independent(isa_path):
  """Every M from 1 to 64 (each row tiling: 1-8-row tiles, balanced splits, two 64-row groups
  at 65 and 130), through the host entry: within 1e-5 of the exact product, and each row the
  same bits as when it is computed alone (verifying T tokens gives each what decoding it alone
  gives, which the lossless suite relies on)."""
  rng = np.random.default_rng(5)
  for k, n, bw in ((1300, 200, 48), (96, 64, 64), (33, 40, 16)):  # K = 1300: three K-chunks
    w = rng.standard_normal((k, n)).astype(np.float32)
    packed = kernels.pack_weight(w, bw=bw)
    x = rng.standard_normal((130, k)).astype(np.float32)
    alone = _host_dense(x, packed, n)
    assert _rel(alone, x.astype(np.float64) @ w.astype(np.float64)) < 1e-5, (isa_path, k)
    for m in list(range(1, 65)) + [65, 130]:
      np.testing.assert_array_equal(_host_dense(x[:m], packed, n), alone[:m], err_msg=str((k, m)))
    for r in range(0, 130, 13):
      np.testing.assert_array_equal(_host_dense(x[r:r + 1], packed, n), alone[r:r + 1])


@needs_kernel
def test_rows_do_not_depend_on_the_batch():
  """The same through XLA: a row's result is the same bits whether it is computed alone or with
  63 others."""
  rng = np.random.default_rng(1)
  x = rng.standard_normal((64, 577)).astype(np.float32)
  w = rng.standard_normal((577, 1000)).astype(np.float32)
  p = jnp.asarray(kernels.pack_weight(w))
  full = np.asarray(kernels.dense(x, w, p))
  for m in (1, 7, 33, 47):
    np.testing.assert_array_equal(np.asarray(kernels.dense(x[:m], w, p)), full[:m])


# ----------------------------------------------------------------------------- bfloat16

def _bf16_ulp(y):
  """The spacing of bfloat16 numbers at |y| (8 significant bits)."""
  y = np.abs(np.asarray(y, np.float64))
  return np.exp2(np.floor(np.log2(np.maximum(y, 1e-30))) - 7)


@needs_kernel
def test_bf16_parity_with_xla():
  """bf16 x, w: the kernel's fp32 accumulation is within 1e-5 of the exact product of the bf16
  values (the fp32 bar), and its bf16 result is XLA's bf16 dot or a neighbour of it.

  Why: both round an fp32 sum of the same exact products (bf16 x bf16 is exact in fp32) to bf16
  once; the two sums differ only by summation order, by at most twice the fp32 bar (2e-5 of the
  largest output; ~1e-6 typically, far below bf16's 2^-8 relative spacing). So the results are
  equal unless a sum sits that close to a rounding boundary, and then differ by one bf16 spacing
  plus that fp32 difference (which matters only for outputs near zero, after cancellation).
  Differences are rare: < 1% of outputs (~0.01-0.1% here)."""
  rng = np.random.default_rng(3)
  f = jax.jit(kernels.dense, static_argnames="transposed")
  for i, m in enumerate((1, 2, 7, 33, 47, 64)):
    k, n = ((1537, 961), (577, 200), (64, 1000))[i % 3]  # odd K: a zero-padded pair
    transposed = i % 2 == 1
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n, k) if transposed else (k, n)), jnp.bfloat16)
    packed = jnp.asarray(kernels.pack_weight(np.asarray(w), transposed=transposed))
    assert packed.dtype == jnp.bfloat16 and packed.shape[1] == (k + 1) // 2
    exact = np.asarray(x, np.float64) @ np.asarray(w.T if transposed else w, np.float64)
    acc = kernels.matmul._ffi(x, packed, n)  # the fp32 sums before the rounding to bf16
    assert acc.dtype == jnp.float32 and _rel(acc, exact) < 1e-5, (m, k, n)
    y = f(x, w, packed, transposed=transposed)
    ref = kernels.matmul._xla(x, w, transposed)
    assert y.dtype == ref.dtype == jnp.bfloat16
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    diff = np.abs(y - ref)
    bound = _bf16_ulp(np.maximum(np.abs(y), np.abs(ref))) + 2e-5 * np.abs(exact).max()
    assert (diff <= bound).all(), (m, k, n)
    assert (diff > 0).mean() < 0.01, (m, k, n)


@needs_kernel
def test_bf16_rows_independent():
  """bf16 rows are the same bits alone or in a call of up to 64 (and 130) rows."""
  rng = np.random.default_rng(4)
  k, n = 577, 300
  w = np.asarray(jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16))
  packed = kernels.pack_weight(w, bw=48).view(np.uint16)
  x = np.asarray(jnp.asarray(rng.standard_normal((130, k)), jnp.bfloat16)).view(np.uint16)
  full = _host_dense(x, packed, n, bf16=True)
  for m in list(range(1, 65)) + [130]:
    np.testing.assert_array_equal(_host_dense(x[:m], packed, n, bf16=True), full[:m],
                                  err_msg=str(m))


def _flush(a):
  """Denormals as zero, sign kept (what vdpbf16ps does to its inputs and results)."""
  return np.where(np.abs(a) < np.finfo(np.float32).tiny, np.copysign(np.float32(0), a), a)


def _vdpbf16ps(x, w):
  """The documented arithmetic in numpy: x [M,K] @ w [K,N] from bf16 bit patterns (uint16, K
  even), fp32 accumulators, per pair the odd k's exact product added first and then the even
  one's, each sum rounded once to fp32 (exact in float64 first: the product has 16 significant
  bits), denormal inputs and results flushed."""
  f32 = lambda b: _flush((b.astype(np.uint32) << 16).view(np.float32))  # noqa: E731
  xs, ws = f32(x).astype(np.float64), f32(w).astype(np.float64)
  acc = np.zeros((x.shape[0], w.shape[1]), np.float32)
  for p in range(x.shape[1] // 2):
    for k in (2 * p + 1, 2 * p):
      acc = _flush((acc + xs[:, k:k + 1] * ws[k][None, :]).astype(np.float32))
  return acc


@needs_kernel
@pytest.mark.parametrize("isa_path", isa_paths(kernels), indirect=True)
def test_bf16_every_path_is_the_documented_arithmetic(isa_path):
  """On every path (vdpbf16ps where the CPU has it, fp32 FMAs elsewhere) the bf16 product is
  bit for bit the numpy model of vdpbf16ps's arithmetic, inputs with denormals included, for
  1-8 rows (every register tiling) and a call of 13, and so every path gives the same bits."""
  rng = np.random.default_rng(8)
  bits = lambda a: np.array(jnp.asarray(a, jnp.bfloat16)).view(np.uint16)  # noqa: E731
  k, n = 96, 80
  x = bits(rng.standard_normal((13, k)))
  w = bits(rng.standard_normal((k, n)) * np.where(rng.random((k, n)) < 0.05, 1e-39, 1.0))
  x[0, 5] = x[3, 8] = 0x0003  # bf16 denormals: read as zero
  want = _vdpbf16ps(x, w)
  packed = kernels.pack_weight(w.view(jnp.bfloat16), bw=16).view(np.uint16)
  for m in list(range(1, 9)) + [13]:
    np.testing.assert_array_equal(_host_dense(x[:m], packed, n, bf16=True), want[:m],
                                  err_msg=f"{isa_path}, {m} rows")


@needs_kernel
def test_leading_dims_while_loop_grad_vmap():
  """[B,T,E] inputs with a multi-axis weight, thousands of calls in a lax.while_loop, gradients
  (XLA's, through the custom_vjp) and vmap all match the XLA path."""
  rng = np.random.default_rng(2)
  w = rng.standard_normal((48, 3, 16)).astype(np.float32) / 7  # [E,M,F]-like
  p = jnp.asarray(kernels.pack_weight(w.reshape(48, -1)))
  x = rng.standard_normal((2, 3, 48)).astype(np.float32)
  y = kernels.dense(x, w, p)
  assert y.shape == (2, 3, 3, 16)
  assert _rel(y, np.asarray(kernels.dense(x, w), np.float64)) < 1e-5

  w2 = jnp.asarray(rng.standard_normal((48, 48)).astype(np.float32) / 7)
  p2 = jnp.asarray(kernels.pack_weight(np.asarray(w2)))

  @jax.jit
  def loop(x, packed):
    return jax.lax.fori_loop(0, 2000, lambda i, h: jnp.tanh(kernels.dense(h, w2, packed)), x)

  x2 = x.reshape(6, 48)
  np.testing.assert_allclose(loop(x2, p2), loop(x2, None), rtol=1e-4, atol=1e-5)

  loss = lambda w, packed: jnp.sum(jnp.sin(kernels.dense(x2, w, packed)))
  g_kernel = jax.grad(loss)(w2, p2)
  g_xla = jax.grad(loss)(w2, None)
  np.testing.assert_array_equal(g_kernel, g_xla)  # differentiation never runs the kernel

  xs = rng.standard_normal((5, 4, 48)).astype(np.float32)
  np.testing.assert_allclose(jax.vmap(lambda v: kernels.dense(v, w2, p2))(xs),
                             np.einsum("bme,ef->bmf", xs, np.asarray(w2)), rtol=1e-4, atol=1e-5)


@needs_kernel
def test_model_uses_the_kernel_and_keeps_its_params():
  m = tiny_model()
  packed = packing.pack(m)
  assert packing.is_packed(packed) and not packing.is_packed(m)
  assert packed.num_param_bytes == m.num_param_bytes  # the packed copies are not parameters
  for key in ("embed", "lm_head"):
    assert packed.params[key][...] is m.params[key][...]  # shared, not copied
  assert tuple(packed.params["layers"][0]["attn"]["wqkv"][...].shape) == (32, 2, 4, 8)
  assert not packing.is_packed(packing.unpack(packed))

  def hlo(model, t):
    cache = model.init_cache(1, 128)
    toks = jnp.zeros((1, t), jnp.int32)
    mask = kv.causal_mask(cache.lengths, t, 128)
    # Compiled: the layers' calls inlined (the lowered module holds one function per layer shape).
    return jax.jit(model.apply).lower(model.params, toks, jnp.arange(t)[None], cache,
                                      mask).compile().as_text()

  assert hlo(packed, 4).count(kernels.TARGET) == 4 * 2 + 1  # 4 per layer + the head
  assert kernels.TARGET not in hlo(packed, kernels.MAX_ROWS + 1)  # large M: XLA
  assert kernels.TARGET not in hlo(m, 4)


@needs_kernel
@pytest.mark.parametrize("kind", ["eagle", "mtp"])
def test_feature_heads_use_the_kernel(kind):
  """A packed target's EAGLE / MTP modules run their 5 dense products (fc, qkv, o, mlp in / out)
  on the kernel for few-row inputs and match XLA's result; unpacked modules never call it."""
  from specjax.heads import drafter, init_heads, module_arrays, pack_module

  m = tiny_model()
  heads = init_heads(m, kind, seed=3, scale=0.5)
  mod = module_arrays(heads.params, 0)
  packed = pack_module(mod)
  assert set(packed["packed"]) == {"fc_w", "layer.attn.wqkv", "layer.attn.wo", "layer.mlp.w_in",
                                   "layer.mlp.w_out"}
  cfg, e, t = m.config, m.config.hidden_size, 5
  rng = np.random.default_rng(0)
  emb, feat = (jnp.asarray(rng.normal(size=(2, t, e)), jnp.float32) for _ in range(2))
  cache = m.init_cache(2, 16, num_layers=1)
  pos = jnp.broadcast_to(jnp.arange(t), (2, t))
  mask = kv.causal_mask(cache.lengths, t, 16)

  def run(md):
    return drafter(heads.config, cfg, md)(emb, feat, pos, cache.layers[0], cache.lengths, mask)

  lowered = [jax.jit(run).lower(md).as_text() for md in (mod, packed)]
  assert kernels.TARGET not in lowered[0] and lowered[1].count(kernels.TARGET) == 5
  (a, ca), (b, cb) = jax.jit(run)(mod), jax.jit(run)(packed)
  # (relative to the output's scale: the packed module's attention runs on the attention kernel
  # too, whose summation order differs from XLA's)
  assert _rel(b, np.asarray(a, np.float64)) < 1e-5
  np.testing.assert_allclose(np.asarray(cb["k"]), np.asarray(ca["k"]), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def target():
  return tiny_model(seed=0)


@pytest.fixture(scope="module")
def batch(target):
  return random_prompts(4, target.config.vocab_size, seed=1)


@pytest.fixture(scope="module")
def reference(target, batch):
  return sj.generate(target, batch, sj.Autoregressive(), max_new_tokens=24).tokens


def _one_per_method():
  """The lossless suite's first variant of each method (each costs a compile), by the name before
  its "/": nothing is built at collection (some variants fit heads first)."""
  seen, out = set(), []
  for name, factory in GREEDY_METHODS:
    if name.split("/")[0] not in seen:
      seen.add(name.split("/")[0])
      out.append((name, factory))
  return out


METHODS = _one_per_method()


@needs_kernel
@pytest.mark.parametrize("name,factory", METHODS, ids=[m[0] for m in METHODS])
def test_every_method_identical_with_kernel(name, factory, target, batch, reference):
  """Every method of the lossless suite, with the kernel on, gives XLA's autoregressive tokens
  (batch of 4, mixed prompt lengths)."""
  packed = packing.pack(target)
  out = sj.generate(packed, batch, factory(packed), max_new_tokens=24)
  assert out.tokens == reference, f"{name} with the kernel differs from autoregressive without"


# ----------------------------------------------------------------------------- fallbacks


@pytest.fixture
def fresh_load(monkeypatch, tmp_path):
  """An unattempted kernel load with an empty build cache; the real state is restored after."""
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  matmul.LIBRARY.reset()
  yield monkeypatch
  monkeypatch.undo()
  matmul.LIBRARY.reset()


def _falls_back_once(target, batch, reference):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    a = packing.pack(target)
    b = packing.maybe_pack(target, True)
  fallbacks = [w for w in caught if issubclass(w.category, kernels.KernelFallbackWarning)]
  assert len(fallbacks) == 1, [str(w.message) for w in caught]
  assert not packing.is_packed(a) and not packing.is_packed(b)
  assert not kernels.available()
  assert sj.generate(a, batch, max_new_tokens=24).tokens == reference
  return str(fallbacks[0].message)


def test_fallback_without_compiler(fresh_load, target, batch, reference):
  fresh_load.setenv("SPECJAX_CXX", "/nonexistent/g++")
  assert "not found" in _falls_back_once(target, batch, reference)


@needs_kernel
def test_fallback_on_unsupported_cpu(fresh_load, target, batch, reference):
  """A CPU with neither AVX-512 nor AVX2+FMA (simulated through the detection hook)."""
  if _USER_CACHE is None:  # the library built for the other tests: nothing to compile
    fresh_load.delenv("SPECJAX_CACHE")
  else:
    fresh_load.setenv("SPECJAX_CACHE", _USER_CACHE)
  fresh_load.setattr(kernels.matmul, "_detect_isa", lambda lib: kernels.ISAS["scalar"])
  assert "AVX" in _falls_back_once(target, batch, reference)


def test_concurrent_builds_compile_once(monkeypatch, tmp_path):
  """A process that needs a library another one is building waits for its lock, then loads that
  build instead of compiling its own (a test run's workers on a fresh cache)."""
  import fcntl
  import threading

  from specjax.kernels import build

  out = build.library_path(str(tmp_path), "qdot")
  os.makedirs(os.path.dirname(out))
  compiled = []
  monkeypatch.setattr(build, "_compile", lambda *a: compiled.append(a))
  monkeypatch.setattr(build, "find_compiler", lambda cxx=None: "c++")
  got = []
  with open(out + ".lock", "a") as held:  # the "other process", mid-build
    fcntl.flock(held, fcntl.LOCK_EX)
    waiter = threading.Thread(target=lambda: got.append(build.build(cache_dir=str(tmp_path),
                                                                    library="qdot")))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and not got  # waiting on the lock, not compiling
    open(out, "wb").close()  # the other build lands, then its lock is released
  waiter.join(10)
  assert got == [out] and compiled == []
  os.remove(out)  # nobody else building: it compiles, under the lock
  assert build.build(cache_dir=str(tmp_path), library="qdot") == out and len(compiled) == 1


def test_switch_off(monkeypatch, target, batch, reference):
  """SPECJAX_KERNELS=0 (and kernels=False) leave the model unpacked, silently: the user asked."""
  monkeypatch.setenv("SPECJAX_KERNELS", "0")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    m = packing.maybe_pack(target, None)
    assert not packing.is_packed(m) and not packing.is_packed(packing.maybe_pack(target, False))
  assert sj.generate(m, batch, max_new_tokens=24).tokens == reference


# ----------------------------------------------------------------------------- SmolLM2


@pytest.mark.slow
@needs_kernel
def test_smollm2_every_method_identical_on_and_off(smollm2):
  """load_model packs by default here; with the kernel, methods give the tokens of XLA's
  autoregressive decoding (kernels=False and the switch): one row a step (autoregressive) and
  lookahead's window and guesses (16 or more rows a step). Chains of a few rows (draft model,
  prompt lookup, layer-skip) run through the same products; for CI time, not here
  (test_every_method_identical_with_kernel runs every method on the kernel on a tiny model)."""
  assert packing.is_packed(smollm2)
  xla = packing.unpack(smollm2)
  prompts = ["def fibonacci(n):", "The capital of France is"]
  ref = sj.generate(xla, prompts, max_new_tokens=32).tokens
  methods = [sj.Autoregressive(), sj.Lookahead()]
  for method in methods:
    assert sj.generate(smollm2, prompts, method, max_new_tokens=32).tokens == ref, method.name


# ----------------------------------------------------------------------------- a bfloat16 model


@pytest.fixture(scope="module")
def target_bf16():
  return sj.Model.random(tiny_config(), seed=0, scale=0.3, dtype=jnp.bfloat16)


@pytest.fixture(scope="module")
def bf16_reference(target_bf16, batch):
  """XLA's greedy tokens for the bf16 model (2 prompts, 16 tokens)."""
  return sj.generate(target_bf16, batch[:2], sj.Autoregressive(), max_new_tokens=16).tokens


@needs_kernel
def test_bf16_model_on_the_kernel(target_bf16, batch, bf16_reference):
  """A bfloat16 model packs bf16 copies (half the bytes of fp32 ones) and runs its 9 products on
  the bf16 path; prompt lookup through the kernel gives the kernel's autoregressive tokens, and
  these are XLA's (this model has no near-ties; in general the kernel may round a product to the
  bf16 number next to XLA's, see test_bf16_parity_with_xla). Every method of the lossless suite
  was checked the same way once (experiments/kernels/README.md); here one, for time."""
  packed = packing.pack(target_bf16)
  copy = packed.params["layers"][0]["attn"]["packed_wqkv"][...]
  assert copy.dtype == jnp.bfloat16
  assert copy.nbytes == kernels.pack_weight(np.zeros((32, 64), np.float32)).nbytes // 2
  cache = packed.init_cache(1, 64)
  lowered = jax.jit(packed.apply).lower(packed.params, jnp.zeros((1, 3), jnp.int32),
                                        jnp.arange(3)[None], cache,
                                        kv.causal_mask(cache.lengths, 3, 64)).compile().as_text()
  assert lowered.count(kernels.matmul.TARGET_BF16) == 4 * 2 + 1
  ar = sj.generate(packed, batch[:2], sj.Autoregressive(), max_new_tokens=16).tokens
  assert ar == bf16_reference
  pl = sj.generate(packed, batch[:2], sj.PromptLookup(ngram=2, num_tokens=4), max_new_tokens=16)
  assert pl.tokens == ar


@needs_kernel
def test_bf16_fallbacks(monkeypatch, target_bf16):
  """With the switch off, load_model's policy leaves a bf16 model unpacked silently, and a
  product given a bf16 packed copy anyway runs XLA's dot."""
  monkeypatch.setenv("SPECJAX_KERNELS", "0")
  assert not kernels.matmul.available()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert not packing.is_packed(packing.maybe_pack(target_bf16, None))
  x = jnp.ones((3, 64), jnp.bfloat16)
  w = jnp.ones((64, 32), jnp.bfloat16)
  p = jnp.asarray(kernels.pack_weight(np.asarray(w)))
  hlo = jax.jit(kernels.dense).lower(x, w, p).as_text()
  assert kernels.matmul.TARGET_BF16 not in hlo and kernels.TARGET not in hlo


# ----------------------------------------------------------------------------- threads

THREADED = ["test_matmul.py::test_parity_random_shapes",
            "test_matmul.py::test_every_row_count_and_rows_independent",
            "test_blocks.py::test_parity_with_gguf",
            "test_blocks.py::test_rows_do_not_depend_on_the_batch",
            "test_attention.py::test_parity_with_xla",
            "test_attention.py::test_prefill_without_a_cache",
            "test_qdot.py::test_parity_with_numpy",
            "test_qdot.py::test_rows_do_not_depend_on_the_batch"]


@needs_kernel
def test_threads_split_the_work_not_the_numbers():
  """The kernels' parity and row-independence tests (threaded sizes included) in a child process
  whose kernel pool has three threads: more than two cores, so threads wait for a core, run out
  of their own chunks at different times and take others' (pool.h), and the chunks do not split
  evenly. `make test` runs each worker's kernels on one thread (conftest), so this is where their
  threaded paths are tested there."""
  import subprocess
  import sys

  here = os.path.dirname(os.path.abspath(__file__))
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
  env["SPECJAX_KERNEL_THREADS"] = "3"
  # Each library has its own pool: every one of them must see three threads.
  check = ("from specjax import kernels; from specjax.kernels import attention, blocks, qdot; "
           "print(kernels.load().specjax_kernel_threads(), blocks.load().specjax_blocks_threads(), "
           "qdot.load().specjax_qdot_threads(), "
           "attention.LIBRARY.load().specjax_attention_threads())")
  r = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True,
                     timeout=300)
  assert r.stdout.split() == ["3", "3", "3", "3"], r.stdout + r.stderr[-2000:]
  r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                      *[os.path.join(here, t) for t in THREADED]],
                     env=env, cwd=os.path.dirname(os.path.dirname(here)), capture_output=True,
                     text=True, timeout=900)
  assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]
