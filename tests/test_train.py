"""train.py on a tiny model: a few steps, interruption + resume from the orbax checkpoint, export."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

import specjax as sj
from specjax import registry
from specjax.training import draft as train
from specjax.training import trainer

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


# ----------------------------------------------------------------------------- trainer.py


class _Stop(Exception):
  pass


def _regression(seed=0, n=64):
  """A small noisy linear regression: params, loss_fn (uses its rng), batches(step), held-out."""
  import jax.numpy as jnp

  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n + 16, 5)).astype(np.float32)
  y = (x @ rng.normal(size=(5, 3)) + 0.1 * rng.normal(size=(n + 16, 3))).astype(np.float32)
  params = {"w": np.zeros((5, 3), np.float32), "b": np.zeros((3,), np.float32)}

  def loss_fn(p, batch, key):
    xb, yb = batch
    pred = (xb + 0.01 * jax.random.normal(key, xb.shape)) @ p["w"] + p["b"]
    return jnp.mean((pred - yb) ** 2), {"close": jnp.mean(jnp.abs(pred - yb) < 0.3)}

  def batches(step):
    rows = trainer.batch_rows(n, 8, seed, step)
    return x[rows], y[rows]

  return params, loss_fn, batches, [(x[n:], y[n:])]


def _cfg(out, **kw):
  base = dict(out_dir=str(out), steps=12, lr=0.3, warmup=3, ckpt_every=4, eval_every=5,
              log_every=1, progress=False)
  return trainer.TrainConfig(**{**base, **kw})


def test_trainer_resumes_after_a_kill_to_the_same_parameters(tmp_path):
  import shutil

  params, loss_fn, batches, held = _regression()
  quiet = lambda *a: None
  ref = trainer.train(params, loss_fn, batches, _cfg(tmp_path / "ref"), held_out=held, log=quiet)
  assert ref.step == 12 and ref.resumed_from is None
  assert ref.held_out["loss"] < 0.5 * float(np.mean(held[0][1] ** 2))  # it learned something

  def stop_at(k):
    def cb(step, p, m):
      if step == k:
        raise _Stop
    return cb

  # Killed between checkpoints: the interrupted call saves step 6 on its way out; a hard kill
  # would not have, so drop that checkpoint and resume from the periodic one at step 4.
  run = tmp_path / "killed"
  with pytest.raises(_Stop):
    trainer.train(params, loss_fn, batches, _cfg(run), held_out=held, log=quiet, callback=stop_at(6))
  assert sorted(int(d) for d in os.listdir(run / "ckpt") if d.isdigit()) == [4, 6]
  shutil.rmtree(run / "ckpt" / "6")
  assert max(r["step"] for r in trainer.read_log(str(run))) == 6
  logs = []
  res = trainer.train(params, loss_fn, batches, _cfg(run), held_out=held, log=logs.append)
  assert res.resumed_from == 4 and res.step == 12
  assert any("resumed from checkpoint at step 4" in l for l in logs), logs
  for k in params:
    assert np.array_equal(np.asarray(res.params[k]), np.asarray(ref.params[k])), k
  assert res.held_out == ref.held_out
  # The log holds each step once (the lines after the checkpoint were dropped and redone).
  train_steps = [r["step"] for r in trainer.read_log(str(run)) if r["split"] == "train"]
  assert train_steps == list(range(1, 13))
  assert [r["step"] for r in trainer.read_log(str(run)) if r["split"] == "heldout"] == [5, 10, 12]
  assert (run / "train.png").stat().st_size > 1000 and (run / "config.json").is_file()

  # Interrupted (Ctrl-C style) at step 7: resumes from the checkpoint written on the way out.
  run2 = tmp_path / "interrupted"
  with pytest.raises(_Stop):
    trainer.train(params, loss_fn, batches, _cfg(run2), held_out=held, log=quiet, callback=stop_at(7))
  res2 = trainer.train(params, loss_fn, batches, _cfg(run2), held_out=held, log=quiet)
  assert res2.resumed_from == 7
  for k in params:
    assert np.array_equal(np.asarray(res2.params[k]), np.asarray(ref.params[k])), k
  # A finished run called again does nothing more and returns the same parameters.
  res3 = trainer.train(params, loss_fn, batches, _cfg(run2), held_out=held, log=quiet)
  assert res3.resumed_from == 12 and np.array_equal(res3.params["w"], ref.params["w"])
  # The caller's params were not touched.
  assert not np.any(params["w"])


def test_trainer_bad_arguments(tmp_path):
  params, loss_fn, batches, held = _regression()
  for kw, match in ((dict(steps=0), "steps=0"), (dict(steps=2.5), "steps=2.5"),
                    (dict(lr=0.0), "lr=0.0"), (dict(lr=-1e-3), "lr=-0.001"),
                    (dict(lr=float("nan")), "lr=nan"), (dict(warmup=-1), "warmup=-1"),
                    (dict(weight_decay=-0.1), "weight_decay"), (dict(grad_clip=-1.0), "grad_clip"),
                    (dict(ckpt_every=0), "ckpt_every=0"), (dict(eval_every=0), "eval_every=0"),
                    (dict(final_lr=2.0), "final_lr=2.0")):
    with pytest.raises(sj.InputError, match=match):
      trainer.train(params, loss_fn, batches, _cfg(tmp_path / "bad", **kw))
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  with pytest.raises(sj.InputError, match="not a writable directory"):
    trainer.train(params, loss_fn, batches, _cfg(blocker / "run"))
  with pytest.raises(sj.InputError, match="batches"):
    trainer.train(params, loss_fn, [held[0]], _cfg(tmp_path / "r"))
  with pytest.raises(sj.InputError, match="floating-point"):
    trainer.train({"w": np.zeros(3, np.int32)}, loss_fn, batches, _cfg(tmp_path / "r"))
  # Resuming a run under another seed would silently change its data order: refused.
  trainer.train(params, loss_fn, batches, _cfg(tmp_path / "s", steps=2), log=lambda *a: None)
  with pytest.raises(sj.InputError, match="seed=0, not seed=1"):
    trainer.train(params, loss_fn, batches, _cfg(tmp_path / "s", steps=4, seed=1))


def test_batch_rows_is_a_pure_epoch_order():
  n, b = 10, 4
  flat = np.concatenate([trainer.batch_rows(n, b, 3, s) for s in range(5)])  # 2 epochs
  assert sorted(flat[:10].tolist()) == list(range(10)) == sorted(flat[10:20].tolist())
  assert np.array_equal(trainer.batch_rows(n, b, 3, 3), flat[12:16])  # no state: same answer
  assert not np.array_equal(trainer.batch_rows(n, b, 4, 0), trainer.batch_rows(n, b, 3, 0))


# ----------------------------------------------------------------------------- registry


def test_registry_needs_no_training_code():
  """weights.py loads shipped drafters through specjax.registry; importing the package (and
  building a drafter) never imports specjax.training."""
  import subprocess
  import sys

  code = ("import sys, specjax, specjax.registry as r; "
          "assert r.DRAFTERS['smollm2-135m-draft'].kind == 'draft'; "
          "import os; assert os.path.isfile(r.DRAFTERS['smollm2-135m-draft'].path); "
          "assert not [m for m in sys.modules if m.startswith('specjax.train')], sys.modules")
  env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  subprocess.run([sys.executable, "-c", code], check=True, env=env)
  with pytest.raises(sj.ModelNotFoundError, match="unknown drafter 'nope'"):
    registry.get("nope")
  header = registry.read_draft_header(registry.get("smollm2-135m-draft").path)
  assert header["target"] == "smollm2-135m" and header["format"] == 1
