"""specjax.training on tiny random models: the trainer (exact resume after a kill, bad config),
the draft distillation on a corpus of the target's own responses, the shipped drafters."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

import specjax as sj
from specjax import shipped
from specjax.errors import InputError
from specjax.training import draft as train
from specjax.training import trainer

from tests.helpers.models import random_prompts, tiny_model
from tests.helpers.tinyhf import FakeCorpus
from tests.helpers.training import _learnable_target, _self_corpus


@pytest.fixture(scope="module")
def self_distillation():
  """(target, its corpus), shared: generating it is most of these tests' time."""
  target = _learnable_target()
  return target, _self_corpus(target)


_DRAFT_KW = dict(num_layers=1, vocab_size=40, batch_size=8, seq_len=48, lr=3e-3, warmup=5,
                 held_out=0.2, ckpt_every=20, eval_every=20, progress=False)


def test_draft_distillation_improves_held_out_top1_and_exports(tmp_path, self_distillation):
  target, c = self_distillation
  logs = []
  d = train.train_draft(target, c, out_dir=str(tmp_path / "run"), steps=60,
                        export=str(tmp_path / "d.npz"), log=logs.append, **_DRAFT_KW)
  held = [r for r in trainer.read_log(str(tmp_path / "run")) if r["split"] == "heldout"]
  assert [r["step"] for r in held] == [0, 20, 40, 60]
  # The untrained draft (the target's first layer) rarely agrees; the trained one mostly does.
  assert held[0]["top1"] < 0.1 and held[-1]["top1"] > 0.7, held
  assert d.held_out_top1 == held[-1]["top1"] and d.train_step == 60
  # Greedy corpus responses are the target's argmax (windows of 48 hold whole sequences here, so
  # the teacher sees the same context): both held-out agreements coincide.
  assert held[-1]["top1_corpus"] == pytest.approx(held[-1]["top1"])
  # The subset holds the most frequent next tokens of the training windows.
  tok, mask = c.windows(48, "train", 0.2, 0)
  lab = train.next_token_labels(tok, mask)
  counts = np.bincount(lab[lab >= 0], minlength=61)
  assert set(np.argsort(-counts, kind="stable")[:20]) <= set(d.vocab_subset.tolist())

  # The asset holds only the draft's own tensors; reloading rebuilds the same draft.
  back = sj.load_model(str(tmp_path / "d.npz"), target=target)  # sj.load_model reads assets too
  assert back.shared == (("embed",), ("lm_head",))
  assert np.array_equal(back.vocab_subset, d.vocab_subset) and len(back.vocab_subset) == 40
  assert back.asset_header["held_out_top1"] == d.held_out_top1
  assert back.asset_header["steps"] == 60 and back.asset_header["corpus"]["vocab_size"] == 61
  for k, v in shipped.own_params(d).items():
    np.testing.assert_allclose(np.asarray(shipped.own_params(back)[k]), np.asarray(v),
                               rtol=1e-3, atol=1e-4)  # stored as float16
  # The trained draft drives DraftModel losslessly.
  prompts = random_prompts(3, 61, seed=5)
  ref = sj.generate(target, prompts, max_new_tokens=16).tokens
  out = sj.generate(target, prompts, sj.DraftModel(back, gamma=3), max_new_tokens=16)
  assert out.tokens == ref
  assert out.stats["mean_accepted"] > 1.5  # and it drafts well enough to be accepted

  # Calling again resumes from the final checkpoint: nothing more to train, same draft.
  logs2 = []
  d2 = train.train_draft(target, c, out_dir=str(tmp_path / "run"), steps=60, log=logs2.append,
                         **_DRAFT_KW)
  assert any("resumed from checkpoint at step 60" in l for l in logs2), logs2
  for k, v in shipped.own_params(d).items():
    assert np.array_equal(np.asarray(shipped.own_params(d2)[k]), np.asarray(v)), k


