"""Writing specjax heads in the published layouts that specjax.drafters.layouts reads (export):

    write_medusa(fields, params, vocab, out_dir)                  # FasterDecoding's Medusa-1
    write_eagle(fields, params, vocab, out_dir, target_config)    # SafeAILab's EAGLE-1/2
    write_eagle3(fields, params, vocab, out_dir, target_config)   # SafeAILab's EAGLE-3
    save(tensors, config, out_dir, file)                          # safetensors + config.json

Tensors are written [out, in] as torch's nn.Linear stores them (ours are [in, out]); the layouts
themselves are described in layouts.py, beside their readers.
"""

from __future__ import annotations

import json
import os

import numpy as np

from specjax.errors import InputError



def save(tensors_: dict, config: dict, out_dir: str, file: str) -> str:
  from safetensors.numpy import save_file

  os.makedirs(out_dir, exist_ok=True)
  arrays = {}
  for k, x in tensors_.items():
    x = np.asarray(x)
    if x.dtype not in (np.float16, np.float32, np.int64, np.int32, np.bool_):
      x = x.astype(np.float32)  # bfloat16 and the like: exact in float32
    arrays[k] = np.ascontiguousarray(x)
  save_file(arrays, os.path.join(out_dir, file))
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  return out_dir


def write_medusa(fields: dict, params: dict, vocab, out_dir: str) -> str:
  """Medusa heads -> FasterDecoding's Medusa-1 layout (config.json + medusa_lm_head.safetensors).
  Heads without their own LM heads are written without "{i}.{L}.weight" (the target's is used)."""
  if vocab is not None:
    raise InputError("export --format medusa: these heads score a vocabulary subset, which the "
                     "Medusa-1 layout cannot express; train heads over the whole vocabulary")
  w, b = np.asarray(params["w"]), np.asarray(params["b"])  # [K,L,E,E] (ours: [in, out]), [K,L,E]
  k, layers = w.shape[:2]
  out = {}
  for i in range(k):
    for j in range(layers):
      out[f"{i}.{j}.linear.weight"] = w[i, j].T
      out[f"{i}.{j}.linear.bias"] = b[i, j]
    if "lm" in params:
      out[f"{i}.{layers}.weight"] = np.asarray(params["lm"][i])
  config = {"medusa_num_heads": k, "medusa_num_layers": layers,
            "base_model_name_or_path": fields.get("target", ""),
            "hidden_size": fields["hidden_size"], "vocab_size": fields["vocab_size"]}
  return save(out, config, out_dir, "medusa_lm_head.safetensors")


def write_eagle(fields: dict, params: dict, vocab, out_dir: str, target_config) -> str:
  """An EAGLE head -> SafeAILab's EAGLE-1/2 layout (Llama config.json + model.safetensors). Only
  heads of the published architecture (no input norm on the layer, no fused taps, the whole
  vocabulary) can be written: anything else would compute something else when read back."""
  tc = target_config
  if fields.get("input_norm", True) or fields.get("taps") or vocab is not None:
    what = ("normalise their layer's input" if fields.get("input_norm", True) else
            "fuse several target layers" if fields.get("taps") else "score a vocabulary subset")
    raise InputError(f"export --format eagle: these heads {what}; the EAGLE-1/2 architecture "
                     f"does not, so the published loaders would compute something else")
  x = {n: np.asarray(a)[0] for n, a in params.items()}
  wqkv = x["layer.attn.wqkv"]  # [E,Kv,G+2,D]
  e, kv, g2, d = wqkv.shape
  g = g2 - 2
  p = "layers.0."
  out = {"fc.weight": x["fc_w"].T, "fc.bias": x["fc_b"], **_hf_layer(x, p)}
  if "layer.attn.bqkv" in x:
    bq = x["layer.attn.bqkv"]  # [Kv,G+2,D]
    out.update({p + "self_attn.q_proj.bias": bq[:, :g].reshape(-1),
                p + "self_attn.k_proj.bias": bq[:, g].reshape(-1),
                p + "self_attn.v_proj.bias": bq[:, g + 1].reshape(-1)})
  config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": e, "intermediate_size": int(x["layer.mlp.w_out"].shape[0]),
            "num_attention_heads": kv * g, "num_key_value_heads": kv, "head_dim": d,
            "num_hidden_layers": 1, "vocab_size": fields["vocab_size"], "bias": True,
            "qkv_bias": "layer.attn.bqkv" in x, "rms_norm_eps": tc.norm_eps,
            "rope_theta": tc.rope_theta, "max_position_embeddings": tc.max_position_embeddings,
            "rope_scaling": dict(tc.rope_scaling) or None, "tie_word_embeddings": False}
  return save(out, config, out_dir, "model.safetensors")


