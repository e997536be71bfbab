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
from specjax.errors import InputError
from specjax.training import heads as heads_train
from specjax.training import lora, medusa2, trainer

from conftest import assert_greedy, random_prompts, tiny_model
from test_train import _learnable_target, _self_corpus


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


def test_medusa2_trains_resumes_exports_and_decodes_exactly(tmp_path, self_distillation):
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