def test_train_draft_init_from_an_exported_draft(tmp_path, self_distillation):
  """init= starts from a draft asset (its layers, its subset): held-out top-1 is already high at
  step 0, where a draft from the target's first layer starts under 0.1."""
  target, c = self_distillation
  kw = dict(_DRAFT_KW, vocab_size=40)
  first = train.train_draft(target, c, out_dir=str(tmp_path / "a"), steps=40,
                            export=str(tmp_path / "a.npz"), log=lambda *_: None, **kw)
  tuned = train.train_draft(target, c, out_dir=str(tmp_path / "b"), steps=5, init=str(tmp_path / "a.npz"),
                            log=lambda *_: None, **dict(kw, vocab_size=2))  # vocab_size ignored with init
  held = [r for r in trainer.read_log(str(tmp_path / "b")) if r["split"] == "heldout"]
  assert held[0]["step"] == 0 and held[0]["top1"] == pytest.approx(first.held_out_top1, abs=0.02)
  assert np.array_equal(tuned.vocab_subset, first.vocab_subset)


def test_train_draft_grows_an_exported_draft(tmp_path, self_distillation):
  """init= with more num_layers grows the asset: the new layers start as identities, so the grown
  draft's logits equal the asset's (and its step-0 held-out top-1 the asset's), then they train;
  asking for fewer layers than the asset has raises before anything runs."""
  from specjax import cache as kv

  target, c = self_distillation
  kw = dict(_DRAFT_KW, vocab_size=40, num_layers=1)
  first = train.train_draft(target, c, out_dir=str(tmp_path / "a"), steps=40,
                            export=str(tmp_path / "a.npz"), log=lambda *_: None, **kw)
  base = shipped.load_draft_asset(str(tmp_path / "a.npz"), target)
  own = train.grown_params(target, {k: np.asarray(v) for k, v in shipped.own_params(base).items()},
                           1, 2)
  grown = train.draft_from_target(target, 2, base.vocab_subset, own=own)
  assert not np.any(own["layers_1_attn_wo"]) and not np.any(own["layers_1_mlp_w_out"])
  assert np.any(own["layers_1_attn_wqkv"])  # the target's layer 1, so the new layer can learn
  tokens = np.asarray(c.sequence(0)[0][:12], np.int32)[None]
  pos = np.arange(12, dtype=np.int32)[None]

  def logits(m):
    cache = m.init_cache(1, 12)
    return np.asarray(m.apply(m.params, tokens, pos, cache, kv.causal_mask(cache.lengths, 12, 12))[0])

  np.testing.assert_allclose(logits(grown), logits(base), atol=1e-5)
  assert not np.allclose(logits(grown), logits(train.draft_from_target(target, 2)), atol=1e-3)
  logs = []
  d = train.train_draft(target, c, out_dir=str(tmp_path / "b"), steps=10, init=str(tmp_path / "a.npz"),
                        export=str(tmp_path / "b.npz"), log=logs.append, **dict(kw, num_layers=2))
  assert d.config.num_layers == 2 and any("grown to 2" in str(m) for m in logs)
  held = [r for r in trainer.read_log(str(tmp_path / "b")) if r["split"] == "heldout"]
  assert held[0]["step"] == 0 and held[0]["top1"] == pytest.approx(first.held_out_top1, abs=1e-6)
  assert np.any(np.asarray(shipped.own_params(d)["layers_1_attn_wo"]))  # the new layer trained
  with pytest.raises(InputError, match="fewer than the 2 layers"):
    train.train_draft(target, c, out_dir=str(tmp_path / "c"), steps=5, log=lambda *_: None,
                      init=str(tmp_path / "b.npz"), **kw)


