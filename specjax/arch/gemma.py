"""The Gemma family: Gemma 1, 2 and 3 (text).

All: a GeGLU MLP (tanh GELU), token embeddings times sqrt(E), RMSNorm as x * (1 + w) (loaded here
as scale = w + 1, so the model's plain RMSNorm serves), a tied head, head_dim its own field.
Gemma 2 adds norms on each sublayer's output (post_attention / pre_ / post_feedforward_layernorm),
attention-logit and final-logit soft-capping, scores scaled by query_pre_attn_scalar ** -0.5 and
alternating sliding / global layers (`layer_types`). Gemma 3 adds q/k RMSNorms over D, drops the
attention soft-cap, and gives its sliding layers their own rope base (rope_local_base_freq, or the
"sliding_attention" entry of rope_parameters).

GGUF (llama.cpp's "gemma3" architecture, e.g. Gemma 3 270M): the metadata carries the sizes, the
window and the global rope base but not what llama.cpp's runtime hard-codes for the architecture
(its llama-model.cpp), which config_from_gguf restores: every sixth layer global, rope base 10000
on the windowed layers, scores scaled by head_dim ** -0.5 (E / H for the 62-layer 27B). llama.cpp's
converter stores every norm weight as 1 + w; gguf_tensor gives back w (as transformers' GGUF
loader does), so one converter serves both checkpoint kinds.
"""

from __future__ import annotations

import math

import numpy as np

from specjax.arch import common, llama
from specjax.config import HFFields, ModelConfig, eos_tuple
from specjax.errors import ConfigError

MODEL_TYPES = ("gemma", "gemma2", "gemma3_text")
GGUF_ARCHS = ("gemma3",)


def _ropes(f: HFFields, model_type: str) -> dict:
  """Gemma 3's rope per layer type (global, local); earlier Gemmas one rope for all layers."""
  params = f.raw("rope_parameters")
  if model_type != "gemma3_text":
    theta, scaling = common.rope(f)
    return dict(rope_theta=theta, rope_scaling=scaling)
  if isinstance(params, dict) and set(params) & set(common.LAYER_TYPES):
    theta, scaling = common.rope(f, params.get("full_attention") or {}, 1_000_000.0)
    local = params.get("sliding_attention") or {}
    local_theta, local_scaling = common.rope(f, dict(local, rope_theta=local.get(
        "rope_theta", f.opt("rope_local_base_freq", 10000.0, float))))
  else:  # older configs: rope_theta + rope_scaling for global layers, rope_local_base_freq
    theta, scaling = common.rope(f, None, 1_000_000.0)
    local_theta, local_scaling = f.opt("rope_local_base_freq", 10000.0, float), ()
  return dict(rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta,
              local_rope_scaling=local_scaling)


def _windows(f: HFFields, n: int) -> tuple:
  window = f.opt("sliding_window", 0, lo=0)
  if f.raw("layer_types") is not None:
    return common.layer_windows(f, n, window)
  pattern = f.opt("sliding_window_pattern", f.opt("_sliding_window_pattern", 0, lo=0), lo=0)
  if pattern and window:  # older Gemma 3 configs: every pattern-th layer is global
    return tuple(0 if (i + 1) % pattern == 0 else window for i in range(n))
  return ()


