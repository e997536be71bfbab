"""Frozen model configuration, read from an HF config.json or GGUF metadata.

Model differences are fields here, never forks of the model code: Llama, Mistral, Qwen2 and
SmolLM2 differ only in biases, rope settings and tying; GPT-2 in norms, activation and learned
positions.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from specjax.errors import ConfigError

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "gpt2")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  arch: str  # one of SUPPORTED_ARCHS (llama also covers SmolLM2)
  vocab_size: int  # V
  hidden_size: int  # E
  num_layers: int  # L
  num_heads: int  # H
  num_kv_heads: int  # K
  head_dim: int  # D
  intermediate_size: int  # F
  max_position_embeddings: int
  norm_eps: float = 1e-5
  norm: str = "rms"  # "rms" | "layer"
  activation: str = "silu"  # "silu" | "gelu_new"
  gated_mlp: bool = True  # SwiGLU (Llama) or plain MLP (GPT-2)
  qkv_bias: bool = False  # Qwen2, GPT-2
  out_bias: bool = False  # GPT-2: attention output and MLP biases
  position: str = "rope"  # "rope" | "learned"
  rope_theta: float = 10000.0
  # Hashable rope scaling: () or (("rope_type", "llama3"), ("factor", 8.0), ...).
  rope_scaling: tuple = ()
  sliding_window: int = 0  # 0 = full attention
  tie_word_embeddings: bool = False
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  pad_token_id: int | None = None

  @property
  def group_size(self) -> int:
    """G: query heads per kv head."""
    return self.num_heads // self.num_kv_heads

  @property
  def num_params(self) -> int:
    e, f, v, l = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_layers
    qkv = e * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
    o = self.num_heads * self.head_dim * e
    mlp = e * f * (3 if self.gated_mlp else 2)
    head = 0 if self.tie_word_embeddings else e * v
    pos = self.max_position_embeddings * e if self.position == "learned" else 0
    return v * e + pos + l * (qkv + o + mlp) + head

  def validate(self) -> None:
    if self.arch not in SUPPORTED_ARCHS:
      raise ConfigError(
          f"unsupported architecture {self.arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}"
      )
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
      if getattr(self, name) < 1:
        raise ConfigError(f"config field {name}={getattr(self, name)} must be >= 1")
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(
          f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
      )
    if self.position == "rope" and self.head_dim % 2:
      raise ConfigError(f"rope needs an even head_dim, got {self.head_dim}")
    rope = dict(self.rope_scaling)
    if rope and rope.get("rope_type") not in ("default", "linear", "llama3"):
      raise ConfigError(
          f"unsupported rope_scaling type {rope.get('rope_type')!r}; supported: default, linear, llama3"
      )


def _eos_tuple(value: Any) -> tuple[int, ...]:
  if value is None:
    return ()
  if isinstance(value, (list, tuple)):
    return tuple(int(v) for v in value)
  return (int(value),)


def _rope_tuple(d: dict | None) -> tuple:
  if not d:
    return ()
  d = dict(d)
  d["rope_type"] = d.get("rope_type", d.get("type", "default"))
  d.pop("type", None)
  return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items()))


def from_hf_dict(hf: dict, *, source: str = "config.json") -> ModelConfig:
  """Maps an HF config.json dict to a ModelConfig; raises ConfigError naming what is wrong."""
  model_type = hf.get("model_type")
  if model_type is None:
    raise ConfigError(f"{source}: no 'model_type' field")
  if model_type == "gpt2":
    cfg = _gpt2_config(hf, source)
  elif model_type in ("llama", "mistral", "qwen2"):
    cfg = _llama_config(hf, model_type, source)
  else:
    raise ConfigError(
        f"{source}: unsupported architecture model_type={model_type!r}; "
        f"supported: {', '.join(SUPPORTED_ARCHS)}"
    )
  cfg.validate()
  return cfg


def _gpt2_config(hf: dict, source: str) -> ModelConfig:
  """GPT-2's config.json (n_embd, n_head, ...): LayerNorm, learned positions, biases, tanh GELU."""
  e = hf["n_embd"]
  h = hf["n_head"]
  cfg = ModelConfig(
      arch="gpt2",
      vocab_size=hf["vocab_size"],
      hidden_size=e,
      num_layers=hf["n_layer"],
      num_heads=h,
      num_kv_heads=h,
      head_dim=e // h,
      intermediate_size=hf.get("n_inner") or 4 * e,
      max_position_embeddings=hf["n_positions"],
      norm_eps=hf.get("layer_norm_epsilon", 1e-5),
      norm="layer",
      activation="gelu_new",
      gated_mlp=False,
      qkv_bias=True,
      out_bias=True,
      position="learned",
      tie_word_embeddings=hf.get("tie_word_embeddings", True),
      bos_token_id=hf.get("bos_token_id"),
      eos_token_ids=_eos_tuple(hf.get("eos_token_id")),
      pad_token_id=hf.get("pad_token_id"),
  )
  if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
    raise ConfigError(
        f"{source}: unsupported gpt2 activation_function {hf['activation_function']!r}"
    )
  if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"):
    raise ConfigError(f"{source}: gpt2 attention variants are not supported")
  return cfg