def test_draft_distillation_with_soft_labels(tmp_path, self_distillation):
  """Soft labels (the target's top-k, one target forward per step) train as well."""
  target, c = self_distillation
  d = train.train_draft(target, c, out_dir=str(tmp_path / "soft"), steps=40,
                        soft_top_k=4, log=lambda *a: None, **_DRAFT_KW)
  held = [r for r in trainer.read_log(str(tmp_path / "soft")) if r["split"] == "heldout"]
  assert held[0]["top1"] < 0.1 and held[-1]["top1"] > 0.5, held
  train_rows = [r for r in trainer.read_log(str(tmp_path / "soft")) if r["split"] == "train"]
  assert train_rows[-1]["loss"] < train_rows[0]["loss"]
  assert d.train_step == 40


def test_held_out_windows_never_overlap_training_windows():
  rng = np.random.default_rng(0)  # random text: no two windows of different sequences coincide
  seqs = [rng.integers(0, 61, int(rng.integers(10, 90))) for _ in range(60)]
  c = FakeCorpus(seqs, [int(rng.integers(1, 9)) for _ in seqs], 61)
  for seq_len in (8, 16, 64):
    tr, trm = c.windows(seq_len, "train", 0.25, 3)
    ho, hom = c.windows(seq_len, "heldout", 0.25, 3)
    assert len(tr) and len(ho)
    assert not {r.tobytes() for r in tr} & {r.tobytes() for r in ho}
    # Every response token is the label of exactly one window position of one split (a window's
    # last position has none: the next window, one token back, covers that transition).
    n_labels = sum(len(c.sequence(i)[0]) - c.sequence(i)[1] for i in range(len(c)))
    labelled = sum(int(np.sum(train.next_token_labels(t, m) >= 0)) for t, m in ((tr, trm), (ho, hom)))
    assert labelled == n_labels
  # The split depends on the seed, and is the same for any seq_len.
  assert not np.array_equal(c.windows(16, "heldout", 0.25, 3)[0], c.windows(16, "heldout", 0.25, 4)[0])


def test_train_a_parallel_draft_that_fills_masks(tmp_path, self_distillation):
  """`train_draft(parallel=...)` (PARD): the masks learn the offsets after the next token, the
  asset records its block, mask token and per-offset agreement, and ParallelDraft drafts with
  it losslessly, accepting more than one token a step."""
  target, c = self_distillation
  v = target.config.vocab_size
  par = {"block_size": 4, "mask_token": v - 1, "anchors": 8}
  d = train.train_draft(target, c, out_dir=str(tmp_path / "run"), steps=80,
                        export=str(tmp_path / "p.npz"), parallel=par, log=lambda *a: None,
                        **{**_DRAFT_KW, "lr": 1e-2})
  held = [r for r in trainer.read_log(str(tmp_path / "run")) if r["split"] == "heldout"]
  first, last = held[0], held[-1]
  assert last["top1_0"] > 0.7 and last["top1_1"] > first["top1_1"] + 0.3, (first, last)
  back = sj.load_model(str(tmp_path / "p.npz"), target=target)
  assert back.asset_header["parallel"] == {"block_size": 4, "mask_token_id": v - 1, "anchors": 8}
  assert back.asset_header["held_out"]["top1_1"] == last["top1_1"]
  method = sj.ParallelDraft(back)  # mask token and the block's bound from the asset
  assert method.mask_token_id == v - 1 and method.prepare(target).gamma <= 4
  prompts = random_prompts(3, v, seed=5)
  ref = sj.generate(target, prompts, max_new_tokens=16).tokens
  out = sj.generate(target, prompts, sj.ParallelDraft(back, gamma=3), max_new_tokens=16)
  assert out.tokens == ref and out.stats["mean_accepted"] > 1.5, out.stats
  assert d.name.endswith("-pard")
  with pytest.raises(sj.InputError, match="needs mask_token"):
    train.train_draft(target, c, out_dir=str(tmp_path / "x"), parallel={"block_size": 4})
  with pytest.raises(sj.InputError, match="soft_top_k"):
    train.train_draft(target, c, out_dir=str(tmp_path / "x"), soft_top_k=2, parallel=par)
  with pytest.raises(sj.InputError, match="mask_token=61"):
    train.train_draft(target, c, out_dir=str(tmp_path / "x"), parallel={**par, "mask_token": v},
                      vocab_size=40)
  assert not (tmp_path / "x").exists()