def config_from_hf(f: HFFields, model_type: str) -> ModelConfig:
  h = f.req("num_attention_heads", lo=1)
  e = f.req("hidden_size", lo=1)
  n = f.req("num_hidden_layers", lo=1)
  common.check_heads(f, h, f.opt("num_key_value_heads", h, lo=1))
  act = f.opt("hidden_activation", f.opt("hidden_act", "gelu_pytorch_tanh", str), str)
  if act not in ("gelu_pytorch_tanh", "gelu"):  # transformers reads a legacy "gelu" as tanh
    raise f.error(f"unsupported hidden_activation {act!r} (expected 'gelu_pytorch_tanh')")
  if f.raw("use_bidirectional_attention"):
    raise f.error("use_bidirectional_attention=True is not a causal decoder")
  later = model_type != "gemma"
  windows = _windows(f, n) if later else ()
  if model_type == "gemma2" and not windows and f.opt("sliding_window", 0, lo=0):
    windows = tuple(f.req("sliding_window") if i % 2 == 0 else 0 for i in range(n))
  return ModelConfig(
      arch=model_type,
      **common.sizes(f, hidden=e, layers=n, heads=h, head_dim=f.opt("head_dim", 256, lo=1),
                     max_positions=8192),
      norm_eps=f.opt("rms_norm_eps", 1e-6, float),
      activation="gelu_tanh",
      qkv_bias=bool(f.raw("attention_bias", False)),
      qk_norm=model_type == "gemma3_text",
      post_norms=later,
      embed_scale=float(math.sqrt(e)),
      attn_scale=f.opt("query_pre_attn_scalar", 256, float, lo=1e-9) ** -0.5 if later else 0.0,
      attn_softcap=f.opt("attn_logit_softcapping", 0.0, float, lo=0) if model_type == "gemma2" else 0.0,
      final_softcap=f.opt("final_logit_softcapping", 0.0, float, lo=0) if later else 0.0,
      layer_windows=windows,
      tie_word_embeddings=bool(f.raw("tie_word_embeddings", True)),
      **_ropes(f, model_type),
      **common.token_ids(f),
  )


