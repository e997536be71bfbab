"""Phi-3: the Llama layer with q | k | v fused in one qkv_proj and gate | up in one gate_up_proj
(split here into specjax's layouts), a sliding window in every layer. Its long-context rope
("longrope", formerly "su" / "yarn") is not built: such a config is a ConfigError naming it."""

from __future__ import annotations

import numpy as np

from specjax.arch import common
from specjax.config import HFFields, ModelConfig

MODEL_TYPES = ("phi3",)
GGUF_ARCHS = ()


def config_from_hf(f: HFFields, model_type: str) -> ModelConfig:
  h = f.req("num_attention_heads", lo=1)
  e = f.req("hidden_size", lo=1)
  kv = f.opt("num_key_value_heads", h, lo=1)
  common.check_heads(f, h, kv)
  if e % h:
    raise f.error(f"hidden_size = {e} is not a multiple of num_attention_heads = {h}")
  act = f.opt("hidden_act", "silu", str)
  if act != "silu":
    raise f.error(f"unsupported hidden_act {act!r} (expected 'silu')")
  rope = f.raw("rope_parameters") or f.raw("rope_scaling") or {}
  kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
  if kind in ("longrope", "su", "yarn"):
    raise f.error(f"Phi-3's long-context rope (rope type {kind!r}) is not supported; the "
                  f"4k-context Phi-3 models (default rope) are")
  theta, scaling = common.rope(f)
  return ModelConfig(
      arch=model_type,
      **common.sizes(f, hidden=e, layers=f.req("num_hidden_layers", lo=1), heads=h,
                     head_dim=e // h, max_positions=4096, kv_heads=kv),
      norm_eps=f.opt("rms_norm_eps", 1e-5, float),
      rope_theta=theta,
      rope_scaling=scaling,
      sliding_window=f.opt("sliding_window", 0, lo=0),
      tie_word_embeddings=bool(f.raw("tie_word_embeddings", False)),
      **common.token_ids(f),
  )


def check_tensors(cfg: ModelConfig, src, where: str) -> str | None:
  if not cfg.tie_word_embeddings and not src.has("lm_head.weight"):
    return f"{where}: missing tensor 'lm_head.weight' (tie_word_embeddings is false)"
  return None


def params_from_hf(cfg: ModelConfig, src) -> dict:
  """HF Phi-3 names -> specjax flat params; the fused projections are split by rows."""
  e, h, k, d, f, v = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                      cfg.intermediate_size, cfg.vocab_size)
  out = {("embed",): src.get("model.embed_tokens.weight", (v, e))}
  for i in range(cfg.num_layers):
    p, L = f"model.layers.{i}.", ("layers", i)
    qkv = src.get(p + "self_attn.qkv_proj.weight", ((h + 2 * k) * d, e))  # q rows, k rows, v rows
    q, kk, vv = np.split(qkv, [h * d, (h + k) * d], 0)
    out[L + ("attn", "wqkv")] = common.fuse_qkv(q, kk, vv, k, cfg.group_size, d)  # [E,K,G+2,D]
    out[L + ("attn", "wo")] = src.get(p + "self_attn.o_proj.weight", (e, h * d)).T.reshape(h, d, e)
    gate_up = src.get(p + "mlp.gate_up_proj.weight", (2 * f, e))  # gate rows, then up rows
    out[L + ("mlp", "w_in")] = gate_up.reshape(2, f, e).transpose(2, 0, 1)  # [E,2,F]
    out[L + ("mlp", "w_out")] = src.get(p + "mlp.down_proj.weight", (e, f)).T  # [F,E]
    out[L + ("attn_norm", "scale")] = src.get(p + "input_layernorm.weight", (e,))
    out[L + ("mlp_norm", "scale")] = src.get(p + "post_attention_layernorm.weight", (e,))
  out[("final_norm", "scale")] = src.get("model.norm.weight", (e,))
  if not cfg.tie_word_embeddings:
    out[("lm_head",)] = src.get("lm_head.weight", (v, e)).T  # [E,V]
  return out
