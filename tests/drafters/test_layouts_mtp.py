"""DeepSeek-V3-style MTP layers inside an HF checkpoint (specjax.drafters layout "mtp-deepseek"):
read by sj.load_heads, scored by sj.head_logits against a torch reference built from
transformers' own Llama decoder layer, and lossless under sj.MTP (greedy identity at batch 1 and 4,
the sampling-distribution check)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import specjax as sj
from specjax.drafters import head_logits
from specjax.errors import InputError, WeightsError

from tests.helpers.lossless import SMALL_VOCAB, tv_check
from tests.helpers.models import assert_greedy, random_prompts

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
F = torch.nn.functional

K = 2  # MTP modules
TOKENS = np.array([5, 7, 3, 11, 8, 8, 0, 12, 2, 9, 4, 1], np.int32)


def _rms(x, w, eps):
  return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _mtp_state(model, cfg, seed=5) -> dict:
  """MTP layers L..L+K-1 in DeepSeek-V3's names, random, with the shared head and embedding copied
  from the target (as the published checkpoints store them)."""
  g = torch.Generator().manual_seed(seed)
  r = lambda *s: torch.randn(*s, generator=g) * 0.3  # noqa: E731
  e, f = cfg.hidden_size, cfg.intermediate_size
  h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
  d = e // h
  sd = {}
  for i in range(K):
    p = f"model.layers.{cfg.num_hidden_layers + i}."
    sd.update({p + "enorm.weight": 1 + r(e) / 3, p + "hnorm.weight": 1 + r(e) / 3,
               p + "eh_proj.weight": r(e, 2 * e), p + "input_layernorm.weight": 1 + r(e) / 3,
               p + "self_attn.q_proj.weight": r(h * d, e), p + "self_attn.k_proj.weight": r(kv * d, e),
               p + "self_attn.v_proj.weight": r(kv * d, e), p + "self_attn.o_proj.weight": r(e, h * d),
               p + "post_attention_layernorm.weight": 1 + r(e) / 3,
               p + "mlp.gate_proj.weight": r(f, e), p + "mlp.up_proj.weight": r(f, e),
               p + "mlp.down_proj.weight": r(e, f), p + "shared_head.norm.weight": 1 + r(e) / 3,
               p + "shared_head.head.weight": model.lm_head.weight.detach().clone(),
               p + "embed_tokens.weight": model.model.embed_tokens.weight.detach().clone()})
  return {k: x.contiguous() for k, x in sd.items()}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """A tiny random Llama saved by transformers, with K MTP layers added to its safetensors file
  and num_nextn_predict_layers to its config.json."""
  from safetensors.torch import load_file, save_file

  d = str(tmp_path_factory.mktemp("mtp"))
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(vocab_size=SMALL_VOCAB, hidden_size=32, intermediate_size=48,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=256, tie_word_embeddings=False,
                                 attn_implementation="eager")
  model = transformers.LlamaForCausalLM(cfg).eval()
  with torch.no_grad():
    for p in model.parameters():
      if p.ndim > 1:
        p.normal_(0.0, 0.3)
  model.save_pretrained(d)
  sd = _mtp_state(model, cfg)
  file = os.path.join(d, "model.safetensors")
  save_file({**load_file(file), **sd}, file, metadata={"format": "pt"})
  with open(os.path.join(d, "config.json")) as fh:
    raw = json.load(fh)
  with open(os.path.join(d, "config.json"), "w") as fh:
    json.dump(dict(raw, num_nextn_predict_layers=K), fh)
  return d, model, cfg, sd


@pytest.fixture(scope="module")
def target(checkpoint):
  # The target's loader leaves the MTP layers out (they would be unexpected tensors otherwise).
  return sj.load_model(checkpoint[0], tokenizer=False)


def _reference(model, cfg, sd, tokens=TOKENS) -> np.ndarray:
  """DeepSeek-V3's MTP modules, teacher-forced: module k at position t reads
  enorm(embedding of token t + k + 1) and hnorm(h^k_t) through eh_proj, then transformers'
  LlamaDecoderLayer with the layer's weights; logits = shared_head.head(shared_head.norm(out)).
  h^0 is the target's final-normed hidden state. -> [T-K,K,V]."""
  from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

  n, eps = len(tokens) - K, cfg.rms_norm_eps
  ids = torch.tensor(tokens[None], dtype=torch.long)
  with torch.no_grad():
    h = model.model(ids).last_hidden_state[0, :n]  # [n,E], after the final norm
    table = model.model.embed_tokens.weight
    pos = torch.arange(n)[None]
    mask = torch.full((1, 1, n, n), -float("inf")).triu(1)
    rope = LlamaRotaryEmbedding(cfg)
    out = []
    for i in range(K):
      p = f"model.layers.{cfg.num_hidden_layers + i}."
      emb = table[ids[0, i + 1:i + 1 + n]]
      x = F.linear(torch.cat([_rms(emb, sd[p + "enorm.weight"], eps),
                              _rms(h, sd[p + "hnorm.weight"], eps)], -1), sd[p + "eh_proj.weight"])
      layer = LlamaDecoderLayer(cfg, layer_idx=0).eval()
      layer.load_state_dict({k[len(p):]: v for k, v in sd.items() if k.startswith(p) and (
          k[len(p):].startswith(("self_attn.", "mlp.", "input_layernorm", "post_attention")))})
      y = layer(x[None], attention_mask=mask, position_ids=pos,
                position_embeddings=rope(x[None], pos))
      h = (y[0] if isinstance(y, tuple) else y)[0]
      out.append(F.linear(_rms(h, sd[p + "shared_head.norm.weight"], eps),
                          sd[p + "shared_head.head.weight"]))
  return torch.stack(out, 1).numpy()


