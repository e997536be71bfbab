"""specjax.kernels.attention: the decode attention kernel against its XLA form on every
instruction-set path, inside the model (on where the dense kernel is, off with it), under grad,
and its fallback. The methods' tokens with it on are tests/kernels/test_matmul.py's (every method on
a packed model equals XLA's autoregressive decoding)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax import kernels, packing
from specjax.kernels import attention

from tests.helpers.kernels import isa_fixture, isa_paths
from tests.helpers.models import tiny_model

needs_kernel = pytest.mark.skipif(not attention.available(),
                                  reason="specjax.kernels.attention unavailable here")


isa_path = isa_fixture(attention)


def _case(rng, b, k, t, g, s, d):
  q = rng.standard_normal((b, t, k, g, d)).astype(np.float32)
  kc, vc = (rng.standard_normal((b, k, s, d)).astype(np.float32) for _ in range(2))
  kn, vn = (rng.standard_normal((b, t, k, d)).astype(np.float32) for _ in range(2))
  mask = rng.random((b, t, s + t)) < 0.6
  mask[:, :, s // 2:s] = False  # unfilled slots past the visible ones (never read)
  mask[0, 0, :] = False  # a row that sees nothing: the uniform average, as XLA's softmax gives
  return tuple(jnp.asarray(a) for a in (q, kc, vc, kn, vn, mask))


# (b, kv heads, T, group, S, D, softcap): one token, a block, odd widths and head sizes (vector
# tails), GQA and not, Gemma 2's cap.
SHAPES = ((1, 3, 8, 3, 64, 64, 0.0), (2, 2, 5, 1, 37, 20, 0.0), (1, 1, 1, 4, 16, 64, 30.0),
          (3, 2, 3, 2, 9, 17, 0.0), (1, 2, 64, 1, 40, 32, 0.0))


@needs_kernel
@pytest.mark.parametrize("isa_path", isa_paths(attention), indirect=True)
def test_parity_with_xla(isa_path):
  rng = np.random.default_rng(0)
  for b, k, t, g, s, d, cap in SHAPES:
    args = _case(rng, b, k, t, g, s, d)
    ref = np.asarray(attention._xla(*args, 0.125, cap))
    got = np.asarray(jax.jit(lambda *a: attention._kernel(*a, 0.125, cap))(*args))
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel < 1e-5, (isa_path, (b, k, t, g, s, d, cap), rel)
    # the row that sees nothing averages every column, as XLA's softmax over equal scores does
    np.testing.assert_allclose(got[0, 0], ref[0, 0], rtol=1e-5, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("isa_path", isa_paths(attention), indirect=True)
def test_prefill_without_a_cache(isa_path):
  """A prompt's prefill: no cache (attend with kc=None goes to the kernel as 0 slots), a causal
  block over T = 150 new entries (several row chunks, each reading the entries up to its last
  token), two prompts of different lengths (the shorter one's padded entries are seen by no row
  and hold NaN: never read; its padded rows see the first entry only), GQA groups and Gemma 2's
  cap. XLA's form would turn the NaN into NaN outputs, so finite outputs also show the kernel
  ran."""
  rng = np.random.default_rng(2)
  for b, k, t, g, d, cap in ((2, 3, 150, 3, 64, 0.0), (1, 2, 37, 1, 20, 30.0)):
    q = jnp.asarray(rng.standard_normal((b, t, k, g, d)).astype(np.float32))
    kn, vn = (rng.standard_normal((b, t, k, d)).astype(np.float32) for _ in range(2))
    mask = np.broadcast_to(np.tril(np.ones((t, t), bool)), (b, t, t)).copy()
    mask[-1, :, t - 10:] = False  # the last prompt is 10 shorter: its padded entries unseen
    mask[-1, t - 10:, :] = np.eye(t, dtype=bool)[t - 10:]  # (its padded rows: themselves only)
    mask[-1, t - 10:, t - 10:] = False
    mask[-1, t - 10:, 0] = True
    kn[-1, t - 10:], vn[-1, t - 10:] = np.nan, np.nan  # ... so they may hold anything
    args = (q, jnp.asarray(kn), jnp.asarray(vn), jnp.asarray(mask))
    got = np.asarray(jax.jit(lambda q, kn, vn, m: attention.attend(
        q, None, None, kn, vn, m, scale=0.125, softcap=cap, kernel=True))(*args))
    ok = np.nan_to_num(np.asarray(args[1])), np.nan_to_num(np.asarray(args[2]))
    ref = np.asarray(attention._xla(q, None, None, jnp.asarray(ok[0]), jnp.asarray(ok[1]),
                                    args[3], 0.125, cap))
    assert np.isfinite(got).all()
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel < 1e-5, (isa_path, (b, k, t, g, d, cap), rel)


def _alone(args, bi, tok):
  """The operands of a one-token call holding token `tok` of batch row bi alone: the cache
  extended by the call's earlier new entries, so that token sees the same columns in the same
  order."""
  q, kc, vc, kn, vn, mask = (np.asarray(a) for a in args)
  s = kc.shape[2]
  ext = [np.concatenate([c[bi:bi + 1], np.swapaxes(n[bi:bi + 1, :tok], 1, 2)], axis=2)
         for c, n in ((kc, kn), (vc, vn))]
  m = np.concatenate([mask[bi, tok, :s + tok], mask[bi, tok, s + tok:s + tok + 1]])[None, None]
  return tuple(jnp.asarray(a) for a in (q[bi:bi + 1, tok:tok + 1], ext[0], ext[1],
                                        kn[bi:bi + 1, tok:tok + 1], vn[bi:bi + 1, tok:tok + 1], m))


@needs_kernel
def test_each_row_has_the_bits_of_its_token_alone():
  """Batch invariance in the kernel itself: every row of a T-token call (query heads taken
  together, 1 to 5 per kv head; random cache slots and earlier entries seen; queries large
  enough that some probabilities underflow to 0 in some heads of a token and not in others)
  equals, bit for bit, a call holding its token alone over the same columns, and every
  instruction-set path gives those bits. `shared`: every token of a batch row sees the same
  cache slots (a verification block), and tokens 1 and 2 the same new entries, so the AVX-512
  part takes several tokens' heads together (up to six rows) where d is a multiple of 16."""
  rng = np.random.default_rng(7)
  paths = isa_paths(attention)
  before = attention.isa()
  try:
    for b, k, t, g, s, d, hot, shared in (
        (1, 2, 6, 3, 40, 64, 1.0, False), (2, 1, 5, 4, 30, 64, 40.0, False),
        (1, 1, 4, 5, 20, 256, 40.0, False), (1, 3, 3, 2, 70, 20, 1.0, False),
        (1, 1, 7, 1, 9, 64, 40.0, False), (1, 3, 16, 3, 300, 64, 1.0, True),
        (2, 1, 9, 4, 150, 64, 40.0, True), (1, 2, 7, 2, 90, 128, 40.0, True),
        (1, 1, 12, 1, 80, 32, 1.0, True)):
      args = list(_case(rng, b, k, t, g, s, d))
      args[0] = args[0] * hot
      mask = np.asarray(args[5]).copy()  # random cache slots seen; new entries: a causal chain
      mask[:, :, s:] = np.tril(np.ones((t, t), bool)) & (rng.random((b, t, t)) < 0.8)
      mask[:, :, s:] |= np.eye(t, dtype=bool)
      if shared:
        mask[:, :, :s] = mask[:, 1:2, :s]
        mask[:, 2, s:] = mask[:, 1, s:]
      args[5] = jnp.asarray(mask)
      call = jax.jit(lambda *a: attention._kernel(*a, 0.125, 0.0))
      outs = {}
      for path in paths:
        attention.set_isa(path)
        outs[path] = np.asarray(call(*args))
      first = outs[paths[0]]
      for path in paths[1:]:
        np.testing.assert_array_equal(outs[path].view(np.uint32), first.view(np.uint32), path)
      attention.set_isa(paths[0])
      seen = np.asarray(args[5]).any(-1)  # (a row that sees nothing averages every column)
      for bi in range(b):
        for tok in range(t):
          if not seen[bi, tok]:
            continue
          one = np.asarray(call(*_alone(args, bi, tok)))[0, 0]
          np.testing.assert_array_equal(one.view(np.uint32), first[bi, tok].view(np.uint32),
                                        ((b, k, t, g, s, d, hot), bi, tok))
  finally:
    attention.set_isa(before)