def config_from_gguf(fields: dict, arch: str, source: str) -> ModelConfig:
  """A "gemma3" GGUF's metadata -> ModelConfig; ConfigError naming a missing or unsupported key."""

  def f(key, default=None, kind=int):
    value = fields.get(f"{arch}.{key}", default)
    if value is None:
      raise ConfigError(f"{source}: GGUF metadata key {arch}.{key} is missing")
    return kind(value)

  e, n, h = f("embedding_length"), f("block_count"), f("attention.head_count")
  d = f("attention.key_length", 256)
  if f("attention.value_length", d) != d:
    raise ConfigError(f"{source}: {arch}.attention.value_length = {f('attention.value_length')} "
                      f"differs from key_length = {d}; Gemma's heads have one head_dim")
  vocab = fields.get(f"{arch}.vocab_size")
  if vocab is None:
    vocab = len(fields["tokenizer.ggml.tokens"])
  window = f("attention.sliding_window", 0)
  scaling = str(fields.get(f"{arch}.rope.scaling.type", "none"))
  if scaling not in ("none", "linear"):
    raise ConfigError(f"{source}: {arch}.rope.scaling.type = {scaling!r} is not supported "
                      f"(none or linear)")
  rope_scaling = ((("factor", f("rope.scaling.factor", kind=float)), ("rope_type", "linear"))
                  if scaling == "linear" else ())
  return ModelConfig(
      arch="gemma3_text",
      vocab_size=int(vocab),
      hidden_size=e,
      num_layers=n,
      num_heads=h,
      num_kv_heads=f("attention.head_count_kv", h),
      head_dim=d,
      intermediate_size=f("feed_forward_length"),
      max_position_embeddings=f("context_length", 131072),
      norm_eps=f("attention.layer_norm_rms_epsilon", 1e-6, float),
      activation="gelu_tanh",
      qk_norm=True,
      post_norms=True,
      embed_scale=float(math.sqrt(e)),
      attn_scale=float(e // h if n == 62 else d) ** -0.5,
      final_softcap=f("final_logit_softcapping", 0.0, float),
      layer_windows=_gguf_windows(fields.get(f"{arch}.attention.sliding_window_pattern"), n,
                                  window, source) if window else (),
      rope_theta=f("rope.freq_base", 1_000_000.0, float),
      rope_scaling=rope_scaling,
      local_rope_theta=10000.0,
      tie_word_embeddings=True,  # decided by the loader from the tensors present
      bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
      eos_token_ids=eos_tuple(fields.get("tokenizer.ggml.eos_token_id")),
      pad_token_id=fields.get("tokenizer.ggml.padding_token_id"),
  )


def _gguf_windows(pattern, n: int, window: int, source: str) -> tuple:
  """Per-layer windows from sliding_window_pattern: absent -> llama.cpp's Gemma 3 default (every
  sixth layer global); an int p -> every p-th layer global; a list -> per layer, true = windowed."""
  if pattern is None:
    pattern = 6
  if isinstance(pattern, (list, tuple)):
    if len(pattern) != n:
      raise ConfigError(f"{source}: sliding_window_pattern has {len(pattern)} entries for "
                        f"{n} layers")
    return tuple(window if p else 0 for p in pattern)
  return tuple(0 if (i + 1) % int(pattern) == 0 else window for i in range(n))


# llama.cpp's names -> HF's (whole-model tensors, then per layer: blk.i.<name> ->
# model.layers.i.<name>). ffn_norm is Gemma's pre_feedforward_layernorm (Llama's
# post_attention_layernorm), and post_attention_norm its norm on the attention output.
GGUF_NAMES = llama.GGUF_NAMES
GGUF_LAYER_NAMES = dict(
    llama.GGUF_LAYER_NAMES,
    **{"ffn_norm.weight": "pre_feedforward_layernorm.weight",
       "post_attention_norm.weight": "post_attention_layernorm.weight",
       "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
       "attn_q_norm.weight": "self_attn.q_norm.weight",
       "attn_k_norm.weight": "self_attn.k_norm.weight"})


def gguf_permuted(cfg: ModelConfig) -> bool:
  """llama.cpp permutes q/k rows for its llama arch only; Gemma's are stored as HF's."""
  return False


def gguf_tensor(cfg: ModelConfig, hf_name: str, w: np.ndarray) -> np.ndarray:
  """A GGUF tensor (by its HF name) -> HF's value: llama.cpp stores Gemma's norms as 1 + w."""
  return w - np.float32(1.0) if hf_name.endswith("norm.weight") else w


def check_tensors(cfg: ModelConfig, src, where: str) -> str | None:
  return llama.check_tensors(cfg, src, where)


def params_from_hf(cfg: ModelConfig, src) -> dict:
  """HF Gemma names -> specjax flat params; every norm weight w becomes scale w + 1."""
  e, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
  out = {("embed",): src.get("model.embed_tokens.weight", (v, e))}

  def norm(name):
    return src.get(name, (e,)) + 1.0

  for i in range(cfg.num_layers):
    p, L = f"model.layers.{i}.", ("layers", i)
    out.update(llama.attention_params(cfg, src, p + "self_attn.", L + ("attn",), norm_shift=1.0))
    gate = src.get(p + "mlp.gate_proj.weight", (f, e))
    up = src.get(p + "mlp.up_proj.weight", (f, e))
    out[L + ("mlp", "w_in")] = np.stack([gate, up], 0).transpose(2, 0, 1)  # [E,2,F]
    out[L + ("mlp", "w_out")] = src.get(p + "mlp.down_proj.weight", (e, f)).T  # [F,E]
    out[L + ("attn_norm", "scale")] = norm(p + "input_layernorm.weight")
    if cfg.post_norms:
      out[L + ("post_attn_norm", "scale")] = norm(p + "post_attention_layernorm.weight")
      out[L + ("mlp_norm", "scale")] = norm(p + "pre_feedforward_layernorm.weight")
      out[L + ("post_mlp_norm", "scale")] = norm(p + "post_feedforward_layernorm.weight")
    else:
      out[L + ("mlp_norm", "scale")] = norm(p + "post_attention_layernorm.weight")
  out[("final_norm", "scale")] = norm("model.norm.weight")
  if not cfg.tie_word_embeddings:
    out[("lm_head",)] = src.get("lm_head.weight", (v, e)).T  # [E,V]
  return out
