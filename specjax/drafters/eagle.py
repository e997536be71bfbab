"""EAGLE-1/2 heads (Li et al. 2024) as an nnx module, and their init; MTP's modules build on it.

Module k reads (the embedding of a token, a feature) at one position i and writes a feature:

  EAGLE:   x = [emb(x_{i+1}), f_i] W_fc + b_fc  -> one decoder layer -> f^_{i+1}
  MTP:     x = [RMSNorm_e(emb(x_{i+k+1})), RMSNorm_h(h^k_i)] W_fc + b_fc -> one decoder layer
           -> h^{k+1}_i   (specjax/drafters/mtp.py)

f_i is the target's feature at position i: its last hidden state after the final norm (what
its LM head reads, HF's `last_hidden_state`: the tensor EAGLE-1's released code regresses and
feeds its heads). EAGLE's output is a predicted feature, read by the target's LM head as it is;
an MTP module's output is a residual stream, read through the target's final norm and LM head.
The layer is the target's own `Block` type (same shapes, its own static KV cache). Embedding,
final norm and LM head are the target's, frozen and shared: heads hold none of them.

Params (flat, every tensor with a leading [K]; EAGLE: K = 1): "fc_w" [K,2E,E], "fc_b" [K,E], the
layer's tensors under "layer." + the target Block's own path, e.g. "layer.attn.wqkv"
[K,E,Kv,G+2,D] (without "layer.attn_norm.*" for published EAGLE-1/2 heads, whose layer puts no
norm on its input: HeadsConfig.input_norm False).

Fused features (EAGLE-3's idea, Li et al. 2025: a low, a middle and the high layer's states rather
than the last one alone): an EAGLE head with `taps` = (i, j, ...) reads, instead of the target's
final-normed feature f_t, g_t = fuse_w^T [r_i(t); r_j(t); ...; f_t] + fuse_b, where r_i is the
residual stream after the target's first i layers, RMS-normalised without a scale (so a middle
layer's large activations enter on the same scale as f). "fuse_w" [1,(n+1)E,E], "fuse_b" [1,E].
Initialised (and grown from an unfused head, `add_taps`) as the identity on f and zero on the taps,
so such a head starts out computing exactly what the unfused one does. Only the first draft depth
reads g; deeper ones read the head's own outputs, as before. The target runs with
`Decoder(..., taps=)`, which returns the taps beside f.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.drafters import layer as ly
from specjax.drafters.heads_file import Heads, HeadsConfig
from specjax.errors import InputError, check_int
from specjax.kernels import dense
from specjax.packing import Packed


class FeatureLayer(nnx.Module):
  """A linear 2E -> E over [embedding, feature], then one target Block: what EAGLE's head and
  each MTP module run. Built over one module's arrays (`layer.module_arrays`, `pack_module`'s
  copies included) inside the program that calls it."""

  packs = True  # its dense products may run on the packed kernel (layer.pack_module)
  norms = ()  # the names of its own [K,E] input norm scales
  own_vocab = False  # its logits are the target's LM head's (over V, or a subset's rows)
  raw_taps = False  # fused taps are read RMS-normalised (Decoder(..., taps=))

  def __init__(self, heads_config, config, mod: dict):
    packed = mod.get("packed", {})  # pack_module's copies, if the target runs on the kernel
    self.config = config
    self.fc_w, self.fc_b = nnx.Param(mod["fc_w"]), nnx.Param(mod["fc_b"])
    self.fc_packed = Packed(packed["fc_w"]) if "fc_w" in packed else None
    self.layer = ly.block(config, mod["layer"], mod["fc_w"].dtype, packed,
                          heads_config.input_norm)

  def inputs(self, emb, feat):
    """The fc's two inputs (EAGLE: as they are)."""
    return emb, feat

  def fuse(self, feats):
    """feats [...,E]: the target's final feature, which an unfused head reads as it is."""
    return feats

  def logits(self, h, target_logits):
    """Draft logits from the module's output h [...,E]: the target's LM head's (`target_logits`)."""
    return target_logits(h)

  def __call__(self, emb, feat, positions, layer_cache, start, mask):
    """emb [B,T,E] token embeddings; feat [B,T,E] features (EAGLE) or the previous module's
    outputs (MTP); positions [B,T]; layer_cache {k,v: [B,Kv,S,D]}; start [B]: the slot of the
    first new entry; mask [B,T,S]. Returns (out [B,T,E], layer_cache)."""
    emb, feat = self.inputs(emb, feat)
    packed = None if self.fc_packed is None else self.fc_packed[...]
    x = dense(jnp.concatenate([emb, feat.astype(emb.dtype)], axis=-1), self.fc_w[...],
              packed) + self.fc_b[...]
    return self.layer(x, ly.rope(self.config, positions), layer_cache, start, mask)


