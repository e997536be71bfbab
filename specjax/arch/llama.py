"""The Llama family: Llama 2 / 3.x, SmolLM2, Mistral, Qwen2 / 2.5 and Qwen3.

RMSNorm, rope (default, linear or llama3 scaling), a gated SiLU MLP, grouped kv heads. Qwen2 adds
q/k/v biases; Qwen3 drops them and RMS-normalises each query and key head over D before rope, with
a head_dim independent of E / H; Mistral and Qwen2 / 3 may use sliding windows (all layers, or per
`layer_types`). One tensor layout for all of them (HF `model.layers.i.self_attn.q_proj` ...), and
llama.cpp's GGUF names for llama and qwen2.
"""

from __future__ import annotations

import numpy as np

from specjax.arch import common
from specjax.config import HFFields, ModelConfig, eos_tuple

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
GGUF_ARCHS = ("llama", "qwen2")


def config_from_hf(f: HFFields, model_type: str) -> ModelConfig:
  h = f.req("num_attention_heads", lo=1)
  e = f.req("hidden_size", lo=1)
  n = f.req("num_hidden_layers", lo=1)
  common.check_heads(f, h, f.opt("num_key_value_heads", h, lo=1))
  act = f.opt("hidden_act", "silu", str)
  if act != "silu":
    raise f.error(f"unsupported hidden_act {act!r} (expected 'silu')")
  if f.raw("mlp_bias"):
    raise f.error("mlp_bias=True is not supported")
  theta, scaling = common.rope(f)
  window = f.opt("sliding_window", 0, lo=0)
  if model_type in ("qwen2", "qwen3") and not f.raw("use_sliding_window"):
    window = 0  # Qwen writes a sliding_window it does not use unless use_sliding_window
  windows = common.layer_windows(f, n, window) if window else ()
  if model_type in ("qwen2", "qwen3") and window and not windows:  # older configs: no layer_types
    first = f.opt("max_window_layers", n, lo=0)
    windows = tuple(window if i >= first else 0 for i in range(n))
  head_dim = f.opt("head_dim", 0, lo=0)
  if not head_dim and e % h:
    raise f.error(f"hidden_size = {e} is not a multiple of num_attention_heads = {h} (and no "
                  f"'head_dim' is given)")
  return ModelConfig(
      arch=model_type,
      **common.sizes(f, hidden=e, layers=n, heads=h, head_dim=head_dim or e // h,
                     max_positions=2048),
      norm_eps=f.opt("rms_norm_eps", 1e-6, float),
      qkv_bias=model_type == "qwen2" or bool(f.raw("attention_bias", False)),
      qk_norm=model_type == "qwen3",
      rope_theta=theta,
      rope_scaling=scaling,
      sliding_window=0 if windows else window,  # the same window in every layer (Mistral)
      layer_windows=windows,
      tie_word_embeddings=bool(f.raw("tie_word_embeddings", False)),
      **common.token_ids(f),
  )


def config_from_gguf(fields: dict, arch: str, source: str) -> ModelConfig:
  def f(key, default=None):
    return fields.get(f"{arch}.{key}", default)

  h = int(f("attention.head_count"))
  e = int(f("embedding_length"))
  vocab = f("vocab_size")
  if vocab is None:
    vocab = len(fields["tokenizer.ggml.tokens"])
  return ModelConfig(
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
      eos_token_ids=eos_tuple(fields.get("tokenizer.ggml.eos_token_id")),
      pad_token_id=fields.get("tokenizer.ggml.padding_token_id"),
  )


# llama.cpp's names -> HF's, so one converter serves both: whole-model tensors, then per layer
# (blk.i.<name> -> model.layers.i.<name>).
GGUF_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}


def gguf_permuted(cfg: ModelConfig) -> bool:
  """Whether llama.cpp stored q/k rows permuted for interleaved rope (its llama arch only)."""
  return cfg.arch == "llama"


def check_tensors(cfg: ModelConfig, src, where: str) -> str | None:
  """A message naming a tensor the config needs and the checkpoint lacks, before any is read."""
  if not cfg.tie_word_embeddings and not src.has("lm_head.weight"):
    return f"{where}: missing tensor 'lm_head.weight' (tie_word_embeddings is false)"
  return None


def params_from_hf(cfg: ModelConfig, src, prefix: str = "model.") -> dict:
  """HF names ([out, in] weights) -> specjax flat params (layouts: model.py)."""
  e, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
  out = {("embed",): src.get(prefix + "embed_tokens.weight", (v, e))}
  for i in range(cfg.num_layers):
    p, L = f"{prefix}layers.{i}.", ("layers", i)
    out.update(attention_params(cfg, src, p + "self_attn.", L + ("attn",)))
    gate = src.get(p + "mlp.gate_proj.weight", (f, e))
    up = src.get(p + "mlp.up_proj.weight", (f, e))
    out[L + ("mlp", "w_in")] = np.stack([gate, up], 0).transpose(2, 0, 1)  # [E,2,F]
    out[L + ("mlp", "w_out")] = src.get(p + "mlp.down_proj.weight", (e, f)).T  # [F,E]
    out[L + ("attn_norm", "scale")] = src.get(p + "input_layernorm.weight", (e,))
    out[L + ("mlp_norm", "scale")] = src.get(p + "post_attention_layernorm.weight", (e,))
  out[("final_norm", "scale")] = src.get(prefix + "norm.weight", (e,))
  if not cfg.tie_word_embeddings:
    out[("lm_head",)] = src.get("lm_head.weight", (v, e)).T  # [E,V]
  return out


def attention_params(cfg: ModelConfig, src, p: str, key: tuple, norm_shift: float = 0.0) -> dict:
  """One layer's HF self_attn.{q,k,v,o}_proj (+ biases, + q/k norms) -> {key + (name,): array}.
  norm_shift: added to the q/k norm weights (Gemma stores w for x * (1 + w))."""
  e, h, k, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  g = cfg.group_size
  q = src.get(p + "q_proj.weight", (h * d, e))
  kk = src.get(p + "k_proj.weight", (k * d, e))
  vv = src.get(p + "v_proj.weight", (k * d, e))
  out = {key + ("wqkv",): common.fuse_qkv(q, kk, vv, k, g, d)}  # [E,K,G+2,D]
  if cfg.qkv_bias:
    out[key + ("bqkv",)] = common.fuse_qkv_bias(
        src.get(p + "q_proj.bias", (h * d,)), src.get(p + "k_proj.bias", (k * d,)),
        src.get(p + "v_proj.bias", (k * d,)), k, g, d)  # [K,G+2,D]
  if cfg.qk_norm:
    out[key + ("q_norm", "scale")] = src.get(p + "q_norm.weight", (d,)) + norm_shift
    out[key + ("k_norm", "scale")] = src.get(p + "k_norm.weight", (d,)) + norm_shift
  out[key + ("wo",)] = src.get(p + "o_proj.weight", (e, h * d)).T.reshape(h, d, e)
  return out
