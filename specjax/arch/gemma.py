"""The Gemma family: Gemma 1, 2 and 3 (text).

All: a GeGLU MLP (tanh GELU), token embeddings times sqrt(E), RMSNorm as x * (1 + w) (loaded here
as scale = w + 1, so the model's plain RMSNorm serves), a tied head, head_dim its own field.
Gemma 2 adds norms on each sublayer's output (post_attention / pre_ / post_feedforward_layernorm),
attention-logit and final-logit soft-capping, scores scaled by query_pre_attn_scalar ** -0.5 and
alternating sliding / global layers (`layer_types`). Gemma 3 adds q/k RMSNorms over D, drops the
attention soft-cap, and gives its sliding layers their own rope base (rope_local_base_freq, or the
"sliding_attention" entry of rope_parameters).
"""

from __future__ import annotations

import math

import numpy as np

from specjax.arch import common, llama
from specjax.config import HFFields, ModelConfig

MODEL_TYPES = ("gemma", "gemma2", "gemma3_text")
GGUF_ARCHS = ()


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
      vocab_size=f.req("vocab_size", lo=1),
      hidden_size=e,
      num_layers=n,
      num_heads=h,
      num_kv_heads=f.opt("num_key_value_heads", h, lo=1),
      head_dim=f.opt("head_dim", 256, lo=1),
      intermediate_size=f.req("intermediate_size", lo=1),
      max_position_embeddings=f.opt("max_position_embeddings", 8192, lo=1),
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
