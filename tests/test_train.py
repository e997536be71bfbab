"""train.py on a tiny model: a few steps, interruption + resume from the orbax checkpoint, export."""

from __future__ import annotations

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