def test_train_draft_bad_arguments(tmp_path, self_distillation):
  target, c = self_distillation
  ok = dict(out_dir=str(tmp_path / "r"), vocab_size=40, log=lambda *a: None, progress=False)
  for kw, match in ((dict(num_layers=0), "num_layers=0"), (dict(num_layers=5), "num_layers=5"),
                    (dict(vocab_size=1000), "vocab_size=1000"), (dict(soft_top_k=-1), "soft_top_k"),
                    (dict(held_out=1.0), "held_out=1.0"), (dict(steps=0), "steps=0"),
                    (dict(lr=0.0), "lr=0.0"), (dict(seq_len=1), "seq_len=1")):
    with pytest.raises(sj.InputError, match=match):
      train.train_draft(target, c, **{**ok, **kw})
  with pytest.raises(sj.InputError, match="corpus=None"):
    train.train_draft(target, None, **ok)
  with pytest.raises(sj.InputError, match="vocab_size=100"):  # a corpus of another vocabulary
    train.train_draft(target, FakeCorpus(c.seqs, c.prompt_lens, 100), **ok)
  blocker = tmp_path / "file"
  blocker.write_text("x")
  with pytest.raises(sj.InputError, match="not a writable directory"):
    train.train_draft(target, c, **{**ok, "out_dir": str(blocker / "run")})
  with pytest.raises(sj.InputError, match="no training windows"):
    train.train_draft(target, FakeCorpus([[1, 2, 3]], [3], 61), **ok)  # prompts only
  assert not (tmp_path / "r" / "ckpt").exists()  # all refused before training started


def test_vocab_subset_most_frequent_then_lowest_ids():
  counts = np.bincount([5, 5, 5, 9, 9, 7], minlength=20)
  assert train.vocab_subset(counts, 5).tolist() == [0, 1, 5, 7, 9]
  assert train.vocab_subset(counts, 2).tolist() == [5, 9]