def _hf_layer(x: dict, p: str) -> dict:
  """One of our feature-module layers ("layer.attn.wqkv" [In,Kv,G+2,D], ...) as an HF Llama
  decoder layer's tensors under prefix p ([out, in]; In is E, or 2E for EAGLE-3's midlayer)."""
  wqkv = x["layer.attn.wqkv"]
  n_in, kv, g2, d = wqkv.shape
  g, e = g2 - 2, x["layer.attn.wo"].shape[-1]
  qkv = wqkv.transpose(1, 2, 3, 0)  # [Kv,G+2,D,In]
  return {p + "self_attn.q_proj.weight": qkv[:, :g].reshape(kv * g * d, n_in),
          p + "self_attn.k_proj.weight": qkv[:, g].reshape(kv * d, n_in),
          p + "self_attn.v_proj.weight": qkv[:, g + 1].reshape(kv * d, n_in),
          p + "self_attn.o_proj.weight": x["layer.attn.wo"].reshape(kv * g * d, e).T,
          p + "mlp.gate_proj.weight": x["layer.mlp.w_in"][:, 0].T,
          p + "mlp.up_proj.weight": x["layer.mlp.w_in"][:, 1].T,
          p + "mlp.down_proj.weight": x["layer.mlp.w_out"].T,
          p + "post_attention_layernorm.weight": x["layer.mlp_norm.scale"]}


def write_eagle3(fields: dict, params: dict, vocab, out_dir: str, target_config) -> str:
  """An EAGLE-3 head -> SafeAILab's EAGLE-3 layout (Llama config.json + model.safetensors, d2t
  int64 and t2d bool; the embedding only if the head has its own)."""
  tc = target_config
  x = {n: np.asarray(a)[0] for n, a in params.items()}
  wqkv = x["layer.attn.wqkv"]  # [2E,Kv,G+2,D]
  e2, kv, g2, d = wqkv.shape
  g, e = g2 - 2, e2 // 2
  lm = x["lm"]  # [Vd,E]
  vd, v = lm.shape[0], fields["vocab_size"]
  ids = np.arange(vd, dtype=np.int64) if vocab is None else np.asarray(vocab, np.int64)
  t2d = np.zeros(v, bool)
  t2d[ids] = True
  p = "midlayer."
  out = {"fc.weight": x["fuse_w"].T,
         p + "input_layernorm.weight": x["norm_emb"], p + "hidden_norm.weight": x["norm_hid"],
         **_hf_layer(x, p),
         "norm.weight": x["norm"], "lm_head.weight": lm,
         "d2t": ids - np.arange(vd, dtype=np.int64), "t2d": t2d}
  if "embed" in x:
    out["embed_tokens.weight"] = x["embed"]
  config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_act": "silu", "hidden_size": e,
            "intermediate_size": int(x["layer.mlp.w_out"].shape[0]),
            "num_attention_heads": kv * g, "num_key_value_heads": kv, "head_dim": d,
            "num_hidden_layers": 1, "vocab_size": v, "draft_vocab_size": vd,
            "rms_norm_eps": tc.norm_eps, "rope_theta": tc.rope_theta,
            "max_position_embeddings": tc.max_position_embeddings,
            "rope_scaling": dict(tc.rope_scaling) or None, "tie_word_embeddings": False,
            "torch_dtype": "float32"}
  return save(out, config, out_dir, "model.safetensors")