@needs_kernel
def test_a_bfloat16_cache_is_read_as_its_float32_values():
  """A bf16 model's cache goes in as bf16 and the kernel widens the slots it reads: on every path
  the bits of the same call over that cache converted to float32 beforehand (a tile of 64 slots
  and more, slots no row sees, a row that sees nothing, head sizes with a vector tail), with a
  program that converts no cache; and `attend` on bf16 operands is unchanged by it."""
  rng = np.random.default_rng(11)
  paths = isa_paths(attention)
  before = attention.isa()
  try:
    for b, k, t, g, s, d in ((1, 3, 8, 3, 200, 64), (2, 2, 5, 1, 37, 20), (1, 1, 1, 4, 16, 256)):
      q, kc, vc, kn, vn, mask = _case(rng, b, k, t, g, s, d)
      kc, vc = kc.astype(jnp.bfloat16), vc.astype(jnp.bfloat16)
      call = jax.jit(lambda *a: attention._kernel(*a, 0.125, 0.0))
      for path in paths:
        attention.set_isa(path)
        got = np.asarray(call(q, kc, vc, kn, vn, mask))
        want = np.asarray(call(q, kc.astype(jnp.float32), vc.astype(jnp.float32), kn, vn, mask))
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), (path, s, d))
    attention.set_isa(paths[0])
    bf = [a.astype(jnp.bfloat16) for a in (q, kc, vc, kn, vn)]
    f = jax.jit(lambda *a: attention.attend(*a, mask, scale=0.125, kernel=True))
    text = f.lower(*bf).compile().as_text()
    assert f"f32[{b},{k},{s},{d}]" not in text  # (no float32 copy of the cache)
    old = attention.attend(*(a.astype(jnp.float32) for a in bf), mask, scale=0.125,
                           kernel=True).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(f(*bf)).view(np.uint16),
                                  np.asarray(old).view(np.uint16))
  finally:
    attention.set_isa(before)