def test_teacher_features_are_the_target_forward():
  """Hidden states and logits / top-k equal one full forward, whatever the batching."""
  import jax.numpy as jnp

  from specjax import cache as kv

  target = tiny_model(seed=0)
  tokens = np.random.default_rng(0).integers(0, 61, (5, 12)).astype(np.int32)
  cache = target.init_cache(5, 12)
  logits, hidden, _ = target.apply(target.params, jnp.asarray(tokens),
                                   np.broadcast_to(np.arange(12), (5, 12)), cache,
                                   kv.causal_mask(cache.lengths, 12, 12))
  h, lg = train.teacher_features(target, tokens, batch_size=2)  # 3 batches, the last padded
  np.testing.assert_allclose(h, np.asarray(hidden), rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(lg, np.asarray(logits), rtol=1e-5, atol=1e-4)
  h2, (ids, logp) = train.teacher_features(target, tokens, top_k=3, batch_size=8)
  np.testing.assert_allclose(h2, h, rtol=1e-5, atol=1e-4)
  ref = np.asarray(jax.nn.log_softmax(logits, -1))
  assert np.array_equal(ids, np.argsort(-ref, -1, kind="stable")[..., :3])
  np.testing.assert_allclose(logp, np.take_along_axis(ref, ids, -1), rtol=1e-5, atol=1e-4)
  with pytest.raises(sj.InputError, match="ids in"):
    train.teacher_features(target, tokens + 61)
  with pytest.raises(sj.InputError, match="top_k=0"):
    train.teacher_features(target, tokens, top_k=0)


def test_top_k_by_passes_is_lax_top_k():
  """The training step's top-k (k argmax passes) gives lax.top_k's ids and log-probabilities,
  the lower index first on ties."""
  rng = np.random.default_rng(0)
  logits = rng.integers(0, 5, size=(3, 4, 50)).astype(np.float32)  # many ties
  ids, lp = train.top_k(logits, 6)
  ids2, lp2 = train.top_k(logits, 6, passes=True)
  np.testing.assert_array_equal(np.asarray(ids2), np.asarray(ids))
  np.testing.assert_allclose(np.asarray(lp2), np.asarray(lp), rtol=1e-6)


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
  assert [r["step"] for r in trainer.read_log(str(run)) if r["split"] == "heldout"] == [0, 5, 10, 12]
  assert (run / "train.png").stat().st_size > 1000 and (run / "config.json").is_file()

  # Interrupted (Ctrl-C style) at step 7: resumes from the checkpoint written on the way out.
  run2 = tmp_path / "interrupted"
  with pytest.raises(_Stop):
    trainer.train(params, loss_fn, batches, _cfg(run2), held_out=held, log=quiet, callback=stop_at(7))
  res2 = trainer.train(params, loss_fn, batches, _cfg(run2), held_out=held, log=quiet)
  assert res2.resumed_from == 7
  for k in params:
    assert np.array_equal(np.asarray(res2.params[k]), np.asarray(ref.params[k])), k

  # SIGTERM (kill PID, a scheduler's stop) at step 5: the same, and the handler is put back.
  import signal
  before = signal.getsignal(signal.SIGTERM)

  def term_at(k):
    def cb(step, p, m):
      if step == k:
        os.kill(os.getpid(), signal.SIGTERM)
    return cb

  run3 = tmp_path / "terminated"
  logs = []
  with pytest.raises(trainer.Terminated) as stopped:
    trainer.train(params, loss_fn, batches, _cfg(run3), held_out=held, log=logs.append,
                  callback=term_at(5))
  assert stopped.value.code == 128 + signal.SIGTERM
  assert signal.getsignal(signal.SIGTERM) == before
  assert any("stopped at step 5" in l for l in logs), logs
  res3 = trainer.train(params, loss_fn, batches, _cfg(run3), held_out=held, log=quiet)
  assert res3.resumed_from == 5
  for k in params:
    assert np.array_equal(np.asarray(res3.params[k]), np.asarray(ref.params[k])), k
  # SIGINT where it is ignored (a shell's background job: `cmd &` then kill -INT): it stops too.
  old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    def int_at(step, p, m):
      if step == 3:
        os.kill(os.getpid(), signal.SIGINT)
    with pytest.raises(trainer.Terminated) as stopped:
      trainer.train(params, loss_fn, batches, _cfg(tmp_path / "bg"), held_out=held, log=quiet,
                    callback=int_at)
    assert stopped.value.code == 128 + signal.SIGINT
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    assert sorted(int(d) for d in os.listdir(tmp_path / "bg" / "ckpt") if d.isdigit()) == [3]
  finally:
    signal.signal(signal.SIGINT, old_int)
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


# ----------------------------------------------------------------------------- shipped drafters


def test_shipped_drafters_need_no_training_code():
  """weights.py loads shipped drafters through specjax.shipped; importing the package (and
  building a drafter) never imports specjax.training."""
  import subprocess
  import sys

  code = ("import sys, specjax, specjax.shipped as r; "
          "assert r.DRAFTERS['smollm2-135m-draft'].kind == 'draft'; "
          "import os; assert os.path.isfile(r.DRAFTERS['smollm2-135m-draft'].path); "
          "assert not [m for m in sys.modules if m.startswith('specjax.train')], sys.modules")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=root)
  subprocess.run([sys.executable, "-c", code], check=True, env=env)
  with pytest.raises(sj.ModelNotFoundError, match="unknown drafter 'nope'"):
    shipped.get("nope")
  header = shipped.read_draft_header(shipped.get("smollm2-135m-draft").path)
  assert header["target"] == "smollm2-135m" and header["format"] == 1


