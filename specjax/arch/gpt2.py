"""GPT-2: LayerNorm, learned positions, biases everywhere, a plain tanh-GELU MLP, Conv1D weights
stored [in, out] with q | k | v fused in one c_attn."""

from __future__ import annotations

import numpy as np

from specjax.arch import common
from specjax.config import HFFields, ModelConfig

MODEL_TYPES = ("gpt2",)
GGUF_ARCHS = ()


def config_from_hf(f: HFFields, model_type: str) -> ModelConfig:
  e = f.req("n_embd", lo=1)
  h = f.req("n_head", lo=1)
  if e % h:
    raise f.error(f"n_embd = {e} is not a multiple of n_head = {h}")
  act = f.opt("activation_function", "gelu_new", str)
  if act not in ("gelu_new", "gelu_pytorch_tanh"):
    raise f.error(f"unsupported gpt2 activation_function {act!r}")
  if f.raw("scale_attn_by_inverse_layer_idx") or f.raw("reorder_and_upcast_attn"):
    raise f.error("gpt2 attention variants are not supported")
  return ModelConfig(
      arch="gpt2",
      vocab_size=f.req("vocab_size", lo=1),
      hidden_size=e,
      num_layers=f.req("n_layer", lo=1),
      num_heads=h,
      num_kv_heads=h,
      head_dim=e // h,
      intermediate_size=f.opt("n_inner", 4 * e, lo=1),
      max_position_embeddings=f.req("n_positions", lo=1),
      norm_eps=f.opt("layer_norm_epsilon", 1e-5, float),
      norm="layer",
      activation="gelu_new",
      gated_mlp=False,
      qkv_bias=True,
      out_bias=True,
      position="learned",
      tie_word_embeddings=bool(f.raw("tie_word_embeddings", True)),
      **common.token_ids(f),
  )


def check_tensors(cfg: ModelConfig, src, where: str) -> str | None:
  return None  # the head is always tied


def params_from_hf(cfg: ModelConfig, src) -> dict:
  """HF GPT-2 names (Conv1D weights are [in, out]) -> specjax flat params."""
  e, h, d, f, v = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
  pre = "transformer." if src.has("transformer.wte.weight") else ""
  out = {
      ("embed",): src.get(pre + "wte.weight", (v, e)),
      ("pos_embed",): src.get(pre + "wpe.weight", (cfg.max_position_embeddings, e)),
  }
  for i in range(cfg.num_layers):
    p = f"{pre}h.{i}."
    L = ("layers", i)
    w = src.get(p + "attn.c_attn.weight", (e, 3 * e)).reshape(e, 3, h, 1, d)  # q|k|v, head-major
    out[L + ("attn", "wqkv")] = np.concatenate([w[:, 0], w[:, 1], w[:, 2]], 2)  # [E,H,3,D]
    b = src.get(p + "attn.c_attn.bias", (3 * e,)).reshape(3, h, 1, d)
    out[L + ("attn", "bqkv")] = np.concatenate([b[0], b[1], b[2]], 1)  # [H,3,D]
    out[L + ("attn", "wo")] = src.get(p + "attn.c_proj.weight", (e, e)).reshape(h, d, e)
    out[L + ("attn", "bo")] = src.get(p + "attn.c_proj.bias", (e,))
    out[L + ("mlp", "w_in")] = src.get(p + "mlp.c_fc.weight", (e, f))[:, None, :]  # [E,1,F]
    out[L + ("mlp", "b_in")] = src.get(p + "mlp.c_fc.bias", (f,))[None, :]
    out[L + ("mlp", "w_out")] = src.get(p + "mlp.c_proj.weight", (f, e))
    out[L + ("mlp", "b_out")] = src.get(p + "mlp.c_proj.bias", (e,))
    for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
      out[L + (ours, "scale")] = src.get(p + theirs + ".weight", (e,))
      out[L + (ours, "bias")] = src.get(p + theirs + ".bias", (e,))
  out[("final_norm", "scale")] = src.get(pre + "ln_f.weight", (e,))
  out[("final_norm", "bias")] = src.get(pre + "ln_f.bias", (e,))
  if src.has("lm_head.weight"):  # tied: a saved copy equals wte; read it so it is accounted for
    src.get("lm_head.weight", (v, e))
  return out