@needs_kernel
def test_unseen_slots_are_never_read():
  """Slots no row sees may hold anything (NaN included): the kernel reads up to each row's last
  visible slot; masked slots before it are skipped."""
  args = list(_case(np.random.default_rng(1), 1, 2, 4, 2, 32, 16))
  mask = np.asarray(args[5]).copy()
  mask[0, 0, :] = True  # (every row sees something here)
  mask[:, :, 10:32] = False
  mask[:, :, 3] = False
  args[5] = jnp.asarray(mask)
  ref = attention._xla(*args, 0.25, None)
  for i in (1, 2):  # garbage in the cache's unseen slots
    c = np.asarray(args[i]).copy()
    c[:, :, 10:] = np.nan
    c[:, :, 3] = np.nan
    args[i] = jnp.asarray(c)
  got = jax.jit(lambda *a: attention._kernel(*a, 0.25, 0.0))(*args)
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6)


@needs_kernel
def test_gradient_is_xla_s():
  """Differentiating through the kernel uses the XLA form's rule."""
  args = _case(np.random.default_rng(2), 1, 2, 3, 2, 12, 16)

  def loss(fn, q, kc):
    return jnp.sum(fn(q, kc, *args[2:], 0.25, 0.0) ** 2)

  gk = jax.grad(lambda q, kc: loss(attention._kernel, q, kc), argnums=(0, 1))(*args[:2])
  gx = jax.grad(lambda q, kc: loss(attention._xla, q, kc), argnums=(0, 1))(*args[:2])
  for a, b in zip(gk, gx):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def _program(model, t=4):
  """The compiled text of a T-token forward over a cache with 5 entries."""
  from specjax import cache as kv
  cache = kv.rollback(model.init_cache(1, 16), jnp.array([5]))
  toks, pos = jnp.zeros((1, t), jnp.int32), 5 + jnp.arange(t)[None]
  mask = kv.causal_mask(cache.lengths, t, 16)
  f = jax.jit(lambda p, c: model.apply(p, toks, pos, c, mask)[0])
  return f, cache, f.lower(model.params, cache).compile().as_text()


@needs_kernel
def test_model_runs_it_where_the_dense_kernel_runs():
  """A packed model (one CPU device, kernels on) attends on the kernel, an unpacked one on XLA,
  with the same logits up to fp32 rounding."""
  model = tiny_model()
  packed = packing.pack(model)
  assert packing.is_packed(packed)
  f_on, cache, text_on = _program(packed)
  f_off, _, text_off = _program(model)
  assert attention.TARGET in text_on and attention.TARGET not in text_off
  a, b = np.asarray(f_on(packed.params, cache)), np.asarray(f_off(model.params, cache))
  assert np.abs(a - b).max() / np.abs(b).max() < 1e-5


@needs_kernel
def test_fallback_on_unsupported_cpu(monkeypatch):
  """A CPU below AVX2+FMA (simulated through the detection hook): one warning, XLA's attention,
  the same logits."""
  model = packing.pack(tiny_model())
  _, cache, _ = _program(model)
  want = np.asarray(_program(packing.unpack(model))[0](packing.unpack(model).params, cache))
  attention.LIBRARY.reset()
  monkeypatch.setattr(attention, "_detect_isa", lambda lib: attention.ISAS["scalar"])
  try:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      f, cache, text = _program(model)
    assert [w for w in caught if issubclass(w.category, kernels.KernelFallbackWarning)]
    assert attention.TARGET not in text
    got = np.asarray(f(model.params, cache))
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5
  finally:
    monkeypatch.undo()
    attention.LIBRARY.reset()
  assert attention.available()


def test_switched_off(monkeypatch):
  monkeypatch.setenv("SPECJAX_KERNELS", "0")
  assert not attention.available()
  args = _case(np.random.default_rng(3), 1, 1, 2, 1, 4, 8)
  out = attention.attend(*args, scale=0.5, kernel=True)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(attention._xla(*args, 0.5, None)))
