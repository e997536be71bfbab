"""Frozen model configuration: every difference between model families is a field here, never a
fork of the model code (model.py reads only this).

Per-layer attention is data: `layer_windows` gives each layer's sliding window (0 = global) and
`local_rope_theta` the rope base of the windowed layers, so alternating local / global layers
(Gemma 2 / 3) need no model code of their own. How a family's HF config.json or GGUF metadata maps
to these fields lives in its module in specjax/arch/; `HFFields` here reads a config.json's fields
with errors that name the file, the field and the value.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from specjax.errors import ConfigError

ROPE_TYPES = ("default", "linear", "llama3")
ACTIVATIONS = ("silu", "gelu_new", "gelu_tanh")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  arch: str  # the family's model_type (specjax/arch), a label: the model reads only the fields
  vocab_size: int  # V
  hidden_size: int  # E
  num_layers: int  # L
  num_heads: int  # H
  num_kv_heads: int  # K
  head_dim: int  # D (independent of E / H in Qwen3 and Gemma)
  intermediate_size: int  # F
  max_position_embeddings: int
  norm_eps: float = 1e-5
  norm: str = "rms"  # "rms" | "layer"
  activation: str = "silu"  # "silu" | "gelu_new" / "gelu_tanh" (both tanh-approximated GELU)
  gated_mlp: bool = True  # act(gate) * up (Llama, Gemma) or act(x W) (GPT-2)
  qkv_bias: bool = False  # Qwen2, GPT-2
  out_bias: bool = False  # GPT-2: attention output and MLP biases
  position: str = "rope"  # "rope" | "learned"
  rope_theta: float = 10000.0
  # Hashable rope scaling: () or (("rope_type", "llama3"), ("factor", 8.0), ...).
  rope_scaling: tuple = ()
  sliding_window: int = 0  # every layer's window (Mistral) unless layer_windows is given; 0 = none
  # Per layer window, 0 = global attention (Gemma 2 / 3). () = sliding_window in every layer. It
  # may be longer than num_layers (a draft built from a target's first layers keeps their windows).
  layer_windows: tuple[int, ...] = ()
  local_rope_theta: float = 0.0  # rope base of the windowed layers (Gemma 3); 0 = rope_theta
  local_rope_scaling: tuple = ()  # their rope scaling, as rope_scaling (with local_rope_theta)
  qk_norm: bool = False  # RMSNorm over D of each query and key head before rope (Qwen3, Gemma 3)
  post_norms: bool = False  # norms on the attention and MLP outputs too (Gemma 2 / 3)
  embed_scale: float = 1.0  # token embeddings times this (Gemma: sqrt(E))
  attn_scale: float = 0.0  # scores times this; 0 = D ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
  attn_softcap: float = 0.0  # scores -> cap * tanh(scores / cap) (Gemma 2); 0 = none
  final_softcap: float = 0.0  # logits -> cap * tanh(logits / cap) (Gemma 2); 0 = none
  tie_word_embeddings: bool = False
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  pad_token_id: int | None = None

  @property
  def group_size(self) -> int:
    """G: query heads per kv head."""
    return self.num_heads // self.num_kv_heads

  def window(self, layer: int | None) -> int:
    """The sliding window of layer `layer` (0 = global); layer None (a drafter's own layer built
    on the target's config): global."""
    if layer is None:
      return 0
    return self.layer_windows[layer] if self.layer_windows else self.sliding_window

  def rope(self, layer: int | None) -> tuple[float, tuple]:
    """(rope base, rope scaling) of layer `layer`: windowed layers use local_rope_theta and
    local_rope_scaling where it is set (Gemma 3); every other layer rope_theta, rope_scaling."""
    if self.local_rope_theta and self.window(layer):
      return self.local_rope_theta, self.local_rope_scaling
    return self.rope_theta, self.rope_scaling

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
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "intermediate_size"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"config field {name}={value!r} must be an integer >= 1")
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(
          f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
      )
    if self.position == "rope" and self.head_dim % 2:
      raise ConfigError(f"rope needs an even head_dim, got {self.head_dim}")
    if self.activation not in ACTIVATIONS:
      raise ConfigError(f"activation={self.activation!r} is not supported; supported: "
                        f"{', '.join(ACTIVATIONS)}")
    if self.layer_windows and len(self.layer_windows) < self.num_layers:
      raise ConfigError(f"layer_windows has {len(self.layer_windows)} entries for "
                        f"num_layers={self.num_layers}")
    if any(w < 0 for w in self.layer_windows) or self.sliding_window < 0:
      raise ConfigError(f"sliding windows must be >= 0, got {self.layer_windows or self.sliding_window}")
    for scaling in (self.rope_scaling, self.local_rope_scaling):
      kind = dict(scaling).get("rope_type", "default")
      if kind not in ROPE_TYPES:
        raise ConfigError(f"unsupported rope_scaling type {kind!r}; supported: {', '.join(ROPE_TYPES)}")


def eos_tuple(value: Any) -> tuple[int, ...]:
  if value is None:
    return ()
  if isinstance(value, (list, tuple)):
    return tuple(int(v) for v in value)
  return (int(value),)


def rope_tuple(d: dict | None) -> tuple:
  """An HF rope_scaling dict -> ModelConfig.rope_scaling (hashable, rope_type always named)."""
  if not d:
    return ()
  d = dict(d)
  d["rope_type"] = d.get("rope_type", d.get("type", "default"))
  d.pop("type", None)
  return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items()))


class HFFields:
  """A config.json's fields, read with the errors a user can act on: a missing required field or
  a value of the wrong type raises ConfigError naming the file, the field and the value."""

  def __init__(self, hf: dict, source: str):
    self.hf, self.source = hf, source

  def has(self, name: str) -> bool:
    return self.hf.get(name) is not None

  def raw(self, name: str, default=None):
    return self.hf.get(name, default)

  def _check(self, name, value, kind, lo):
    number = kind in (int, float)
    ok = (not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else kind)
          if number else isinstance(value, kind))
    if ok and kind is float:
      ok = math.isfinite(value)
    if not ok:
      raise ConfigError(f"{self.source}: field {name!r} = {value!r} must be "
                        f"{'an integer' if kind is int else 'a number' if number else kind.__name__}")
    if lo is not None and value < lo:
      raise ConfigError(f"{self.source}: field {name!r} = {value!r} must be >= {lo}")
    return float(value) if kind is float else value

  def req(self, name: str, kind=int, lo=None):
    """A required field (int by default)."""
    if self.hf.get(name) is None:
      raise ConfigError(f"{self.source}: required field {name!r} is missing")
    return self._check(name, self.hf[name], kind, lo)

  def opt(self, name: str, default, kind=int, lo=None):
    """An optional field: `default` when absent or null."""
    value = self.hf.get(name)
    return default if value is None else self._check(name, value, kind, lo)

  def error(self, message: str) -> ConfigError:
    return ConfigError(f"{self.source}: {message}")


def read_hf_json(path: str | os.PathLike) -> tuple[dict, str]:
  """A directory's config.json -> (its dict, the file's path); ConfigError if it is missing, not
  JSON or not a JSON object."""
  file = os.path.join(path, "config.json")
  if not os.path.isfile(file):
    raise ConfigError(f"{path}: no config.json in this directory")
  try:
    with open(file) as f:
      hf = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ConfigError(f"{file}: not valid JSON ({e})") from e
  if not isinstance(hf, dict):
    raise ConfigError(f"{file}: expected a JSON object of config fields, got a "
                      f"{type(hf).__name__}")
  return hf, file
