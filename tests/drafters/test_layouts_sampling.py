"""Published drafter layouts under sampling: heads written in FasterDecoding's Medusa-1 layout
(shared residual blocks, per-head LM heads, float16 .pt), vLLM's Medusa layout (own LM heads over
a truncated vocabulary, token_map) and SafeAILab's EAGLE-1/2 layout (a layer without input norm)
drive their methods to the target's exact distribution (the TV check of test_lossless), on
the small-vocabulary target that check needs. Their logits and greedy identity are checked in
test_layouts.py."""

from __future__ import annotations

import os

import pytest

import specjax as sj

from tests.helpers.layouts import _config, _eagle_config, _eagle_state, _medusa1_heads
from tests.helpers.lossless import SMALL_VOCAB, small_target, tv_check

torch = pytest.importorskip("torch")

SETTINGS = dict(temperature=1.0, top_k=5, top_p=1.0)


@pytest.fixture(scope="module")
def target():
  return small_target()


def test_medusa1_heads_sample_exactly(target, tmp_path):
  e = target.config.hidden_size
  ref = _medusa1_heads(e, SMALL_VOCAB, 2, 2, seed=2).half()
  torch.save(ref.state_dict(), os.path.join(tmp_path, "medusa_lm_head.pt"))
  _config(str(tmp_path), medusa_num_heads=5, medusa_num_layers=2, base_model_name_or_path="small")
  heads = sj.load_heads(str(tmp_path), target)
  assert heads.meta["layout"] == "medusa-1" and heads.config.num_heads == 2 and "lm" in heads.params
  tv, expected = tv_check(target, sj.Medusa(heads, tree=[(0,), (1,), (0, 0), (0, 1)], top_k=2), SETTINGS)
  assert tv < 2 * expected, f"TV {tv:.4f} vs expected sampling error {expected:.4f}"


def test_vllm_medusa_heads_sample_exactly(target, tmp_path):
  from safetensors.torch import save_file

  e, vt = target.config.hidden_size, 9
  g = torch.Generator().manual_seed(3)
  ts = {"token_map": torch.randperm(SMALL_VOCAB, generator=g)[:vt]}
  for i in range(2):
    ts[f"blocks.{i}.layers.0.weight"] = torch.randn(e, e, generator=g) * 0.3
    ts[f"lm_heads.{i}.weight"] = torch.randn(vt, e, generator=g) * 0.5
  save_file(ts, os.path.join(tmp_path, "model.safetensors"))
  _config(str(tmp_path), model_type="medusa", architectures=["MedusaModel"], hidden_size=e,
          vocab_size=SMALL_VOCAB, num_heads=2, num_hidden_layers=1, truncated_vocab_size=vt)
  heads = sj.load_heads(str(tmp_path), target)
  assert heads.meta["layout"] == "medusa-vllm" and "lm" in heads.params
  tv, expected = tv_check(target, sj.Medusa(heads, tree=[(0,), (1,), (0, 0), (0, 1)], top_k=2), SETTINGS)
  assert tv < 2 * expected, f"TV {tv:.4f} vs expected sampling error {expected:.4f}"


def test_eagle_heads_sample_exactly(target, tmp_path):
  sd, cfg = _eagle_state(target), _eagle_config(target)
  torch.save(sd, os.path.join(tmp_path, "pytorch_model.bin"))
  _config(str(tmp_path), **cfg)
  heads = sj.load_heads(str(tmp_path), target)
  assert heads.meta["layout"] == "eagle" and not heads.config.input_norm
  tv, expected = tv_check(target, sj.Eagle(heads, depth=2, top_k=2, num_nodes=4), SETTINGS)
  assert tv < 2 * expected, f"TV {tv:.4f} vs expected sampling error {expected:.4f}"
