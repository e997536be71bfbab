"""EAGLE-3 heads (Li et al. 2025, as SafeAILab publishes them) as an nnx module, and their init.

Params (flat, leading [1]; specjax.drafters.layouts reads and writes the published files):
  "fuse_w" [1,3E,E]   fc (no bias) over cat(r_a, r_b, r_c), the RAW residual stream entering the
                      target's layers a, b, c = (2, L // 2, L - 3) (layouts.eagle3_taps; the target
                      runs with `Decoder(..., taps=, raw_taps=True)`; the final feature it returns
                      beside them is not read). Its output h is what the feature buffer holds.
  "norm_emb", "norm_hid" [1,E]   RMSNorm scales of the embedding and of h (input_layernorm,
                      hidden_norm); the layer's attention reads x = cat(norm_emb(emb), norm_hid(h))
                      [..,2E]: "layer.attn.wqkv" [1,2E,Kv,G+2,D], then h + attn is the residual,
                      and "layer.mlp_norm.scale", "layer.mlp.*" the MLP, as a Llama layer's.
  "norm" [1,E], "lm" [1,Vd,E]   the head's own final norm and LM head over its draft vocabulary
                      (vocab [Vd]: the target ids of its rows; None when Vd = V in order).
  "embed" [1,V,E]     optional: the head's own embedding (else the target's, shared).
Later draft depths feed the layer's output back as h, without the fc (as EAGLE-1/2 heads feed
their predicted feature back): the same contract as `eagle.FeatureLayer`, so the drafting, the
catch-up and the tree code are EAGLE's. The layer is a Llama layer whatever the target's family
(`midlayer_config`: no biases, qk-norms or post-norms), with the target's attention shapes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.drafters import layer as ly
from specjax.drafters.heads_file import Heads, HeadsConfig
from specjax.drafters.layouts import eagle3_taps
from specjax.model import rope_inv_freq


def midlayer_config(config):
  """The target's ModelConfig made a plain Llama layer's (EAGLE-3's midlayer: no biases, no
  qk-norms or post-norms, RMSNorm, SiLU-gated MLP, global attention), same shapes and rope."""
  return dataclasses.replace(config, qkv_bias=False, out_bias=False, qk_norm=False,
                             post_norms=False, norm="rms", activation="silu", gated_mlp=True,
                             attn_softcap=0.0, attn_scale=0.0, sliding_window=0, layer_windows=())


class Eagle3Head(nnx.Module):
  """An EAGLE-3 head over its arrays (`layer.module_arrays(params, 0)`)."""

  packs = False  # its layer runs on XLA's dot (2E inputs), never on the packed kernel
  own_vocab = True  # its logits are over its draft vocabulary, through its own LM head
  raw_taps = True  # its taps are the raw residual stream (Decoder(..., raw_taps=True))

  def __init__(self, heads_config, config, mod: dict):
    del heads_config  # (one shape: nothing to choose)
    self.config = midlayer_config(config)
    self.eps = self.config.norm_eps
    self.fuse_w = nnx.Param(mod["fuse_w"])
    self.norm_emb, self.norm_hid = nnx.Param(mod["norm_emb"]), nnx.Param(mod["norm_hid"])
    self.norm, self.lm = nnx.Param(mod["norm"]), nnx.Param(mod["lm"])
    # its layer's input norms are applied here, on the two halves of its input
    self.layer = ly.block(self.config, mod["layer"], mod["fuse_w"].dtype, input_norm=False)

  def fuse(self, feats):
    """feats [...,(n+1)E] (the three taps, then the final feature) -> the fc's output [...,E],
    over the taps only (not the final feature), no bias."""
    w = self.fuse_w[...]
    return jnp.dot(feats[..., :w.shape[0]].astype(w.dtype), w).astype(feats.dtype)

  def logits(self, h, target_logits=None):
    """Draft logits over the draft vocabulary: h [...,E] -> [...,Vd] float32, through the head's
    own final norm and LM head (never the target's)."""
    del target_logits
    return jnp.dot(ly.rms(h, self.norm[...], self.eps), self.lm[...].T).astype(jnp.float32)

  def __call__(self, emb, h, positions, layer_cache, start, mask):
    """h [B,T,E] is the fc output or a previous depth's output, emb [B,T,E]. x = cat(norm_emb(emb),
    norm_hid(h)) [B,T,2E] enters attention; h is the residual. Returns (out [B,T,E],
    layer_cache)."""
    h = h.astype(emb.dtype)
    x = jnp.concatenate([ly.rms(emb, self.norm_emb[...], self.eps),
                         ly.rms(h, self.norm_hid[...], self.eps)], axis=-1)  # [B,T,2E]
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(rope_inv_freq(self.config))
    block = self.layer
    y, layer_cache = block.attn(x, (jnp.cos(angles), jnp.sin(angles)), layer_cache, start, mask)
    h = h + y
    return h + block.mlp(block.mlp_norm(h)), layer_cache


def eagle3_shapes(target, draft_vocab: int | None = None, own_embed: bool = False) -> dict:
  """The flat tensor shapes of an EAGLE-3 head for `target`, with a draft vocabulary of
  draft_vocab ids (default V) and, own_embed, its own embedding."""
  c = target.config
  e = c.hidden_size
  out = {"fuse_w": (1, 3 * e, e), "norm_emb": (1, e), "norm_hid": (1, e), "norm": (1, e),
         "lm": (1, draft_vocab or c.vocab_size, e)}
  if own_embed:
    out["embed"] = (1, c.vocab_size, e)
  for name, shape in ly.layer_keys(midlayer_config(c)).items():
    if not name.startswith("layer.attn_norm."):
      out[name] = (1, 2 * e) + shape[1:] if name == "layer.attn.wqkv" else (1,) + shape
  return out


def init_eagle3_heads(target, *, seed: int = 0, scale: float = 0.0, vocab=None) -> Heads:
  """A fresh EAGLE-3 head for `target` (at least 7 layers): fc ~ N(0, 1 / 3E), the layer's
  weights N(0, 0.02^2) (q/k/v over 2E inputs), norms at one, the LM head the target's own rows
  for the draft vocabulary `vocab` (default: the whole vocabulary). scale > 0 multiplies every
  random weight by scale / 0.02 (tests)."""
  c = target.config
  taps = eagle3_taps(c.num_layers)
  ly.check_scale(scale)
  e = c.hidden_size
  ids = ly.check_vocab_ids(vocab, c.vocab_size)
  mult = scale / 0.02 if scale > 0 else 1.0
  key = jax.random.PRNGKey(seed)
  mod = {}
  for name, x in ly.block_params(midlayer_config(c), seed).items():
    if name.startswith("layer.attn_norm."):
      continue
    if name == "layer.attn.wqkv":  # [2E,Kv,G+2,D]: the layer reads 2E inputs
      x = 0.02 * jax.random.normal(jax.random.fold_in(key, 2), (2 * e,) + x.shape[1:])
    mod[name] = x if name.endswith("scale") else x * mult
  # [V,E], read where the target's weights are (a target sharded over processes: on its devices)
  lm = target.params["lm_head"][...].T if not c.tie_word_embeddings else target.params["embed"][...]
  lm = lm if ids is None else lm[jnp.asarray(ids)]
  mod.update(fuse_w=mult * jax.random.normal(jax.random.fold_in(key, 1), (3 * e, e), jnp.float32)
             / np.sqrt(3 * e), norm_emb=jnp.ones((e,)), norm_hid=jnp.ones((e,)),
             norm=jnp.ones((e,)), lm=jnp.asarray(lm, jnp.float32))
  dtype = getattr(target, "dtype", jnp.float32)
  params = {n: jnp.asarray(x)[None].astype(dtype) for n, x in mod.items()}
  cfg = HeadsConfig("eagle3", 1, 1, e, c.vocab_size, getattr(target, "name", ""),
                    0 if ids is None else int(ids.size), taps)
  return Heads(cfg, params, ids)
