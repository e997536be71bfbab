"""What several families' config.json share: rope settings (old and new layouts), `layer_types`,
token ids; and the HF tensor-name helpers their converters share."""

from __future__ import annotations

import numpy as np

from specjax.config import ROPE_TYPES, HFFields, eos_tuple, rope_tuple

LAYER_TYPES = ("full_attention", "sliding_attention")


def rope(f: HFFields, params: dict | None = None, default_theta: float = 10000.0) -> tuple:
  """(rope_theta, ModelConfig.rope_scaling) from `rope_parameters` (transformers >= 5, rope_theta
  inside; or `params`, one entry of a per-layer-type dict) or the older top-level `rope_theta` and
  `rope_scaling`. An unsupported rope type is a ConfigError naming it."""
  raw = params if params is not None else (f.raw("rope_parameters") or f.raw("rope_scaling") or {})
  if not isinstance(raw, dict):
    raise f.error(f"field 'rope_parameters' = {raw!r} must be an object")
  d = dict(raw)
  theta = d.pop("rope_theta", None)
  theta = f.opt("rope_theta", default_theta, float) if theta is None else theta
  if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
    raise f.error(f"rope_theta = {theta!r} must be a number > 0")
  kind = d.get("rope_type", d.get("type", "default"))
  partial = d.pop("partial_rotary_factor", f.raw("partial_rotary_factor", 1.0))
  if partial != 1.0:
    raise f.error(f"partial_rotary_factor = {partial!r} is not supported (rope over the whole "
                  f"head only)")
  if kind not in ROPE_TYPES:
    why = (": dynamic NTK scaling changes every position's rope with the length of the sequence "
           "seen so far, so cached keys and a verification forward would disagree and no method "
           "could be exact against it" if kind == "dynamic" else "")
    raise f.error(f"unsupported rope type {kind!r} (rope_parameters / rope_scaling){why}; "
                  f"supported: {', '.join(ROPE_TYPES)}")
  need = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                            "original_max_position_embeddings")}.get(kind, ())
  for key in need:
    if isinstance(d.get(key), bool) or not isinstance(d.get(key), (int, float)):
      raise f.error(f"rope type {kind!r} needs a number {key!r}, got {d.get(key)!r}")
  return float(theta), (() if kind == "default" else rope_tuple(d))


def layer_windows(f: HFFields, num_layers: int, window: int) -> tuple[int, ...]:
  """`layer_types` (full_attention / sliding_attention per layer) -> per-layer windows (0 =
  global); () when the field is absent. Its length and entries are checked."""
  types = f.raw("layer_types")
  if types is None:
    return ()
  if not isinstance(types, list) or len(types) != num_layers:
    n = len(types) if isinstance(types, list) else type(types).__name__
    raise f.error(f"field 'layer_types' has {n} entries; num_hidden_layers = {num_layers}")
  bad = [t for t in types if t not in LAYER_TYPES]
  if bad:
    raise f.error(f"field 'layer_types' holds {bad[0]!r}; supported: {', '.join(LAYER_TYPES)}")
  if "sliding_attention" in types and not window:
    raise f.error("field 'layer_types' has sliding_attention layers but 'sliding_window' is not set")
  return tuple(window if t == "sliding_attention" else 0 for t in types)


def sizes(f: HFFields, *, hidden: int, layers: int, heads: int, head_dim: int,
          max_positions: int, kv_heads: int | None = None) -> dict:
  """ModelConfig's sizes from the fields llama-, gemma- and phi-style config.json files name
  alike (vocab, MLP width, key/value heads, context), with the ones a family reads its own way."""
  return dict(vocab_size=f.req("vocab_size", lo=1), hidden_size=hidden, num_layers=layers,
              num_heads=heads, head_dim=head_dim,
              num_kv_heads=f.opt("num_key_value_heads", heads, lo=1) if kv_heads is None else kv_heads,
              intermediate_size=f.req("intermediate_size", lo=1),
              max_position_embeddings=f.opt("max_position_embeddings", max_positions, lo=1))


def token_ids(f: HFFields) -> dict:
  return dict(bos_token_id=f.opt("bos_token_id", None), eos_token_ids=eos_tuple(f.raw("eos_token_id")),
              pad_token_id=f.opt("pad_token_id", None))


def split_heads(w: np.ndarray, k: int, g: int, d: int) -> np.ndarray:
  """An HF q/k/v projection's rows [n*D, ...] -> [K, n/K, D, ...] (n = G query or 1 kv heads)."""
  return w.reshape(k, g, d, *w.shape[1:])


def fuse_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray, kv_heads: int, group: int,
             d: int) -> np.ndarray:
  """HF q [H*D, E], k / v [K*D, E] ([out, in]) -> wqkv [E,K,G+2,D] (per kv head: G queries, k, v)."""
  qkv = np.concatenate([split_heads(q, kv_heads, group, d), split_heads(k, kv_heads, 1, d),
                        split_heads(v, kv_heads, 1, d)], 1)  # [K,G+2,D,E]
  return qkv.transpose(3, 0, 1, 2)


def fuse_qkv_bias(q: np.ndarray, k: np.ndarray, v: np.ndarray, kv_heads: int, group: int,
                  d: int) -> np.ndarray:
  """HF biases q [H*D], k / v [K*D] -> bqkv [K,G+2,D]."""
  return np.concatenate([q.reshape(kv_heads, group, d), k.reshape(kv_heads, 1, d),
                         v.reshape(kv_heads, 1, d)], 1)


def check_heads(f: HFFields, heads: int, kv_heads: int) -> None:
  if heads % kv_heads:
    raise f.error(f"num_attention_heads = {heads} is not a multiple of num_key_value_heads = "
                  f"{kv_heads}")


def mtp_layers(cfg: dict):
  """For an HF config.json declaring K = num_nextn_predict_layers > 0 MTP layers after its
  num_hidden_layers = L: a predicate selecting the tensors of layers L..L+K-1 (the only ones an
  MTP reader needs from a whole checkpoint, and the ones the target's loader leaves out); else
  None."""
  k, n = cfg.get("num_nextn_predict_layers"), cfg.get("num_hidden_layers")
  if not (isinstance(k, int) and isinstance(n, int) and k > 0 and n > 0):
    return None
  prefixes = tuple(f"model.layers.{n + i}." for i in range(k))
  return lambda name: name.startswith(prefixes)