def test_train_medusa_on_a_corpus_exports_heads_that_are_accepted(tmp_path, self_distillation):
  target, c = self_distillation
  # The CLI reaches the same trainer for every kind.
  from specjax import cli
  from specjax.training import heads as heads_train
  seen = {}
  orig = heads_train.train_heads
  heads_train.train_heads = lambda kind, model, corpus, **kw: seen.update(kind=kind, corpus=corpus, **kw)
  try:
    cli.main(["train", "mtp", "--corpus", "/c", "--steps", "3"])
  finally:
    heads_train.train_heads = orig
  assert seen["kind"] == "mtp" and seen["corpus"] == "/c" and seen["steps"] == 3
  kw = dict(num_heads=2, vocab_size=0, steps=40, batch_size=8, seq_len=48, lr=1e-2, warmup=5,
            held_out=0.2, ckpt_every=20, eval_every=20, progress=False, log=lambda *_: None)
  heads = heads_train.train_medusa(target, c, out_dir=str(tmp_path / "r"),
                                    export=str(tmp_path / "h.npz"), **kw)
  held = [r for r in trainer.read_log(str(tmp_path / "r")) if r["split"] == "heldout"]
  assert held[-1]["loss"] < 0.5 * held[0]["loss"], held
  assert heads.meta["steps"] == 40 and heads.meta["held_out"]["top1_0"] > 0.8
  back = sj.load_heads(str(tmp_path / "h.npz"), target)
  prompts = random_prompts(3, 61, seed=5)
  ref = sj.generate(target, prompts, max_new_tokens=16).tokens
  out = sj.generate(target, prompts, sj.Medusa(back, tree=[(0,), (1,), (0, 0)], acceptance="greedy"),
                    max_new_tokens=16)
  assert out.tokens == ref and out.stats["mean_accepted"] > 1.5
  with pytest.raises(InputError, match="num_heads=0"):
    heads_train.train_medusa(target, c, out_dir=str(tmp_path / "bad"), **dict(kw, num_heads=0))
  with pytest.raises(InputError, match="corpus=None"):
    heads_train.train_medusa(target, None, out_dir=str(tmp_path / "bad"), **kw)


@pytest.mark.parametrize("kind", ["eagle", "mtp"])
def test_train_feature_heads_on_a_corpus(tmp_path, self_distillation, kind):
  from specjax.training import heads as heads_train

  target, c = self_distillation
  kw = dict(vocab_size=0, steps=30, batch_size=8, seq_len=48, lr=3e-3, warmup=3, held_out=0.2,
            ckpt_every=15, eval_every=15, progress=False, log=lambda *_: None)
  heads = heads_train.train_heads(kind, target, c, out_dir=str(tmp_path / "r"),
                                  export=str(tmp_path / "h.npz"), **kw)
  held = [r for r in trainer.read_log(str(tmp_path / "r")) if r["split"] == "heldout"]
  assert held[-1]["loss"] < held[0]["loss"], held
  back = sj.load_heads(str(tmp_path / "h.npz"), target)
  assert back.config.kind == kind and back.config.num_heads == heads.config.num_heads
  prompts = random_prompts(2, 61, seed=5)
  ref = sj.generate(target, prompts, max_new_tokens=12).tokens
  method = (sj.Eagle(back, depth=2, top_k=2, num_nodes=4) if kind == "eagle" else sj.MTP(back))
  assert sj.generate(target, prompts, method, max_new_tokens=12).tokens == ref