def _llama_config(hf: dict, model_type: str, source: str) -> ModelConfig:
  """The Llama family's config.json (llama, mistral, qwen2): RMSNorm, RoPE (with its scaling),
  gated SiLU MLP, grouped kv heads, Mistral's and Qwen2's sliding window."""
  h = hf["num_attention_heads"]
  e = hf["hidden_size"]
  if hf.get("hidden_act", "silu") != "silu":
    raise ConfigError(f"{source}: unsupported hidden_act {hf['hidden_act']!r} (expected 'silu')")
  # transformers >= 5 writes rope settings as `rope_parameters` (rope_theta inside); older
  # configs have top-level `rope_theta` and `rope_scaling`.
  rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
  if rope.get("rope_type", rope.get("type")) in (None, "default"):
    rope = {}
  window = 0
  if model_type == "mistral" and hf.get("sliding_window"):
    window = int(hf["sliding_window"])
  if model_type == "qwen2" and hf.get("use_sliding_window") and hf.get("sliding_window"):
    window = int(hf["sliding_window"])
  cfg = ModelConfig(
      arch=model_type,
      vocab_size=hf["vocab_size"],
      hidden_size=e,
      num_layers=hf["num_hidden_layers"],
      num_heads=h,
      num_kv_heads=hf.get("num_key_value_heads") or h,
      head_dim=hf.get("head_dim") or e // h,
      intermediate_size=hf["intermediate_size"],
      max_position_embeddings=hf.get("max_position_embeddings", 2048),
      norm_eps=hf.get("rms_norm_eps", 1e-6),
      qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
      out_bias=False,
      rope_theta=theta,
      rope_scaling=_rope_tuple(rope),
      sliding_window=window,
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
      bos_token_id=hf.get("bos_token_id"),
      eos_token_ids=_eos_tuple(hf.get("eos_token_id")),
      pad_token_id=hf.get("pad_token_id"),
  )
  if hf.get("mlp_bias"):
    raise ConfigError(f"{source}: mlp_bias=True is not supported")
  return cfg


def from_hf_dir(path: str | os.PathLike) -> ModelConfig:
  file = os.path.join(path, "config.json")
  if not os.path.isfile(file):
    raise ConfigError(f"{path}: no config.json in this directory")
  try:
    with open(file) as f:
      hf = json.load(f)
  except json.JSONDecodeError as e:
    raise ConfigError(f"{file}: not valid JSON ({e})") from e
  return from_hf_dict(hf, source=file)


def from_gguf_fields(fields: dict[str, Any], *, source: str) -> ModelConfig:
  """Maps GGUF metadata (already decoded to Python values) to a ModelConfig."""
  arch = fields.get("general.architecture")
  if arch not in ("llama", "qwen2"):
    raise ConfigError(
        f"{source}: unsupported GGUF architecture {arch!r}; supported: llama, qwen2"
    )

  def f(key, default=None):
    return fields.get(f"{arch}.{key}", default)

  h = int(f("attention.head_count"))
  e = int(f("embedding_length"))
  vocab = f("vocab_size")
  if vocab is None:
    vocab = len(fields["tokenizer.ggml.tokens"])
  cfg = ModelConfig(
      arch=arch,
      vocab_size=int(vocab),
      hidden_size=e,
      num_layers=int(f("block_count")),
      num_heads=h,
      num_kv_heads=int(f("attention.head_count_kv", h)),
      head_dim=int(f("attention.key_length", e // h)),
      intermediate_size=int(f("feed_forward_length")),
      max_position_embeddings=int(f("context_length", 2048)),
      norm_eps=float(f("attention.layer_norm_rms_epsilon", 1e-5)),
      qkv_bias=arch == "qwen2",
      rope_theta=float(f("rope.freq_base", 10000.0)),
      tie_word_embeddings=True,  # decided by the loader from the tensors present
      bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
      eos_token_ids=_eos_tuple(fields.get("tokenizer.ggml.eos_token_id")),
      pad_token_id=fields.get("tokenizer.ggml.padding_token_id"),
  )
  cfg.validate()
  return cfg
