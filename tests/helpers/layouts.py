"""Drafter files in published layouts, written here with random weights: config.json,
FasterDecoding's Medusa-1 heads, SafeAILab's EAGLE-1/2 state dict and config (tests/drafters/)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")


def _config(d, **fields):
  with open(os.path.join(d, "config.json"), "w") as f:
    json.dump(fields, f)


class ResBlock(torch.nn.Module):  # FasterDecoding's: x + SiLU(W x + b)

  def __init__(self, e):
    super().__init__()
    self.linear = torch.nn.Linear(e, e)
    self.act = torch.nn.SiLU()

  def forward(self, x):
    return x + self.act(self.linear(x))


def _medusa1_heads(e, v, k, layers, lm_heads=True, seed=0):
  """Medusa-1's heads as FasterDecoding builds them: [ResBlock] * L (one block, shared) and a
  per-head LM head (left out in the newer files that use the target's)."""
  torch.manual_seed(seed)
  heads = torch.nn.ModuleList([
      torch.nn.Sequential(*([ResBlock(e)] * layers),
                          *([torch.nn.Linear(e, v, bias=False)] if lm_heads else []))
      for _ in range(k)])
  with torch.no_grad():
    for p in heads.parameters():
      p.normal_(0.0, 0.3)
  return heads


def _eagle_state(target, seed=3):
  """An EAGLE-1/2 head's state dict (SafeAILab's names) for the tiny target, float16."""
  c = target.config
  e, h, kv, d, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
  g = torch.Generator().manual_seed(seed)
  r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
  p = "layers.0."
  sd = {"fc.weight": r(e, 2 * e), "fc.bias": r(e),
        p + "self_attn.q_proj.weight": r(h * d, e), p + "self_attn.k_proj.weight": r(kv * d, e),
        p + "self_attn.v_proj.weight": r(kv * d, e), p + "self_attn.o_proj.weight": r(e, h * d),
        p + "mlp.gate_proj.weight": r(f, e), p + "mlp.up_proj.weight": r(f, e),
        p + "mlp.down_proj.weight": r(e, f), p + "post_attention_layernorm.weight": 1 + r(e),
        "embed_tokens.weight": torch.tensor(np.asarray(target.params["embed"][...]))}
  return {k: x.half() for k, x in sd.items()}


def _eagle_config(target):
  c = target.config
  return dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
              hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
              num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
              num_hidden_layers=1, rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta,
              max_position_embeddings=2048, vocab_size=c.vocab_size, bias=True,
              torch_dtype="float16")