def test_eagle_fine_tuned_from_init_with_unroll(tmp_path, self_distillation):
  """init starts from trained heads (the fine-tune's step-0 held-out equals the run it came
  from); unroll adds the depth-2 metrics and still gives heads that generate identically."""
  from specjax import cli
  from specjax.training import heads as heads_train

  target, c = self_distillation
  kw = dict(steps=20, batch_size=8, seq_len=48, lr=3e-3, warmup=3, held_out=0.2,
            ckpt_every=10, eval_every=10, progress=False, log=lambda *_: None)
  first = heads_train.train_heads("eagle", target, c, out_dir=str(tmp_path / "a"), vocab_size=30,
                                  export=str(tmp_path / "e.npz"), **kw)
  tuned = heads_train.train_heads("eagle", target, c, out_dir=str(tmp_path / "b"), unroll=2,
                                  init=str(tmp_path / "e.npz"), export=str(tmp_path / "t.npz"), **kw)
  held = [r for r in trainer.read_log(str(tmp_path / "b")) if r["split"] == "heldout"]
  assert held[0]["step"] == 0 and held[0]["top1"] == pytest.approx(first.meta["held_out"]["top1"])
  assert held[0]["vloss"] == pytest.approx(first.meta["held_out"]["vloss"], rel=1e-4)
  assert "top1_2" in held[-1] and held[-1]["loss"] < held[0]["loss"]
  np.testing.assert_array_equal(np.asarray(tuned.vocab), np.asarray(first.vocab))
  back = sj.load_heads(str(tmp_path / "t.npz"), target)
  assert back.meta["unroll"] == 2
  prompts = random_prompts(2, 61, seed=5)
  ref = sj.generate(target, prompts, max_new_tokens=12).tokens
  assert sj.generate(target, prompts, sj.Eagle(back, depth=3, top_k=2, num_nodes=6),
                     max_new_tokens=12).tokens == ref
  # --taps grows the exported head into a fused one: its step 0 is the head it grew from.
  fused = heads_train.train_heads("eagle", target, c, out_dir=str(tmp_path / "f"), taps="1",
                                  init=str(tmp_path / "e.npz"), export=str(tmp_path / "f.npz"),
                                  **dict(kw, steps=10, ckpt_every=5, eval_every=5))
  held = [r for r in trainer.read_log(str(tmp_path / "f")) if r["split"] == "heldout"]
  assert held[0]["top1"] == pytest.approx(first.meta["held_out"]["top1"])
  assert held[0]["vloss"] == pytest.approx(first.meta["held_out"]["vloss"], rel=1e-4)
  back = sj.load_heads(str(tmp_path / "f.npz"), target)
  assert fused.config.taps == back.config.taps == (1,) and "fuse_w" in back.params
  assert not np.allclose(np.asarray(back.params["fuse_w"][0, :32]), 0.0)  # the taps trained
  assert sj.generate(target, prompts, sj.Eagle(back, depth=3, top_k=2, num_nodes=6),
                     max_new_tokens=12).tokens == ref
  for kind, bad, match in (("medusa", dict(unroll=2), "EAGLE heads only"),
                           ("medusa", dict(taps=(1,)), "EAGLE heads only"),
                           ("eagle", dict(taps=(5,), init=str(tmp_path / "e.npz")), r"taps=\(5,\) is invalid"),
                           ("eagle", dict(taps="2,x"), "layer counts"),
                           ("eagle", dict(unroll=0), "unroll=0"),
                           ("mtp", dict(init=str(tmp_path / "e.npz")), "holds eagle heads"),
                           ("eagle,mtp", dict(init=str(tmp_path / "e.npz")), "{kind}"),
                           ("eagle", dict(init=str(tmp_path / "nope.npz")), "neither"),
                           ("eagle", dict(init=str(tmp_path / "e.npz"), num_heads=2),
                            "num_heads asks 2")):
    with pytest.raises(sj.SpecJaxError, match=match):
      heads_train.train_heads(kind, target, c, out_dir=str(tmp_path / "bad"), **dict(kw, **bad))
  seen = {}
  orig = heads_train.train_heads
  heads_train.train_heads = lambda kind, model, corpus, **kw: seen.update(kind=kind, **kw)
  try:
    cli.main(["train", "eagle", "--corpus", "/c", "--unroll", "3", "--init", "x.npz"])
    assert seen["unroll"] == 3 and seen["init"] == "x.npz" and seen["taps"] == ()
    cli.main(["train", "eagle", "--corpus", "/c", "--taps", "auto"])
    assert seen["taps"] == "auto"
  finally:
    heads_train.train_heads = orig