class EagleLayer(FeatureLayer):
  """An EAGLE-1/2 head, reading fused features when it has taps (the module docstring)."""

  kind = "eagle"
  modules = (1, 1, " (an EAGLE head is one module)")  # (default, most, why) modules per head

  def __init__(self, heads_config, config, mod: dict):
    super().__init__(heads_config, config, mod)
    fused = bool(heads_config.taps)
    self.fuse_w = nnx.Param(mod["fuse_w"]) if fused else None
    self.fuse_b = nnx.Param(mod["fuse_b"]) if fused else None
    packed = mod.get("packed", {})
    self.fuse_packed = Packed(packed["fuse_w"]) if fused and "fuse_w" in packed else None

  def fuse(self, feats):
    """feats [...,(n+1)E] (the taps, then the final feature; Decoder(..., taps=)) -> the fused
    feature [...,E]; feats unchanged for heads without taps. On the kernel where pack_module
    packed fuse_w (the accepted tokens' features, a few rows a round)."""
    if self.fuse_w is None:
      return feats
    w = self.fuse_w[...]
    packed = None if self.fuse_packed is None else self.fuse_packed[...]
    return (dense(feats.astype(w.dtype), w, packed) + self.fuse_b[...]).astype(feats.dtype)


def check_taps(taps, num_layers: int | None = None) -> tuple:
  """taps -> a tuple of distinct increasing ints in [1, num_layers): the target layers whose outputs
  an EAGLE head fuses ("after the first i layers"); "auto" = (2, num_layers // 2), a low and a
  middle layer beside the last (EAGLE-3's choice)."""
  if isinstance(taps, str):
    if taps != "auto":
      try:
        taps = tuple(int(x) for x in taps.split(",") if x.strip())
      except ValueError:
        raise InputError(f"taps={taps!r} is invalid: give layer counts such as '2,15' or 'auto'")
    elif num_layers is None:
      raise InputError("taps='auto' needs the target's layer count")
    else:
      taps = (min(2, num_layers - 1), num_layers // 2)
  try:
    taps = tuple(taps)
  except TypeError:
    raise InputError(f"taps={taps!r} is invalid: a sequence of layer counts such as (2, 15)")
  if any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in taps):
    raise InputError(f"taps={taps!r} is invalid: layer counts must be integers")
  taps = tuple(int(i) for i in taps)
  hi = num_layers - 1 if num_layers is not None else None
  if (any(i < 1 for i in taps) or list(taps) != sorted(set(taps))
      or (hi is not None and any(i > hi for i in taps))):
    raise InputError(f"taps={taps!r} is invalid: distinct increasing layer counts in [1, "
                     f"{hi if hi is not None else 'num_layers - 1'}] (the residual stream after "
                     f"that many of the target's layers; the last layer's feature is always read)")
  return taps


def _fuse_identity(e: int, n: int, key=None, mult: float = 0.0) -> jax.Array:
  """fuse_w [(n+1)E,E]: zero on the n taps and the identity on the final feature; mult > 0 adds a
  N(0, mult^2 / ((n+1)E)) draw everywhere (tests: taps that matter)."""
  w = jnp.concatenate([jnp.zeros((n * e, e), jnp.float32), jnp.eye(e, dtype=jnp.float32)])
  if mult:
    w = w + mult * jax.random.normal(key, w.shape, jnp.float32) / np.sqrt((n + 1) * e)
  return w


def add_taps(heads: Heads, taps, target) -> Heads:
  """An unfused EAGLE head -> the same head reading fused features from `taps`, with fuse_w the
  identity on the final feature (so its drafts are unchanged until the fuse is trained)."""
  c = heads.config
  if c.kind != "eagle":
    raise InputError(f"taps: fused features are for EAGLE heads, not {c.kind}")
  taps = check_taps(taps, target.config.num_layers)
  if c.taps:
    if c.taps == taps:
      return heads
    raise InputError(f"these EAGLE heads already fuse taps {list(c.taps)}; asked for {list(taps)}")
  if not taps:
    return heads
  e = c.hidden_size
  dtype = heads.params["fc_w"].dtype
  params = dict(heads.params, fuse_w=_fuse_identity(e, len(taps))[None].astype(dtype),
                fuse_b=jnp.zeros((1, e), dtype))
  return dataclasses.replace(heads, config=dataclasses.replace(c, taps=taps), params=params)


