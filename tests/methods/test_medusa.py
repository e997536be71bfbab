"""Medusa (specjax/methods/medusa.py), its heads (specjax/heads.py) and their loss
(specjax/training/medusa.py). Greedy identity and the TV check are in test_lossless.py."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax import decode
from specjax.errors import InputError, ModelNotFoundError, WeightsError
from specjax.heads import init_heads, load_heads, save_heads
from specjax.methods.medusa import Medusa
from specjax.training import medusa as tm

from tests.helpers.models import memoryless_model, random_prompts, tiny_model


def _own_text(target, n=32, length=32, seed=11):
  v = target.config.vocab_size
  ps = random_prompts(n, v, seed=seed, lo=3, hi=8)
  gen = sj.generate(target, ps, max_new_tokens=length, stop_at_eos=False).tokens
  return np.array([(p + g)[:length] for p, g in zip(ps, gen)])


@pytest.fixture(scope="module")
def memoryless():
  return memoryless_model()


@pytest.fixture(scope="module")
def fitted(memoryless):
  """Heads fitted to the memoryless model's own text: they predict it well."""
  heads, losses = tm.fit(memoryless, init_heads(memoryless, "medusa", num_heads=3, seed=0),
                         _own_text(memoryless), steps=300, lr=3e-2)
  return heads, losses


def test_fitted_heads_are_accepted_and_identical(memoryless, fitted):
  heads, _ = fitted
  prompts = random_prompts(4, 61, seed=9)
  ref = sj.generate(memoryless, prompts, max_new_tokens=24)
  out = sj.generate(memoryless, prompts, Medusa(heads, acceptance="greedy"), max_new_tokens=24)
  assert out.tokens == ref.tokens
  assert out.stats["mean_accepted"] > 2.0, out.stats  # tau: tokens per target call
  hist = out.stats["accepted_depth_hist"]
  assert len(hist) == 4 and sum(hist) == out.stats["draft_rounds"]
  assert hist[3] > 0  # whole paths accepted
  assert len(out.stats["head_acceptance"]) == 3 and out.stats["head_acceptance"][0] > 0.5
  # Rows went at their own pace: not every row needed the same number of target calls.
  assert len(set(out.stats["target_calls_per_row"])) > 1 or len(set(map(len, ref.tokens))) > 1


def test_sampling_with_fitted_heads_accepts(memoryless, fitted):
  heads, _ = fitted
  out = sj.generate(memoryless, random_prompts(4, 61, seed=3), Medusa(heads),
                    max_new_tokens=24, temperature=0.7, seed=1)
  assert out.stats["mean_accepted"] > 1.5
  typ = sj.generate(memoryless, random_prompts(4, 61, seed=3), Medusa(heads, acceptance="typical"),
                    max_new_tokens=24, temperature=0.7, seed=1)
  assert typ.stats["mean_accepted"] > 1.5
  assert not Medusa(heads, acceptance="typical").lossless and Medusa(heads).lossless


def test_vocab_subset_heads(memoryless):
  """Heads scoring a vocabulary subset: still token-identical; candidates come from the subset."""
  ids = np.arange(0, 61, 2)
  heads, _ = tm.fit(memoryless, init_heads(memoryless, "medusa", num_heads=2, vocab=ids, seed=1),
                    _own_text(memoryless), steps=100, lr=3e-2)
  prompts = random_prompts(4, 61, seed=2)
  ref = sj.generate(memoryless, prompts, max_new_tokens=16).tokens
  out = sj.generate(memoryless, prompts, Medusa(heads, tree=[(0,), (1,), (0, 0)]),
                    max_new_tokens=16)
  assert out.tokens == ref
  m = Medusa(heads, tree=[(0,), (1,)])
  arrays = m.arrays(memoryless)
  prog = decode.Program(memoryless.graphdef, memoryless.config, m, 64)
  cands = m.propose(prog, memoryless.params, arrays, jnp.ones((2, 32)))
  assert set(np.asarray(cands).ravel().tolist()) <= set(ids.tolist())


