"""Tiny random transformers models of the Llama-like families and GPT-2, saved locally (no
download): the parity models of tests/test_model.py, and the checkpoints tests/test_errors.py
breaks."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, max_position_embeddings=256)

HF_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, num_key_value_heads=2, tie_word_embeddings=False),
    "llama3-rope-tied": lambda: transformers.LlamaConfig(
        **COMMON, num_key_value_heads=1, tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "llama-linear-rope": lambda: transformers.LlamaConfig(
        **COMMON, num_key_value_heads=4, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=False),
    "mistral": lambda: transformers.MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=None),
    "mistral-window": lambda: transformers.MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=8),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=97, n_embd=64, n_layer=3, n_head=4, n_positions=256),
}


def save_tiny_hf(name: str, path: str, **save_kw) -> "transformers.PreTrainedModel":
  torch.manual_seed(0)
  cfg = HF_CONFIGS[name]()
  cfg._attn_implementation = "eager"
  model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
  with torch.no_grad():  # spread the weights so the test sees real differences
    for p in model.parameters():
      if p.ndim == 1 and "norm" in name:
        continue
      p.add_(torch.randn_like(p) * 0.05)
  model.save_pretrained(path, **save_kw)
  return model
