"""Medusa-2 (specjax/training/medusa2.py, lora.py): LoRA adapters merged exactly, the joint
trainer (heads warmed up alone, then the adapters at a lower rate; resumable to the same
parameters), the asset (heads + adapters) and decoding with it, exact for the adapted model."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax import lora
from specjax.errors import InputError
from specjax.training import heads as heads_train
from specjax.training import medusa2, trainer

from tests.helpers.models import assert_greedy, random_adapters, random_prompts, tiny_model
from tests.helpers.training import _learnable_target, _self_corpus


@pytest.fixture(scope="module")
def self_distillation():
  target = _learnable_target()
  return target, _self_corpus(target, n=32)


KW = dict(num_heads=2, vocab_size=0, rank=4, alpha=8.0, kl_weight=1.0, backbone_lr=0.05,
          warmup_heads=4, steps=12, batch_size=8, seq_len=48, lr=3e-3, warmup=2, held_out=0.2,
          ckpt_every=4, eval_every=6, progress=False, log=lambda *_: None)


def test_lora_merge_is_w_plus_scaled_ab():
  m = tiny_model()
  ad = lora.init(m, rank=3, seed=1)
  assert set(ad) == {f"layers.{i}.{b}" for i in range(2)
                     for b in ("attn.wqkv", "attn.wo", "mlp.w_in", "mlp.w_out")}
  same = lora.merge(m.params, ad, 2.0)  # B = 0: the original model, bit for bit
  for a, b in zip(jax.tree_util.tree_leaves(same), jax.tree_util.tree_leaves(m.params)):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  key = jax.random.PRNGKey(0)
  ad = {n: dict(v, b=jax.random.normal(jax.random.fold_in(key, i), v["b"].shape))
        for i, (n, v) in enumerate(sorted(ad.items()))}
  merged = lora.merge(m.params, ad, 0.5)
  wo = np.asarray(m.params["layers"][1]["attn"]["wo"][...])  # [H,D,E]: input H*D, output E
  want = wo + 0.5 * (np.asarray(ad["layers.1.attn.wo"]["a"]) @ np.asarray(
      ad["layers.1.attn.wo"]["b"])).reshape(wo.shape)
  np.testing.assert_allclose(np.asarray(merged["layers"][1]["attn"]["wo"][...]), want, rtol=1e-6,
                             atol=1e-6)
  norm = m.params["layers"][0]["attn_norm"]["scale"][...]
  assert np.array_equal(np.asarray(merged["layers"][0]["attn_norm"]["scale"][...]),
                        np.asarray(norm))
  with pytest.raises(InputError, match="rank=99"):
    lora.init(m, rank=99)
  with pytest.raises(InputError, match="lora sites"):
    lora.init(m, rank=2, sites="wqkv,lm_head")


class _Stop(Exception):
  pass


def test_medusa2_trains_resumes_exports_and_decodes_exactly(tmp_path, self_distillation,
                                                            monkeypatch):
  target, corpus = self_distillation
  seen = {}

  def watch(step, params, metrics):  # the adapters during the heads' warm-up
    if step == KW["warmup_heads"]:
      seen["warm"] = jax.tree_util.tree_map(np.asarray, params["lora"])

  orig = trainer.train
  trainer.train = lambda *a, **k: orig(*a, **dict(k, callback=watch))
  try:
    heads, adapters = heads_train.train_medusa2(target, corpus, out_dir=str(tmp_path / "ref"),
                                                export=str(tmp_path / "m2.npz"), **KW)
  finally:
    trainer.train = orig
  held = [r for r in trainer.read_log(str(tmp_path / "ref")) if r["split"] == "heldout"]
  assert held[0]["kl"] == 0.0  # the adapted model starts out as the original
  assert held[-1]["heads_loss"] < 0.8 * held[0]["heads_loss"], held
  # The adapters learn nothing during the heads' warm-up (B stays zero), then they do.
  assert not any(np.any(v["b"]) for v in seen["warm"].values())
  assert all(np.any(np.asarray(v["b"])) for v in adapters.values())
  # The KL term keeps the adapted model closer to the original than training without it.
  heads_train.train_medusa2(target, corpus, out_dir=str(tmp_path / "nokl"),
                            **dict(KW, kl_weight=0.0))
  free = [r for r in trainer.read_log(str(tmp_path / "nokl")) if r["split"] == "heldout"]
  assert 0.0 < held[-1]["kl"] < free[-1]["kl"], (held[-1], free[-1])

  # Killed at step 6 and resumed from the step-4 checkpoint: the same parameters.
  import shutil

  def stop(step, params, metrics):
    if step == 6:
      raise _Stop

  trainer.train = lambda *a, **k: orig(*a, **dict(k, callback=stop))
  try:
    with pytest.raises(_Stop):
      heads_train.train_medusa2(target, corpus, out_dir=str(tmp_path / "killed"), **KW)
  finally:
    trainer.train = orig
  shutil.rmtree(tmp_path / "killed" / "ckpt" / "6")
  again, again_ad = heads_train.train_medusa2(target, corpus, out_dir=str(tmp_path / "killed"),
                                              **KW)
  for n in adapters:
    for k in ("a", "b"):
      assert np.array_equal(np.asarray(again_ad[n][k]), np.asarray(adapters[n][k])), (n, k)
  for k in heads.params:
    assert np.array_equal(np.asarray(again.params[k]), np.asarray(heads.params[k])), k

  # The asset: the adapted model and its heads; Medusa on it is exact for the ADAPTED model.
  model, back = medusa2.load_medusa2(str(tmp_path / "m2.npz"), target)
  assert back.config.num_heads == 2 and back.meta["medusa2"] is True
  runs = []
  for b in (1, 4):
    prompts = random_prompts(b, 61, seed=b)
    out = sj.generate(model, prompts, sj.Medusa(back, tree=[(0,), (1,), (0, 0)],
                                                acceptance="greedy"),
                      max_new_tokens=12, stop_at_eos=False)
    runs += list(zip(prompts, out.tokens))
  assert_greedy(model, runs, 12)
  tok, mask = corpus.windows(48, "heldout", 0.2, 0)
  close = medusa2.closeness(target, model, tok, heads_train.response_valid(mask),
                            greedy_tokens=16, prompts=random_prompts(4, 61, seed=11))
  assert close["kl"] == pytest.approx(held[-1]["kl"], rel=1e-3)  # the trainer's own measure
  assert 0.0 <= close["greedy_identical"] <= 1.0
  assert close["positions"] == int(heads_train.response_valid(mask).sum())

  # Shipped under a name: load_model gives the adapted model, load_heads its heads, and "medusa"
  # on the adapted model finds them; nothing of specjax.training is needed to load it.
  from specjax import heads as heads_mod, methods, shipped
  entry = shipped.Drafter("tiny-medusa2", "medusa2", target.name, str(tmp_path / "m2.npz"))
  monkeypatch.setitem(shipped.DRAFTERS, entry.name, entry)
  monkeypatch.setitem(heads_mod.NAMED_HEADS, entry.name, (target.name, entry.asset))
  named = sj.load_model("tiny-medusa2", target=target)
  assert named.name == shipped.adapted_name(entry.target)
  for a, b in zip(jax.tree_util.tree_leaves(named.params), jax.tree_util.tree_leaves(model.params)):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  named_heads = sj.load_heads("tiny-medusa2", named)
  for k in back.params:
    assert np.array_equal(np.asarray(named_heads.params[k]), np.asarray(back.params[k])), k
  assert methods.shipped("medusa", named) == "tiny-medusa2"
  assert methods.shipped("medusa", target) != "tiny-medusa2"  # the original model has no heads
  other = tiny_model()
  with pytest.raises(InputError, match="the adapters are for"):
    sj.load_model("tiny-medusa2", target=sj.Model(other.config, other.graphdef, other.params,
                                                  name="other"))
  with pytest.raises(InputError, match="mesh="):
    sj.load_model("tiny-medusa2", target=target, mesh="data=1")


def test_medusa2_bad_input_before_anything_loads(tmp_path, self_distillation):
  target, corpus = self_distillation
  out = tmp_path / "never"
  for bad, match in ((dict(kl_weight=-1.0), "kl_weight=-1.0"),
                     (dict(rank=0), "rank=0"), (dict(warmup_heads=12), "warmup_heads=12"),
                     (dict(sites="wqkv,embed"), "lora sites"), (dict(backbone_lr=-0.1),
                                                                 "backbone_lr")):
    with pytest.raises(InputError, match=match):
      heads_train.train_medusa2(target, corpus, out_dir=str(out), **dict(KW, **bad))
  with pytest.raises(InputError, match="rank=1000"):  # above the width, once the target is known
    heads_train.train_medusa2(target, corpus, out_dir=str(out), **dict(KW, rank=1000))
  assert not os.path.exists(out)
  with pytest.raises(sj.WeightsError, match="not a Medusa-2 asset"):
    from specjax.heads import save_heads
    save_heads(sj.init_heads(target, "medusa", num_heads=2), str(tmp_path / "m1.npz"))
    medusa2.load_medusa2(str(tmp_path / "m1.npz"), target)


def test_medusa2_starts_from_trained_medusa1_heads(tmp_path, self_distillation):
  """init: the joint training starts from given Medusa-1 heads (their count, blocks and
  vocabulary subset), not fresh ones; a wrong kind or head count is named before training."""
  target, corpus = self_distillation
  vocab = np.arange(0, target.config.vocab_size, 2)
  m1 = sj.init_heads(target, "medusa", num_heads=3, num_layers=2, seed=5, scale=0.5, vocab=vocab)
  from specjax.heads import save_heads
  path = save_heads(m1, str(tmp_path / "m1.npz"))
  start = {}
  orig = trainer.train

  def capture(params, *a, **k):
    start.update(jax.tree_util.tree_map(np.asarray, params["heads"]))
    return orig(params, *a, **k)

  trainer.train = capture
  try:
    heads, _ = heads_train.train_medusa2(target, corpus, out_dir=str(tmp_path / "m2"), init=path,
                                         **dict(KW, num_heads=None, warmup_heads=0, steps=2))
  finally:
    trainer.train = orig
  saved = sj.load_heads(path)  # float16 on disk: the heads start from exactly what was saved
  assert set(start) == set(saved.params)
  for k in start:
    assert np.array_equal(start[k], np.asarray(saved.params[k], np.float32)), k
  assert heads.config.num_heads == 3 and heads.config.num_layers == 2
  assert np.array_equal(np.asarray(heads.vocab), vocab)
  with pytest.raises(InputError, match="num_heads asks 2"):
    heads_train.train_medusa2(target, corpus, out_dir=str(tmp_path / "bad"), init=path,
                              **dict(KW, num_heads=2))
  eagle = save_heads(sj.init_heads(target, "eagle"), str(tmp_path / "eagle.npz"))
  with pytest.raises(InputError, match="holds eagle heads, not medusa"):
    heads_train.train_medusa2(target, corpus, out_dir=str(tmp_path / "bad"), init=eagle, **KW)
  assert not os.path.exists(tmp_path / "bad")


def test_medusa2_sampling_follows_the_adapted_model():
  """At temperature > 0, Medusa's heads over the adapted model (the target with LoRA adapters
  merged in) draw the first two tokens from the ADAPTED model's distribution (the lossless
  suite's total-variation check), and that distribution is measurably not the original's."""
  from tests.helpers.lossless import (SAMPLING_SETTINGS, _MEDUSA_TREE, exact_two_token_dist,
                                      small_target, tv_check)

  target = small_target()
  model = lora.merged_model(target, random_adapters(target, rank=2, seed=1), 1.0, name="adapted")
  heads = sj.init_heads(model, "medusa", num_heads=3, seed=4, scale=3.0)
  settings = SAMPLING_SETTINGS[3]  # T = 0.7 with top-p 0.8: the residual rule's hardest case
  tv, expected = tv_check(model, sj.Medusa(heads, tree=_MEDUSA_TREE), settings)
  assert tv < 2 * expected, f"Medusa-2: TV {tv:.4f} vs expected sampling error {expected:.4f}"
  prompt = [3, 1, 4, 1, 5]
  apart = 0.5 * np.abs(exact_two_token_dist(model, prompt, settings) -
                       exact_two_token_dist(target, prompt, settings)).sum()
  assert apart > 10 * expected, apart  # the check above would catch the original's draws