def test_default_tree_and_stats(tiny):
  heads = init_heads(tiny, "medusa", num_heads=4)
  m = Medusa(heads)
  assert m.tree.num_nodes == 15 and m.tree.max_depth <= 4
  assert m.extra_slots == 16 and m.max_emit == m.tree.max_depth + 1
  out = sj.generate(tiny, [[1, 2, 3]], m, max_new_tokens=8)
  for k in ("tree_nodes", "accepted_depth_hist", "head_acceptance", "accepted_per_step"):
    assert k in out.stats
  assert hash(Medusa(heads, tree=[(0,), (1,)])) == hash(Medusa(heads, tree=[(1,), (0,)]))


# ----------------------------------------------------------------------------- heads I/O


def test_save_load_roundtrip(tmp_path, tiny):
  heads = init_heads(tiny, "medusa", num_heads=2, num_layers=2, scale=1.0, vocab=[5, 1, 9])
  path = save_heads(heads, str(tmp_path / "h.npz"), meta={"steps": 7})
  back = load_heads(path, tiny)
  assert back.config == heads.config and back.meta["steps"] == 7
  np.testing.assert_array_equal(back.vocab, [5, 1, 9])
  for k in ("w", "b"):
    np.testing.assert_allclose(back.params[k], heads.params[k], rtol=2e-3, atol=2e-3)  # float16
  with pytest.raises(InputError, match="width 32 and vocabulary 61"):
    load_heads(path, tiny_model(vocab_size=71))


def test_missing_heads(monkeypatch, tmp_path):
  from specjax import shipped

  entry = shipped.DRAFTERS["smollm2-135m-medusa"]
  import specjax.drafters.kinds as heads_mod  # as if the asset were not shipped:
  monkeypatch.setattr(heads_mod.os.path, "isfile", lambda p: False if p.endswith(entry.asset) else
                      os.path.exists(p))
  with pytest.raises(ModelNotFoundError, match="specjax train medusa"):
    load_heads("smollm2-135m-medusa")
  with pytest.raises(ModelNotFoundError, match="neither"):
    load_heads("/nonexistent/heads.npz")


def test_corrupt_heads_file(tmp_path):
  p = tmp_path / "bad.npz"
  p.write_bytes(b"not a zip")
  with pytest.raises(WeightsError):
    load_heads(str(p))


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kw,match", [
    (dict(tree=[]), "empty"),
    (dict(tree=[(0,), (10,)]), "rank 10"),
    (dict(tree=[(0,), (3,)], top_k=3), "rank 3"),
    (dict(tree=[(0,), (0, 0), (0, 0, 0)]), "depth 3"),
    (dict(tree=[(0,), (0,)]), "twice"),
    (dict(tree=[(0,), (1, 1)]), "no parent"),
    (dict(acceptance="sampling"), "acceptance='sampling'"),
    (dict(acceptance="typical", epsilon=0.0), "epsilon"),
    (dict(acceptance="typical", delta=-1.0), "delta"),
    (dict(top_k=0), "top_k"),
])
def test_bad_arguments(tiny, kw, match):
  heads = init_heads(tiny, "medusa", num_heads=2)
  with pytest.raises(InputError, match=match):
    Medusa(heads, **kw)


def test_bad_heads_raise_before_compiling(tiny):
  with pytest.raises(InputError, match="Heads"):
    Medusa(object())
  with pytest.raises(InputError, match="kind"):
    init_heads(tiny, "eagle2")
  other = init_heads(tiny_model(hidden_size=16, num_heads=2, num_kv_heads=1), "medusa",
                     num_heads=2)
  n = decode.compile_cache.count
  with pytest.raises(InputError, match="width 16"):
    sj.generate(tiny, [[1, 2, 3]], Medusa(other, tree=[(0,)]), max_new_tokens=4)
  wrong_vocab = init_heads(tiny_model(vocab_size=64), "medusa", num_heads=2)
  with pytest.raises(InputError, match="vocabulary 64"):
    sj.generate(tiny, [[1, 2, 3]], Medusa(wrong_vocab, tree=[(0,)]), max_new_tokens=4)
  assert decode.compile_cache.count == n


# ----------------------------------------------------------------------------- training loss


