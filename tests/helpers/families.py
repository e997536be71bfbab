"""Tiny random transformers models of the families beyond Llama / GPT-2, saved locally (no
download): their configs and the builder (tests/arch/test_families.py, the sharding tests)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V, T = 97, 24  # vocabulary; test sequence length (every window below is shorter)
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              eos_token_id=None, bos_token_id=None, pad_token_id=None)

FAMILIES = {  # name -> config builder; keyword arguments override COMMON's fields
    # head_dim 24 != hidden / heads = 16: Qwen3's head_dim is its own.
    "qwen3": lambda **kw: transformers.Qwen3Config(**{**COMMON, **kw}, head_dim=24,
                                                   tie_word_embeddings=False),
    "gemma": lambda **kw: transformers.GemmaConfig(**{**COMMON, **kw}, head_dim=16),
    "gemma2": lambda **kw: transformers.Gemma2Config(
        **{**COMMON, **kw}, head_dim=16, sliding_window=6, query_pre_attn_scalar=20,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "gemma3": lambda **kw: transformers.Gemma3TextConfig(
        **{**COMMON, **kw}, head_dim=16, sliding_window=5, query_pre_attn_scalar=20,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1_000_000.0}}),
    "phi3": lambda **kw: transformers.Phi3Config(**{**COMMON, "pad_token_id": 0, **kw},
                                                 sliding_window=7, tie_word_embeddings=False),
}


def build_hf(name: str, path: str, cfg=None, **kw):
  """A tiny random HF model of family `name` (or of the transformers config `cfg`; kw override
  COMMON's fields), weights spread wide enough that greedy decoding has no near-ties, saved to
  `path`. Returns the transformers model (eager attention)."""
  torch.manual_seed(0)
  cfg = cfg if cfg is not None else FAMILIES[name](**kw)
  cfg._attn_implementation = "eager"
  model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
  with torch.no_grad():
    for n, p in model.named_parameters():
      p.add_(torch.randn_like(p) * (0.1 if p.ndim == 1 else 0.15))
  model.save_pretrained(path)
  return model