def test_heads_trained_together_equal_heads_trained_alone(tmp_path, self_distillation):
  """Several kinds share one target forward per batch; their params, losses, clipping and Adam
  states are independent, so each kind ends where training it alone ends."""
  from specjax import cli
  from specjax.training import heads as heads_train

  target, c = self_distillation
  kw = dict(vocab_size=30, steps=12, batch_size=8, seq_len=48, lr=3e-3, warmup=3, held_out=0.2,
            ckpt_every=6, eval_every=6, grad_clip=0.5, progress=False, log=lambda *_: None)
  joint = heads_train.train_heads("eagle,medusa,mtp", target, c, out_dir=str(tmp_path / "j"),
                                  num_heads={"medusa": 3}, export=str(tmp_path / "h-{kind}.npz"),
                                  **kw)
  assert sorted(joint) == ["eagle", "medusa", "mtp"]
  assert joint["medusa"].config.num_heads == 3 and joint["mtp"].config.num_heads == 2
  rows = trainer.read_log(str(tmp_path / "j"))
  train_row = [r for r in rows if r["split"] == "train"][-1]
  # clipping was active (norms above grad_clip), so equality below needs each kind clipped alone
  assert max(r["mtp/grad_norm"] for r in rows if r["split"] == "train") > 0.5
  assert {"eagle/grad_norm", "medusa/grad_norm", "mtp/grad_norm", "eagle/top1",
          "medusa/top1_0", "mtp/top1_1"} <= set(train_row)
  for kind in ("eagle", "medusa", "mtp"):
    alone = heads_train.train_heads(kind, target, c, out_dir=str(tmp_path / kind),
                                    num_heads=3 if kind == "medusa" else None, **kw)
    for a, b in zip(jax.tree_util.tree_leaves(alone.params),
                    jax.tree_util.tree_leaves(joint[kind].params)):
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                 rtol=1e-4, atol=1e-5)
    assert alone.meta["held_out"]["loss"] == pytest.approx(joint[kind].meta["held_out"]["loss"],
                                                            rel=1e-4)
    back = sj.load_heads(str(tmp_path / f"h-{kind}.npz"), target)
    assert back.config.kind == kind and back.meta["trained_with"] == ["eagle", "medusa", "mtp"]
  # resuming a finished joint run is a no-op that returns the same heads
  again = heads_train.train_heads("eagle,medusa,mtp", target, c, out_dir=str(tmp_path / "j"),
                                  num_heads={"medusa": 3}, **kw)
  np.testing.assert_array_equal(np.asarray(again["mtp"].params["fc_w"]),
                                np.asarray(joint["mtp"].params["fc_w"]))
  for bad, match in ((dict(kind="eagle,eagle"), "distinct"), (dict(kind="eagle,nope"), "invalid"),
                     (dict(kind="eagle,mtp", num_heads=2), "ambiguous"),
                     (dict(kind="eagle,mtp", num_heads={"medusa": 2}), "not trained here"),
                     (dict(kind="eagle,mtp", export="x.npz"), "{kind}")):
    args = dict(kw, out_dir=str(tmp_path / "bad"))
    args.update({k: v for k, v in bad.items() if k != "kind"})
    with pytest.raises(InputError, match=match):
      heads_train.train_heads(bad["kind"], target, c, **args)
  seen = {}
  orig = heads_train.train_heads
  heads_train.train_heads = lambda kind, model, corpus, **kw: seen.update(kind=kind, **kw)
  try:
    cli.main(["train", "heads", "--kinds", "medusa,mtp", "--corpus", "/c", "--num-heads",
              "medusa=5,mtp=3"])
  finally:
    heads_train.train_heads = orig
  assert seen["kind"] == "medusa,mtp" and seen["num_heads"] == {"medusa": 5, "mtp": 3}