def test_loss_matches_a_direct_computation(tiny):
  heads = init_heads(tiny, "medusa", num_heads=2, scale=0.5, seed=3)
  toks = np.asarray(random_prompts(2, 61, seed=4, lo=12, hi=13))
  hidden = tm.teacher_hidden(tiny, toks)
  head = tm.lm_head_matrix(tiny)
  loss, met = tm.medusa_loss(heads.params, heads.config, hidden, jnp.asarray(toks), head)
  z = np.asarray(tm.medusa_hidden(heads.params, hidden))  # [B,T,K,E]
  logits = z @ np.asarray(head).T
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - logits.max(-1, keepdims=True)
  want = 0.0
  for k in range(2):
    s = k + 2
    ce = -np.mean([logp[b, t, k, toks[b, t + s]] for b in range(2) for t in range(12 - s)])
    np.testing.assert_allclose(met[f"loss_{k}"], ce, rtol=1e-4)
    want += 0.8 ** k * ce
  np.testing.assert_allclose(loss, want, rtol=1e-4)
  # Teacher hidden states are the model's own final-normed hidden states.
  ref = tiny.apply(tiny.params, jnp.asarray(toks), jnp.broadcast_to(jnp.arange(12), (2, 12)),
                   tiny.init_cache(2, 12), sj.cache.causal_mask(jnp.zeros(2, jnp.int32), 12, 12))[1]
  np.testing.assert_allclose(hidden, ref, rtol=1e-4, atol=1e-4)  # jit vs eager rounding


def test_loss_decreases_and_heads_learn(memoryless, fitted):
  _, losses = fitted
  assert losses[-1] < 0.2 * losses[0]
  toks = _own_text(memoryless, n=8, seed=99)
  heads, _ = fitted
  _, met = tm.medusa_loss(heads.params, heads.config, tm.teacher_hidden(memoryless, toks),
                          jnp.asarray(toks), tm.lm_head_matrix(memoryless))
  acc = tm.accuracy_table(met, 3)
  assert np.all(acc[:, 0] > 0.6) and np.all(acc[:, 1] >= acc[:, 0])  # held-out text


@pytest.mark.slow
def test_shipped_smollm2_heads(smollm2):
  """The shipped heads fit SmolLM2, carry their training record, and decode losslessly."""
  heads = load_heads("smollm2-135m-medusa", smollm2)
  assert heads.config.num_heads == 4 and heads.config.vocab_subset == 8192
  held = heads.meta["held_out"]
  assert held["top1_0"] > held["top1_1"] > 0.05  # head 0 (t+2) is the most accurate
  prompt = ["Write a haiku about the sea."]
  ref = sj.generate(smollm2, prompt, max_new_tokens=24, chat=True).tokens
  out = sj.generate(smollm2, prompt, sj.Medusa(heads, tree=[(0,), (1,), (0, 0)]), max_new_tokens=24,
                    chat=True)
  assert out.tokens == ref
  # EAGLE's and MTP's shipped heads fit too (loading checks width and vocabulary) and carry the
  # held-out record of the run that made them; their decoding is Medusa's tree machinery above.
  eagle = load_heads("smollm2-135m-eagle", smollm2)
  assert eagle.config.kind == "eagle" and eagle.config.vocab_subset == 8192
  e = eagle.meta["held_out"]
  assert e["top1"] > e["top1_2"] > 0.2 and eagle.meta["unroll"] == 4  # training-time test
  assert eagle.config.taps == (2, 15)  # fused features: layers 2 and 15 beside the last
  assert sj.generate(smollm2, prompt, sj.Eagle(eagle, depth=3, top_k=3, num_nodes=6),
                     max_new_tokens=24, chat=True).tokens == ref
  mtp = load_heads("smollm2-135m-mtp", smollm2)
  assert mtp.config.num_heads == 2 and mtp.meta["held_out"]["top1_0"] > 0.2


def test_label_rank_is_the_position_in_top_k_ids():
  """The training metrics' rank of the label (top-1: rank 0, top-5: rank < 5) is its position in
  heads.top_k_ids' order, ties (lower index first) included."""
  from specjax.heads import top_k_ids

  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.integers(0, 6, size=(3, 7, 40)).astype(np.float32))  # many ties
  labels = jnp.asarray(rng.integers(0, 40, size=(3, 7)))
  order = np.asarray(top_k_ids(logits, 40))
  want = np.argmax(order == np.asarray(labels)[..., None], axis=-1)
  np.testing.assert_array_equal(np.asarray(tm.label_rank(logits, labels)), want)
