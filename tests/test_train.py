"""train.py on a tiny model: a few steps, interruption + resume from the orbax checkpoint, export."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import specjax as sj
from specjax import train

from conftest import tiny_model


def _fake_data(path, vocab, n=12, t=40, seed=0):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(20, t, n).astype(np.int32)
  tokens = np.zeros((n, t), np.int32)
  for i, l in enumerate(lengths):
    # A repetitive "target" so the loss can fall in a few steps.
    tokens[i, :l] = (np.arange(l) * 3 + i) % vocab
  labels = np.full((n, t), -1, np.int32)
  for i, l in enumerate(lengths):
    labels[i, 3:l - 1] = tokens[i, 4:l]
  np.savez(path, tokens=tokens, labels=labels)


def test_train_resume_and_export(tmp_path):
  target = tiny_model(seed=0, num_layers=3)
  out = tmp_path / "run"
  out.mkdir()
  _fake_data(out / "data.npz", target.config.vocab_size)
  kw = dict(out_dir=str(out), num_layers=1, vocab_size=32, batch_size=4, seq_len=24, lr=3e-3,
            ckpt_every=3, log=lambda *a: None)
  # "Interrupted" after 4 steps: a checkpoint at step 3 and a final one at 4.
  d1 = train.train_draft(target, steps=4, **kw)
  assert d1.train_step == 4
  logs = []
  d2 = train.train_draft(target, steps=8, export=str(tmp_path / "d.npz"), **{**kw, "log": logs.append})
  assert any("resumed from checkpoint at step 4" in l for l in logs), logs
  assert d2.train_step == 8
  # Resumed parameters continue from the first run (not re-initialised from the target).
  a = train.own_params(d1)["layers_0_attn_wqkv"]
  b = train.own_params(d2)["layers_0_attn_wqkv"]
  t0 = train.own_params(train.draft_from_target(target, 1))["layers_0_attn_wqkv"]
  assert not np.allclose(a, t0) and not np.allclose(a, b)
  # The asset holds only the draft's own tensors; reloading rebuilds the same draft.
  back = train.load_draft_asset(str(tmp_path / "d.npz"), target)
  assert back.shared == (("embed",), ("lm_head",))
  assert np.array_equal(back.vocab_subset, d2.vocab_subset) and len(back.vocab_subset) == 32
  np.testing.assert_allclose(np.asarray(train.own_params(back)["layers_0_attn_wqkv"]),
                             np.asarray(b), atol=1e-2)
  # The trained draft drives DraftModel losslessly.
  prompt = [[1, 2, 3, 4, 5]]
  ref = sj.generate(target, prompt, max_new_tokens=12).tokens
  assert sj.generate(target, prompt, sj.DraftModel(back, gamma=3), max_new_tokens=12).tokens == ref


def test_train_bad_arguments():
  with pytest.raises(sj.InputError, match="num_layers"):
    train.train_draft(tiny_model(), num_layers=0)
  with pytest.raises(sj.InputError, match="vocab_size"):
    train.train_draft(tiny_model(), vocab_size=1000, out_dir="/nonexistent/never")


def test_vocab_subset_most_frequent_then_lowest_ids():
  labels = np.array([[5, 5, 5, 9, 9, -1], [7, -1, -1, -1, -1, -1]], np.int32)
  ids = train.vocab_subset({"labels": labels}, vocab_size=20, size=5)
  assert ids.tolist() == [0, 1, 5, 7, 9]


def test_teacher_data_soft_labels_and_resume(tmp_path):
  """Teacher forcing labels every position with the target's argmax and top-k log-probs, and a
  rerun continues from the partial file instead of relabelling."""
  import jax.numpy as jnp

  from specjax import cache as kv

  target = tiny_model(seed=0)
  rng = np.random.default_rng(0)
  texts = [list(rng.integers(0, 61, n)) for n in (50, 70, 90)]
  part = str(tmp_path / "teacher.partial.npz")
  kw = dict(seq_len=16, batch_size=2, top_k=4, partial=part, max_minutes=5)
  logs = []
  d = train.teacher_data(target, texts, log=logs.append, **kw)
  assert d["tokens"].shape == (12, 16) and d["topk_ids"].shape == (12, 16, 4)
  # Labels are the target's own next-token argmax over each window.
  cache = target.init_cache(12, 16)
  logits, _, _ = target.apply(target.params, jnp.asarray(d["tokens"]),
                              np.broadcast_to(np.arange(16), (12, 16)), cache,
                              kv.causal_mask(cache.lengths, 16, 16))
  logp = np.asarray(jax.nn.log_softmax(logits, -1))
  assert np.array_equal(d["labels"], logp.argmax(-1))
  assert np.array_equal(d["topk_ids"][..., 0], d["labels"])
  np.testing.assert_allclose(d["topk_logp"].astype(np.float32),
                             np.take_along_axis(logp, d["topk_ids"], -1), rtol=2e-3, atol=2e-2)
  assert np.all(np.diff(d["topk_logp"].astype(np.float32), axis=-1) <= 0)
  logs2 = []
  d2 = train.teacher_data(target, texts, log=logs2.append, **kw)
  assert any("resuming after 12 labelled windows" in l for l in logs2), logs2
  assert not any("windows (" in l for l in logs2)  # nothing relabelled
  assert all(np.array_equal(d[k], d2[k]) for k in d)


def test_soft_loss_with_one_hot_labels_is_the_hard_loss():
  target = tiny_model(seed=0, num_layers=3)
  vocab = np.arange(0, 61, 2).astype(np.int32)
  draft = train.draft_from_target(target, 1, vocab)
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, 61, (2, 12)).astype(np.int32)
  labels = rng.integers(-1, 61, (2, 12)).astype(np.int32)
  own = train.own_params(draft)
  hard, aux = train.draft_loss(draft, own, vocab, tokens, labels)
  soft, aux2 = train.draft_loss(draft, own, vocab, tokens, labels, labels[..., None],
                                np.zeros((2, 12, 1), np.float16))
  np.testing.assert_allclose(float(hard), float(soft), rtol=1e-5)
  assert float(aux["coverage"]) == float(aux2["coverage"]) < 1  # odd ids are outside the subset
  # A real soft target (two tokens) pulls the loss away from the one-hot one.
  two = np.stack([labels, (labels + 2) % 61], -1)
  lp = np.log(np.array([0.6, 0.4], np.float16))
  mixed, _ = train.draft_loss(draft, own, vocab, tokens, labels, two, np.broadcast_to(lp, two.shape))
  assert abs(float(mixed) - float(hard)) > 1e-3