def feature_shapes(module_type, num_heads: int, target, taps=(), input_norm: bool = True,
                   out_norm: bool = False) -> dict:
  """The flat tensor shapes of K = num_heads modules of `module_type` (EagleLayer, MtpModule) for
  `target` (input_norm False: without the layer's input norm, see HeadsConfig); out_norm: MTP
  modules with their own output norm "norm_o" [K,E] in place of the target's final norm, as
  DeepSeek-V3's published MTP layers have."""
  c = target.config
  e, k = c.hidden_size, num_heads
  out = {"fc_w": (k, 2 * e, e), "fc_b": (k, e)}
  if taps:
    out.update(fuse_w=(k, (len(taps) + 1) * e, e), fuse_b=(k, e))
  out.update({name: (k, e) for name in module_type.norms})
  if out_norm:
    out.update(norm_o=(k, e))
  out.update({name: (k,) + shape for name, shape in ly.layer_keys(c).items()
              if input_norm or not name.startswith("layer.attn_norm.")})
  return out


def _module_params(target, module_type, k, seed, scale, taps, input_norm) -> dict:
  """Module k's fresh tensors by flat name, float32 (see `init_modules`)."""
  c = target.config
  e = c.hidden_size
  mult = scale / 0.02 if scale > 0 else 1.0
  layer = {n: (x if n.endswith("scale") or n.endswith("bias") or ".b" in n else x * mult)
           for n, x in ly.block_params(c, seed * 1000 + k).items()
           if input_norm or not n.startswith("layer.attn_norm.")}
  kf = jax.random.fold_in(jax.random.PRNGKey(seed), k)
  mod = {"fc_w": mult * jax.random.normal(kf, (2 * e, e), jnp.float32) / np.sqrt(2 * e),
         "fc_b": jnp.zeros((e,), jnp.float32)}
  mod.update({name: jnp.ones((e,), jnp.float32) for name in module_type.norms})
  if taps:
    mod.update(fuse_w=_fuse_identity(e, len(taps), jax.random.fold_in(kf, 1),
                                     mult if scale > 0 else 0.0),
               fuse_b=jnp.zeros((e,), jnp.float32))
  mod.update(layer)
  return mod


def init_modules(module_type, target, *, num_heads: int | None = None, num_layers: int = 1,
                 seed: int = 0, scale: float = 0.0, vocab=None, taps=(),
                 input_norm: bool = True) -> Heads:
  """Heads of num_heads modules of `module_type` (EagleLayer: one; MtpModule: default 2) for
  `target`: fc ~ N(0, 1 / 2E), the layer as a fresh target Block (N(0, 0.02^2) weights, unit
  norms), the module's own norms at one; with taps (EAGLE): fuse_w the identity on the final
  feature (`add_taps`). scale > 0 multiplies every random weight by scale / 0.02 (tests), and
  then also draws fuse_w's taps."""
  kind = module_type.kind
  num_heads = module_type.modules[0] if num_heads is None else num_heads
  check_int("num_heads", num_heads, 1, module_type.modules[1], module_type.modules[2])
  check_int("num_layers", num_layers, 1, 1, f" ({kind} modules have one decoder layer)")
  taps = check_taps(taps, target.config.num_layers)  # (EAGLE only: init_heads checked)
  ly.check_scale(scale)
  c = target.config
  ids = ly.check_vocab_ids(vocab, c.vocab_size)
  dtype = getattr(target, "dtype", jnp.float32)
  mods = [_module_params(target, module_type, k, seed, scale, taps, input_norm)
          for k in range(num_heads)]
  params = {n: jnp.stack([m[n] for m in mods]).astype(dtype) for n in mods[0]}
  cfg = HeadsConfig(kind, num_heads, 1, c.hidden_size, c.vocab_size, getattr(target, "name", ""),
                    0 if ids is None else int(ids.size), taps, input_norm)
  return Heads(cfg, params, ids)
