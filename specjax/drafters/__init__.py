"""Drafter assets: specjax's own heads files and the published Medusa / EAGLE layouts, one layer.

    heads = sj.load_heads("medusa-vicuna-7b/", target)         # recognised from the files' contents
    logits = sj.head_logits(target, heads, tokens)             # teacher-forced, to measure heads
    export_heads(heads, "medusa", "out/", target)              # our heads in a published layout

`sj.load_heads` (specjax/heads.py) reads our .npz itself and hands directories, safetensors and
torch files to `layouts.read`, which recognises the layout from the tensor names and config fields
(layouts.LAYOUTS) and converts it to specjax's heads, computing exactly what the published
architecture computes: Medusa-1 heads with their own LM heads (params "lm" [K,V,E]) or the
target's; EAGLE-1/2 heads whose layer has no input norm (HeadsConfig.input_norm False); EAGLE-3
heads (kind "eagle3": fc over three target layers, their own LM head over a draft vocabulary). The
readers live in `layouts` (below specjax.heads, which imports them); this module, above both, holds
what needs the target: `head_logits` and `export_heads`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import cache as kv
from specjax.drafters import dflash, writers
from specjax.drafters.files import LAYOUTS
from specjax.errors import InputError
from specjax.heads import (Heads, check_fits, eagle3_logits, feature_module, fuse_features,
                           medusa_hidden, module_arrays, module_out)
from specjax.model import forward_sequence

FORMATS = ("medusa", "eagle", "eagle3", "dflash")  # export formats
SCORED = ("medusa", "eagle", "eagle3", "mtp", "dflash")  # head kinds head_logits scores

__all__ = ["FORMATS", "LAYOUTS", "export_files", "export_heads", "head_logits"]


def _check_tokens(tokens, vocab_size: int, least: int) -> np.ndarray:
  arr = np.asarray(tokens)
  if arr.ndim not in (1, 2) or not np.issubdtype(arr.dtype, np.integer) or arr.shape[-1] < least:
    raise InputError(f"tokens: expected token ids [T] or [B,T] with T >= {least}, got shape "
                     f"{arr.shape} dtype {arr.dtype}")
  if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
    raise InputError(f"tokens: ids must lie in [0, {vocab_size}), got {arr.min()}..{arr.max()}")
  return arr.astype(np.int32)


def _to_vocab(logits: jax.Array, vocab, v: int, subset: bool) -> jax.Array:
  """Logits over the heads' vocabulary -> [..., V]: a subset's scores at its ids (subset: the
  logits are [..., Vs]) or the full logits masked to it, -inf elsewhere."""
  if vocab is None:
    return logits
  ids = jnp.asarray(vocab)
  if subset:
    full = jnp.full(logits.shape[:-1] + (v,), -jnp.inf, jnp.float32)
    return full.at[..., ids].set(logits)
  keep = jnp.zeros((v,), bool).at[ids].set(True)
  return jnp.where(keep, logits, -jnp.inf)


def head_logits(target, heads: Heads, tokens) -> jax.Array:
  """Teacher-forced logits of `heads` on `target` over a token sequence, float32.

  tokens [T] (or [B,T], giving a leading B). Medusa: [T,K,V], head k at position t (its guess
  for token t + k + 2, reading the target's final-normed hidden state at t). EAGLE: [T-1,V], the
  first draft step at position t, from the target's feature at t and token t + 1 (its guess for
  token t + 2), attending causally over positions 0..t. EAGLE-3: [T-1,V] likewise, from the fc
  over the target's three tapped layers at t, through the head's own norm and LM head. MTP with
  K modules: [T-K,K,V], module k at position t reading token t + k + 1 and module k - 1's
  output at t (the target's feature for k = 0): its guess for token t + k + 2, as in
  DeepSeek-V3's training. DFlash with blocks of bs: [T-bs+1,bs-1,V], the block anchored at
  t (token t, then mask tokens; the context of positions < t) at offset j >= 1: its guess for
  token t + j. Tokens outside a heads' vocabulary subset (EAGLE-3: its draft vocabulary) get
  -inf.
  """
  if not isinstance(heads, Heads):
    raise InputError(f"heads={heads!r} is invalid: must be specjax Heads (sj.load_heads(...))")
  c = heads.config
  if c.kind not in SCORED:
    raise InputError(f"head_logits: heads of kind {c.kind!r}; it reads {', '.join(SCORED)}")
  check_fits(heads, target)
  least = {"medusa": 1, "eagle": 2, "eagle3": 2, "mtp": c.num_heads + 1,
           "dflash": getattr(c, "block_size", 0)}[c.kind]
  toks = _check_tokens(tokens, target.config.vocab_size, least)
  batched = toks.ndim == 2
  toks = jnp.asarray(toks if batched else toks[None])  # [B,T]
  vocab = None if heads.vocab is None else jnp.asarray(heads.vocab)
  out = _logits(target.params, heads.params, vocab, toks, graphdef=target.graphdef,
                config=target.config, heads_config=c, dtype=jnp.dtype(target.dtype).name)
  return out if batched else out[0]


@functools.partial(jax.jit, static_argnames=("graphdef", "config", "heads_config", "dtype"))
def _logits(params, p, vocab, toks, *, graphdef, config, heads_config, dtype):
  """head_logits' computation, one compiled program per shape: toks [B,T] -> [B,T,K,V] (Medusa)
  or [B,T-1,V] (EAGLE)."""
  dec = nnx.merge(graphdef, params)
  _, hidden, _ = forward_sequence(config, dec, toks, dtype=jnp.dtype(dtype),
                                  taps=heads_config.taps,
                                  raw_taps=heads_config.kind in ("eagle3", "dflash"))
  v = config.vocab_size
  if heads_config.kind == "dflash":
    return _dflash_logits(dec, p, heads_config, toks, hidden)
  if heads_config.kind == "medusa":
    z = medusa_hidden(p, hidden)  # [B,T,K,E]
    if "lm" in p:
      return _to_vocab(jnp.einsum("btke,kve->btkv", z, p["lm"]).astype(jnp.float32), vocab, v,
                       True)
    return _to_vocab(dec.head(z), vocab, v, False)
  if heads_config.kind == "mtp":
    return _to_vocab(_mtp_logits(config, dec, p, toks, hidden, jnp.dtype(dtype)), vocab, v, False)
  h = _eagle_features(config, dec, p, toks, hidden, jnp.dtype(dtype))
  if heads_config.kind == "eagle3":  # its own norm and LM head over the draft vocabulary
    return _to_vocab(eagle3_logits(module_arrays(p, 0), h, config.norm_eps), vocab, v, True)
  return _to_vocab(dec.head(h), vocab, v, False)


def _eagle_features(cfg, dec, params, toks, hidden, dtype) -> jax.Array:
  """The EAGLE module's outputs [B,T-1,E] over positions 0..T-2 (token t + 1, feature t)."""
  b, t = toks.shape
  n = t - 1
  mod = module_arrays(params, 0)
  feats = fuse_features(mod, hidden[:, :-1])  # [B,n,E]
  emb = mod.get("embed", dec.embed[...])[toks[:, 1:]]  # [B,n,E] (EAGLE-3: its own, if any)
  layer = kv.init(1, b, n, cfg.num_kv_heads, cfg.head_dim, dtype).layers[0]
  start = jnp.zeros((b,), jnp.int32)
  mask = kv.causal_mask(start, n, n, cfg.sliding_window)  # [B,n,n]
  pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
  out, _ = feature_module(cfg, mod, emb, feats, pos, layer, start, mask)
  return out


def _dflash_logits(dec, params, c, toks, hidden) -> jax.Array:
  """A DFlash drafter's block logits [B,T-bs+1,bs-1,V], one block anchored at every position."""
  b, t = toks.shape
  anchors = jnp.broadcast_to(jnp.arange(t - c.block_size + 1, dtype=jnp.int32),
                             (b, t - c.block_size + 1))
  feats = hidden[..., :len(c.target_layer_ids) * c.hidden_size]
  h = dflash.anchored_hidden(dflash.drafter(c, params), dec.embed[...], toks, feats, anchors,
                             c.block_size, c.mask_token_id)
  return dec.head(h[:, :, 1:])


def _mtp_logits(cfg, dec, params, toks, hidden, dtype) -> jax.Array:
  """The MTP modules' logits [B,T-K,K,V] over positions 0..T-K-1, teacher-forced."""
  b, t = toks.shape
  k_all = params["fc_w"].shape[0]
  n = t - k_all
  h = hidden[:, :n]
  layer = kv.init(1, b, n, cfg.num_kv_heads, cfg.head_dim, dtype).layers[0]
  start = jnp.zeros((b,), jnp.int32)
  mask = kv.causal_mask(start, n, n, cfg.sliding_window)
  pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
  out = []
  for k in range(k_all):
    mod = module_arrays(params, k)
    h, _ = feature_module(cfg, mod, dec.embed[...][toks[:, k + 1:k + 1 + n]], h, pos, layer,
                          start, mask)
    normed = module_out(cfg, mod, h)
    out.append(dec.head(dec.final_norm(h) if normed is None else normed).astype(jnp.float32))
  return jnp.stack(out, axis=2)


def export_heads(heads: Heads, fmt: str, out_dir: str, target=None) -> str:
  """Writes `heads` to out_dir in a published layout: "dflash" (z-lab's DFlash: Qwen3
  config.json with dflash_config + model.safetensors), "medusa" (FasterDecoding's Medusa-1:
  config.json + medusa_lm_head.safetensors), "eagle" (SafeAILab's EAGLE-1/2: Llama config.json
  + model.safetensors; needs `target` for its rope and norm settings) or "eagle3" (SafeAILab's
  EAGLE-3, likewise, with d2t / t2d). Returns out_dir."""
  if not isinstance(heads, Heads):
    raise InputError(f"heads={heads!r} is invalid: must be specjax Heads")
  if fmt not in FORMATS:
    raise InputError(f"format={fmt!r} is invalid: must be one of {', '.join(FORMATS)}")
  c = heads.config
  if c.kind != fmt:
    raise InputError(f"format={fmt!r}, but these are {c.kind} heads")
  fields = dataclasses.asdict(c)
  params = {k: np.asarray(x) for k, x in heads.params.items()}
  if fmt == "dflash":  # z-lab's layout: config.json + model.safetensors
    return writers.save(*dflash.to_published(c, params), out_dir, "model.safetensors")
  if fmt == "medusa":
    return writers.write_medusa(fields, params, heads.vocab, out_dir)
  if target is None:
    raise InputError(f"export --format {fmt} needs the target (its rope and norm settings go "
                     f"into the head's config.json)")
  check_fits(heads, target)
  if fmt == "eagle3":
    return writers.write_eagle3(fields, params, heads.vocab, out_dir, target.config)
  return writers.write_eagle(fields, params, heads.vocab, out_dir, target.config)


def export_files(heads: str, fmt: str, out_dir: str, model: str | None = None) -> str:
  """`specjax export --format medusa|eagle|eagle3|dflash HEADS OUT_DIR [--model M]`: heads from a file, a
  directory or a shipped name, written in a published layout. The target (`model`, else the one
  the heads were made for) is loaded for EAGLE / EAGLE-3, whose config.json carries its rope and
  norm settings, and for any heads when `model` is given (to check they fit it)."""
  from specjax.heads import load_heads
  from specjax.weights import load_model

  if fmt not in FORMATS:
    raise InputError(f"--format {fmt!r} is invalid: must be one of {', '.join(FORMATS)}")
  target = None
  if model is None and fmt in ("eagle", "eagle3"):
    model = load_heads(heads).config.target or None
    if model is None:
      raise InputError(f"{heads}: the heads do not name their target; pass --model")
  if model is not None:
    target = load_model(model, tokenizer=False)
  return export_heads(load_heads(heads, target), fmt, out_dir, target)
