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

from conftest import random_prompts, tiny_model
from test_lossless import GREEDY_METHODS

_USER_CACHE = os.environ.get("SPECJAX_CACHE")
needs_kernel = pytest.mark.skipif(not kernels.available(),
                                  reason="specjax.kernels unavailable here (see its warning)")


def _paths():
  """Every instruction-set path this CPU can run (forced one at a time)."""
  if not kernels.available():
    return []
  best = kernels.ISAS[kernels.isa()]
  return [name for name, v in kernels.ISAS.items() if v <= best]


@pytest.fixture
def isa_path(request):
  before = kernels.isa()
  assert kernels.set_isa(request.param) == request.param
  yield request.param
  kernels.set_isa(before)


def _rel(a, ref):
  return float(np.abs(np.asarray(a, np.float64) - ref).max() / np.abs(ref).max())


@needs_kernel
@pytest.mark.parametrize("isa_path", _paths(), indirect=True)
def test_parity_random_shapes(isa_path):
  """M = 1..32 with odd K and N (column tails in the last block), every block width, plain and
  transposed weights, threaded and single-threaded sizes: within 1e-5 of the exact product."""
  rng = np.random.default_rng(0)
  f = jax.jit(kernels.dense, static_argnames="transposed")
  for i, m in enumerate(range(1, 33)):
    k = int(rng.integers(1, 700)) | 1
    n = int(rng.integers(1, 1100)) | 1
    if i % 8 == 0:
      k, n = 577, 961  # > the threaded threshold
    transposed = i % 3 == 0
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k) if transposed else (k, n)).astype(np.float32)
    packed = jnp.asarray(kernels.pack_weight(w, transposed=transposed, bw=kernels.BLOCK_WIDTHS[i % 4]))
    ref = x.astype(np.float64) @ (w.T if transposed else w).astype(np.float64)
    y = f(x, w, packed, transposed=transposed)
    assert y.shape == (m, n)
    assert _rel(y, ref) < 1e-5, (isa_path, m, k, n, transposed)
    assert _rel(jnp.dot(x, w.T if transposed else w), ref) < 1e-5  # the bar XLA itself meets


@needs_kernel
def test_rows_do_not_depend_on_the_batch():
  """A row's result is the same bits whether it is computed alone or with 31 others: verifying T
  tokens gives each exactly what decoding it alone gives (what the lossless suite relies on)."""
  rng = np.random.default_rng(1)
  x = rng.standard_normal((32, 577)).astype(np.float32)
  w = rng.standard_normal((577, 1000)).astype(np.float32)
  p = jnp.asarray(kernels.pack_weight(w))
  full = np.asarray(kernels.dense(x, w, p))
  for m in (1, 3, 7, 16):
    np.testing.assert_array_equal(np.asarray(kernels.dense(x[:m], w, p)), full[:m])


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
    cache = model.init_cache(1, 64)
    toks = jnp.zeros((1, t), jnp.int32)
    mask = kv.causal_mask(cache.lengths, t, 64)
    return jax.jit(model.apply).lower(model.params, toks, jnp.arange(t)[None], cache, mask).as_text()

  assert hlo(packed, 4).count(kernels.TARGET) == 4 * 2 + 1  # 4 per layer + the head
  assert kernels.TARGET not in hlo(packed, kernels.MAX_ROWS + 1)  # large M: XLA
  assert kernels.TARGET not in hlo(m, 4)


@needs_kernel
@pytest.mark.parametrize("kind", ["eagle", "mtp"])
def test_feature_heads_use_the_kernel(kind):
  """A packed target's EAGLE / MTP modules run their 5 dense products (fc, qkv, o, mlp in / out)
  on the kernel for few-row inputs and match XLA's result; unpacked modules never call it."""
  from specjax.heads import feature_module, init_heads, module_arrays, pack_module

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
    return feature_module(cfg, md, emb, feat, pos, cache.layers[0], cache.lengths, mask)

  lowered = [jax.jit(run).lower(md).as_text() for md in (mod, packed)]
  assert kernels.TARGET not in lowered[0] and lowered[1].count(kernels.TARGET) == 5
  (a, ca), (b, cb) = jax.jit(run)(mod), jax.jit(run)(packed)
  np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)
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
  """The lossless suite's first variant of each method class (each costs a compile)."""
  seen, out = set(), []
  probe = tiny_model(seed=0)
  for name, factory in GREEDY_METHODS:
    cls = type(factory(probe))
    if cls not in seen:
      seen.add(cls)
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
  kernels._reset_for_tests()
  yield monkeypatch
  monkeypatch.undo()
  kernels._reset_for_tests()


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
  """load_model packs by default here; every method with the kernel gives the tokens of XLA's
  autoregressive decoding (kernels=False and the switch)."""
  assert packing.is_packed(smollm2)
  xla = packing.unpack(smollm2)
  prompts = ["def fibonacci(n):", "The capital of France is"]
  ref = sj.generate(xla, prompts, max_new_tokens=32).tokens
  draft = sj.load_model("smollm2-135m-draft", target=smollm2)
  methods = [sj.Autoregressive(), sj.PromptLookup(), sj.Lookahead(), sj.DraftModel(draft, gamma=3),
             sj.SelfSpeculative(exit_layer=6, gamma=3)]
  for method in methods:
    assert sj.generate(smollm2, prompts, method, max_new_tokens=32).tokens == ref, method.name