def test_mtp_layers_match_reference_and_are_lossless(checkpoint, target):
  d, model, cfg, sd = checkpoint
  heads = sj.load_heads(d, target)
  assert heads.meta["layout"] == "mtp-deepseek"
  assert heads.config.kind == "mtp" and heads.config.num_heads == K
  got = np.asarray(head_logits(target, heads, TOKENS))
  assert got.shape == (len(TOKENS) - K, K, SMALL_VOCAB)
  np.testing.assert_allclose(got, _reference(model, cfg, sd), atol=1e-4, rtol=1e-4)
  runs = []
  for b in (1, 4):
    prompts = random_prompts(b, SMALL_VOCAB, seed=b)
    out = sj.generate(target, prompts, sj.MTP(heads), max_new_tokens=12, stop_at_eos=False)
    runs += list(zip(prompts, out.tokens))
  assert_greedy(target, runs, 12)
  tv, expected = tv_check(target, sj.MTP(heads), dict(temperature=1.0, top_k=5, top_p=1.0))
  assert tv < 2 * expected, f"TV {tv:.4f} vs expected sampling error {expected:.4f}"


def _copy_with(src: str, dst: str, edit) -> str:
  """The checkpoint at src copied to dst with its tensors edited: edit(dict) -> dict."""
  from safetensors.numpy import load_file, save_file

  import shutil
  shutil.copytree(src, dst)
  file = os.path.join(dst, "model.safetensors")
  save_file(edit(load_file(file)), file)
  return dst


def test_bad_mtp_layers_are_named(checkpoint, target, tmp_path):
  d, _, cfg, _ = checkpoint
  with pytest.raises(InputError, match="pass target="):
    sj.load_heads(d)
  p = f"model.layers.{cfg.num_hidden_layers + 1}."
  gone = _copy_with(d, str(tmp_path / "gone"), lambda t: {
      k: v for k, v in t.items() if k != p + "hnorm.weight"})
  with pytest.raises(WeightsError, match=f"missing tensor '{p}hnorm.weight'"):
    sj.load_heads(gone, target)
  other = _copy_with(d, str(tmp_path / "other"), lambda t: {
      k: (v + 1 if k == p + "shared_head.head.weight" else v) for k, v in t.items()})
  with pytest.raises(WeightsError, match="module 1's shared_head.head differs"):
    sj.load_heads(other, target)
  small = sj.Model.random(sj.ModelConfig(arch="llama", vocab_size=SMALL_VOCAB, hidden_size=16,
                                         num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
                                         intermediate_size=24, max_position_embeddings=64))
  with pytest.raises(InputError, match="width 32.*width 16"):
    sj.load_heads(d, small)
