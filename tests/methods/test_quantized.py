"""kernels/quant.py (4- and 8-bit blocks times int8 activations) and methods/quantized.py (the
target drafting for itself through them): the math against plain numpy, the cast reproducing
blocks it was built from, greedy identity with autoregressive decoding, argument errors."""

from __future__ import annotations

import numpy as np
import pytest

import specjax as sj
from specjax import methods
from specjax.kernels import quant

from tests.helpers.models import memoryless_model, random_prompts, tiny_model


def np_quantize_weight(w, bits):
  """Plain numpy: w [K, N] -> q [Kp/32, 32, N], d, m [Kp/32, N] (m None for 8 bits)."""
  k, n = w.shape
  kp = -(-k // 32) * 32
  wb = np.pad(w.astype(np.float32), ((0, kp - k), (0, 0))).reshape(kp // 32, 32, n)
  if bits == 4:
    lo, hi = wb.min(1), wb.max(1)
    d = ((hi - lo) / np.float32(15)).astype(np.float32)
    inv = np.where(d > 0, 1 / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.clip(np.round((wb - lo[:, None]) * inv[:, None]), 0, 15)
    return q.astype(np.int64), d, lo
  amax = np.abs(wb).max(1)
  inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
  q = np.clip(np.round(wb * inv[:, None]), -127, 127)
  return q.astype(np.int64), (amax / np.float32(127)).astype(np.float32), None


def np_qdense(x, w, bits):
  """Plain numpy (float64 accumulation): x [M, K] times the quantized w, activations per block."""
  q, d, m = np_quantize_weight(w, bits)
  k = w.shape[0]
  kp = q.shape[0] * 32
  xb = np.pad(x.astype(np.float32), ((0, 0), (0, kp - k))).reshape(len(x), kp // 32, 32)
  amax = np.abs(xb).max(-1)
  inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
  xq = np.clip(np.round(xb * inv[..., None]), -127, 127).astype(np.int64)  # np.round: half even
  dx = (amax / np.float32(127)).astype(np.float64)
  isum = np.einsum("mbi,bin->mbn", xq, q)
  y = np.einsum("bn,mb,mbn->mn", d.astype(np.float64), dx, isum.astype(np.float64))
  if m is not None:
    y += np.einsum("bn,mb->mn", m.astype(np.float64), dx * xq.sum(-1))
  return y


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k", [64, 48, 7])  # whole blocks, a padded last block, less than one
def test_qdense_matches_numpy(bits, k):
  rng = np.random.default_rng(k + bits)
  n = 40
  w = rng.normal(size=(k, n)).astype(np.float32)
  x = rng.normal(size=(2, 3, k)).astype(np.float32)
  x[0, 1] = 0.0  # a zero row: dx = 0, no division by zero
  x[1, 0, :min(k, 32)] = 0.0  # a zero block
  qw = quant.quantize_weight(w, bits, pack=False)
  q, d, m = np_quantize_weight(w, bits)
  np.testing.assert_array_equal(np.asarray(qw.q), q)
  np.testing.assert_allclose(np.asarray(qw.d), d, rtol=1e-6)
  y = np.asarray(quant.qdense(x, qw))
  assert y.shape == (2, 3, n) and y.dtype == np.float32
  ref = np_qdense(x.reshape(-1, k), w, bits).reshape(2, 3, n)
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
  assert np.all(y[0, 1] == 0)
  # close to the float product, as the block quantization allows
  err = np.abs(y - x @ w).max() / np.abs(x @ w).max()
  assert err < (0.2 if bits == 4 else 0.03), err


def test_dense_dispatches_on_a_quantized_weight():
  """kernels.dense(x, w, qw) is the quantized product, with w's output shape; w is not read."""
  from specjax import kernels
  rng = np.random.default_rng(0)
  w = rng.normal(size=(32, 2, 5)).astype(np.float32)
  x = rng.normal(size=(3, 32)).astype(np.float32)
  qw = quant.quantize_weight(w.reshape(32, 10), 8, pack=False)
  y = np.asarray(kernels.dense(x, w, qw))
  assert y.shape == (3, 2, 5)
  np.testing.assert_allclose(y.reshape(3, 10), np.asarray(quant.qdense(x, qw)))
  yt = np.asarray(kernels.dense(x, w.reshape(32, 10).T, qw, transposed=True))
  np.testing.assert_allclose(yt, y.reshape(3, 10))


def test_cast_reproduces_the_blocks_it_came_from():
  """Weights that are exactly d q + m (every block using 0 and 15) give back q exactly and d, m
  to float rounding; d q (8 bits, every block reaching +-127) likewise."""
  rng = np.random.default_rng(1)
  nb, n = 3, 17
  q = rng.integers(0, 16, size=(nb, 32, n))
  q[:, 0], q[:, 1] = 0, 15
  d = rng.uniform(0.01, 0.1, size=(nb, n)).astype(np.float32)
  m = rng.uniform(-0.5, 0.0, size=(nb, n)).astype(np.float32)
  w = (d[:, None] * q + m[:, None]).astype(np.float32).reshape(nb * 32, n)
  qw = quant.quantize_weight(w, 4, pack=False)
  np.testing.assert_array_equal(np.asarray(qw.q), q)
  np.testing.assert_allclose(np.asarray(qw.d), d, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(qw.m), m)
  np.testing.assert_allclose(np.asarray(quant.dequantize(qw)), w, atol=1e-6)
  q8 = rng.integers(-127, 128, size=(nb, 32, n))
  q8[:, 0] = 127
  w8 = (d[:, None] * q8).astype(np.float32).reshape(nb * 32, n)
  qw8 = quant.quantize_weight(w8, 8, pack=False)
  np.testing.assert_array_equal(np.asarray(qw8.q), q8)
  np.testing.assert_allclose(np.asarray(qw8.d), d, rtol=1e-6)


def test_quantize_weight_errors():
  with pytest.raises(ValueError, match="bits=3"):
    quant.quantize_weight(np.ones((32, 4)), 3)
  with pytest.raises(ValueError, match="2-D"):
    quant.quantize_weight(np.ones((32,)), 4)
  with pytest.raises(ValueError, match="K=32"):
    quant.qdense(np.ones((1, 31), np.float32), quant.quantize_weight(np.ones((32, 4)), 8))


# ----------------------------------------------------------------------------- the method


@pytest.fixture(scope="module")
def target():
  return tiny_model(seed=0)


@pytest.fixture(scope="module")
def prompts(target):
  return random_prompts(4, target.config.vocab_size, seed=5)


@pytest.fixture(scope="module")
def reference(target, prompts):
  return sj.generate(target, prompts, sj.Autoregressive(), max_new_tokens=20).tokens


# The lossless suite (tests/methods/test_lossless.py) runs (4, shared) and (8, own) at batch 1 and 4
# (and (8, own) sampling); here the other cache mode of 4 bits, with adaptive gamma.
@pytest.mark.parametrize("bits,cache,adaptive", [(4, "own", True)])
def test_greedy_identical_to_autoregressive(bits, cache, adaptive, target, prompts, reference):
  """Batch 4 (mixed prompt lengths) token for token, and the per-position statistics."""
  method = sj.QuantizedDraft(bits=bits, cache=cache, gamma=3, adaptive=adaptive)
  out = sj.generate(target, prompts, method, max_new_tokens=20)
  assert out.tokens == reference
  s = out.stats
  assert s["bits"] == bits and s["cache"] == cache
  assert len(s["acceptance_by_position"]) == 3 and len(s["accepted_by_position"]) == 3
  assert s["accepted_tokens"] > 0, "a quantized copy of the target should agree with it often"
  # every round drafts d_1, so its acceptance is over all rounds; later ones never exceed it
  assert s["accepted_by_position"][0] == pytest.approx(s["acceptance_by_position"][0])
  assert s["accepted_by_position"] == sorted(s["accepted_by_position"], reverse=True)


def test_vocabulary_subset_greedy_identical_and_its_head_alone(target, prompts, reference):
  """vocab=ids: the draft proposes over a subset (every other token, so the target's tokens
  outside it are never drafted), its head being the subset's rows quantized alone; batch 4 token
  for token with autoregressive decoding."""
  from specjax.methods import quantized

  v = target.config.vocab_size
  ids = np.arange(0, v, 2)
  method = sj.QuantizedDraft(gamma=3, vocab=ids)
  arrays = method.arrays(target)
  assert arrays["head"].n == len(ids) and arrays["head"].k == target.config.hidden_size
  # The subset head's logits are the full draft's at those ids, to the int8 activations' rounding.
  h = np.random.default_rng(0).normal(size=(2, target.config.hidden_size)).astype(np.float32)
  full = np.asarray(quantized.quantized_weights(target, 4)[-1].product(h))
  np.testing.assert_allclose(np.asarray(arrays["head"].product(h)), full[:, ids], rtol=0.05,
                             atol=0.05 * np.abs(full).max())
  out = sj.generate(target, prompts, method, max_new_tokens=20)
  assert out.tokens == reference
  assert out.stats["accepted_tokens"] > 0
  # The reference holds tokens the draft cannot propose: verification alone emits those.
  assert any(t % 2 for row in reference for t in row)
  assert sj.QuantizedDraft(gamma=3).key != method.key  # programs differ by the subset's size


@pytest.mark.parametrize("settings", [dict(temperature=1.0, top_k=5)], ids=["t1-k5"])
def test_vocabulary_subset_sampling_distribution(settings):
  """Exactness at temperature > 0 with q zero outside the subset: the target's joint
  distribution of the first two tokens (the lossless suite's check)."""
  from tests.helpers.lossless import small_target, tv_check

  model = small_target()
  v = model.config.vocab_size
  method = sj.QuantizedDraft(gamma=2, vocab=np.arange(v - 3))  # three tokens never drafted
  tv, expected = tv_check(model, method, dict(dict(top_k=0, top_p=1.0), **settings))
  assert tv < 2 * expected, f"TV {tv:.4f} vs expected sampling error {expected:.4f}"


def _repetitive(vocab_size, n=4, seed=11):
  """Prompts that repeat a random phrase (prompt lookup finds copies in them)."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    phrase = rng.integers(3, vocab_size, size=4 + i).tolist()
    out.append(phrase * 3 + phrase[:2])
  return out


def test_multi_level_greedy_identical_and_fewer_draft_forwards():
  """lookup=k: prompt lookup drafts for the quantized draft. Batch 4, token for token with
  autoregressive decoding, on a target whose text repeats itself (its next token depends on the
  current one alone), so the copies are taken: more than one drafted token per draft forward
  (one per forward without lookup)."""
  target = memoryless_model(seed=2)
  prompts = _repetitive(target.config.vocab_size)
  ref = sj.generate(target, prompts, sj.Autoregressive(), max_new_tokens=20, stop_at_eos=False)
  method = sj.QuantizedDraft(gamma=4, lookup=3, adaptive=True)
  out = sj.generate(target, prompts, method, max_new_tokens=20, stop_at_eos=False)
  assert out.tokens == ref.tokens
  s = out.stats
  assert s["draft_calls"] > 0 and s["drafts_per_call"] > 1.2, s
  assert s["accepted_by_position"] == sorted(s["accepted_by_position"], reverse=True)


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.8)],
                         ids=["t1", "t0.7-p0.8"])
def test_multi_level_sampling_distribution(settings):
  """Exactness at temperature > 0 with the copies accepted by the draft's own rejection rule:
  the joint distribution of the first two tokens is the target's (the lossless suite's check)."""
  from tests.helpers.lossless import small_target, tv_check

  model = small_target()
  tv, expected = tv_check(model, sj.QuantizedDraft(gamma=3, lookup=2, ngram=1), dict(
      dict(top_k=0, top_p=1.0), **settings))
  assert tv < 2 * expected, f"TV {tv:.4f} vs expected sampling error {expected:.4f}"


def test_weights_cast_once_per_model(target):
  from specjax.methods import quantized
  a = quantized.quantized_weights(target, 4)
  assert quantized.quantized_weights(target, 4) is a
  assert sj.QuantizedDraft().arrays(target)["quantized"] is a
  sites = 4 * target.config.num_layers + 1
  assert len(a) == sites and all(qw.bits == 4 for qw in a)
  assert quantized.quantized_weights(target, 8)[0].bits == 8


@pytest.mark.parametrize("kw,match", [
    (dict(bits=3), r"bits=3 is invalid: must be 4 .* or 8"),
    (dict(bits=True), r"bits=True is invalid"),
    (dict(cache="mine"), r"cache='mine' is invalid: must be 'shared' .* or 'own'"),
    (dict(gamma=0), r"gamma=0 is invalid: must be an integer in \[1, 64\]"),
    (dict(gamma=4, min_gamma=5), r"min_gamma=5 is invalid"),
    (dict(lookup=-1), r"lookup=-1 is invalid"),
    (dict(lookup=2, cache="own"), r"lookup=2 \(multi-level drafting\) needs cache='shared'"),
    (dict(lookup=2, threshold=0.5), r"needs cache='shared' and threshold=0"),
    (dict(vocab=[1, 1, 2]), r"vocab must be distinct token ids"),
    (dict(vocab=[1, 2], lookup=2), r"vocab .* applies to one-level drafting; got lookup=2"),
])
def test_bad_arguments(kw, match):
  with pytest.raises(sj.InputError, match=match):
    sj.QuantizedDraft(**kw)


def test_vocabulary_subset_out_of_range_fails_before_compiling(target, prompts):
  v = target.config.vocab_size
  with pytest.raises(sj.InputError, match=rf"vocab must be distinct token ids in \[0, {v}\)"):
    sj.generate(target, prompts, sj.QuantizedDraft(vocab=[0, v]), max_new_tokens=4)


def test_registry_entry(target):
  for name in ("quantized", "qspec", "quantized-draft", "QuantizedDraft"):
    assert methods.canonical(name) == "quantized"
  m = methods.build("qspec", target, bits=8, gamma=2)
  assert m == sj.QuantizedDraft(bits=8, gamma=2)
  assert methods.REGISTRY["quantized"].available(target)


def test_gguf_q4_1_weights_come_back_exactly(smollm2):
  """The embedded SmolLM2's layers were dequantised from GGUF Q4_1 blocks: cast to Q4_1 again,
  they give back the same weights (to float rounding), so its 4-bit draft differs from the
  target only in its int8 activations and its head (a Q8_0 embedding, which 4 bits cannot hold)."""
  from specjax import packing
  sites = list(packing.dense_sites(smollm2.module()))
  for _, _, w, _ in sites[:4]:  # layer 0: wqkv, wo, w_in, w_out
    w = np.asarray(w)
    back = np.asarray(quant.dequantize(quant.quantize_weight(w, 4, pack=False)))
    np.testing.assert_allclose(back, w, rtol=0, atol=1e-6)
