"""Flax NNX decoder driven by ModelConfig alone (families' differences are its fields; the
families themselves: specjax/arch/).

    (tokens [B,T], positions [B,T], cache, mask [B,T,S]) -> (logits [B,T,V], hidden [B,T,E], cache)

The new tokens' K/V are written into the cache at slots [cache.lengths, cache.lengths + T) before
attention, and every query attends the whole static cache through `mask`: a causal chain, a tree
of candidates or a lookahead window are all just masks. A layer's sliding window is intersected
with that mask inside the model, from the tokens' positions (`attention_mask`), so callers'
masks never depend on the layer. `cache.lengths` is not moved; the decoding
method decides which of the written entries to keep (see cache.py).

Layout choices (measured on a 2-core CPU, see README "Performance"): layers are a Python list
(unrolled under jit, one cache buffer per layer updated in place; a lax.scan over stacked layers
copied the carried caches and ran slower: docs/performance.md), Q/K/V are one fused matmul
with weight [E, K, G+2, D] grouped by kv head (so splitting axis K over a mesh keeps each query
head with its kv head), and gate/up are one matmul [E, 2, F]. Every matmul goes through
`kernels.dense`: XLA's dot, or, for a model packed at load (`load_model(kernels=...)`), a
weight-streaming CPU kernel over packed copies carried in params as `packed_*` variables (which
weights, and how: specjax/packing.py; the kernel: specjax/kernels/matmul.py).

Arithmetic. The weights and the KV cache are held in the model's dtype; the residual stream, the
norms, rope and the MLP's activation are float32 at every dtype, as llama.cpp runs a BF16 or F16
GGUF. A bf16 model's products take their activations rounded to bf16 and give float32 sums
(`kernels.dense`), and its new K/V entries are rounded to the cache's bf16 before attention
reads them, so a T-token call's rows see them as later calls see them in the cache. Rounding
every element-wise step to bf16 instead cost a 16-token forward of SmolLM2 ~4 ms of 16 in
XLA's CPU converts (about a cycle an element each), for no accuracy gained.
"""

from __future__ import annotations

import math
from functools import partial


import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import cache as kv
from specjax.config import ModelConfig
from specjax.kernels import dense
from specjax.kernels.attention import attend
from specjax.kernels.reduce import fixed_mean


def _packed(module, name):
  """The load-time packed copy of a dense weight for the kernel (specjax/packing.py), a quantized
  copy (a quantized self-draft's, specjax/methods/quantized.py: a pytree, hence get_value), or
  None."""
  v = getattr(module, "packed_" + name, None)
  return None if v is None else v.get_value()


def normed_dense(norm, x, w, packed):
  """dense(norm(x), w, packed) (norm None: no norm), with the norm inside the product's kernel
  call where the weight is in blocks on the integer-dot kernel (a W4A8 target, a quantized
  self-draft's copy) and the norm is an RMSNorm over float32 rows: one operation where XLA ran
  six (the norm's squares, tree and scaling, ~0.5 ms of a W4A8 one-token forward of SmolLM2).
  The kernel's norm rounds each step once (kernels/qdot.py, norm_reference), so a row's
  activations are the same whatever rows share the call."""
  if (isinstance(norm, Norm) and norm.kind != "layer" and x.dtype == jnp.float32
      and callable(getattr(packed, "product", None))
      and getattr(packed, "packed", None) is not None):
    y = packed.product(x, norm=(norm.scale[...], norm.eps))
    return y.astype(x.dtype).reshape(*x.shape[:-1], *w.shape[1:])
  return dense(x if norm is None else norm(x), w, packed)  # (norm: a Norm, or any function)


def rope_inv_freq(cfg: ModelConfig, layer: int | None = None) -> np.ndarray:
  """[D/2] inverse frequencies of layer `layer` (None: the global layers' rope; see
  ModelConfig.rope), with linear or llama3 scaling applied (as HF computes them)."""
  d = cfg.head_dim
  theta, scaling = cfg.rope(layer)
  inv = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
  rs = dict(scaling)
  kind = rs.get("rope_type", "default")
  if kind == "linear":
    inv = inv / rs["factor"]
  elif kind == "llama3":
    factor = rs["factor"]
    low, high = rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    inv = np.where(medium, smoothed, scaled)
  return inv.astype(np.float32)


def _once(cos: jax.Array, sin: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(cos, sin) as values XLA computes once per forward.

  Left alone, XLA's CPU compiler fuses the two tables into every layer's rotation and evaluates
  cos and sin again for each element of each layer's queries and keys, which costs far more than
  the rotations themselves (measured: docs/performance.md). A fusion cannot reach into a
  conditional's branch, and an optimization barrier does not survive to fusion on the CPU, hence
  the conditional. Its predicate is true for every real position (positions are >= 0); the other
  branch returns the same values (x + 0.0 only turns a -0.0 into +0.0, and neither table holds a
  -0.0 for a position >= 0), so the result is the same whichever branch runs, and bit-identical
  to the fused form."""
  return jax.lax.cond(jnp.any(positions >= 0), lambda cs: cs,
                      lambda cs: (cs[0] + 0.0, cs[1] + 0.0), (cos, sin))


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [B,T,...,D]; cos, sin [B,T,D/2]. Half-split (rotate_half) convention, as HF Llama."""
  half = x.shape[-1] // 2
  extra = x.ndim - 3
  cos = cos.reshape(cos.shape[:2] + (1,) * extra + cos.shape[-1:])
  sin = sin.reshape(sin.shape[:2] + (1,) * extra + sin.shape[-1:])
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def rms_unit(x: jax.Array, eps: float) -> jax.Array:
  """x / rms(x) over the last axis, no scale, in float32 (callers cast back): the core of RMSNorm
  and LayerNorm (`Norm`), of MTP's norms and of fused EAGLE features' taps. The mean of squares
  is summed in a fixed order (kernels/reduce.py), so a row's norm does not depend on how many
  rows share the call."""
  h = x.astype(jnp.float32)
  return h * jax.lax.rsqrt(fixed_mean(h * h, keepdims=True) + eps)


def _param(rngs, shape, dtype, scale=0.02):
  return nnx.Param(scale * jax.random.normal(rngs.params(), shape, dtype))


def lookup(table, ids):
  """table[ids], the table and ids behind one optimization barrier. XLA's CPU compiler computes a
  bf16 lookup in float32, as a convert of the table fused into the slice; when the table is a
  loop invariant, as in a decoding loop, it would hoist that convert of the whole table out of
  the loop, converting SmolLM2's [V,E] embedding every call (~30 ms) to read a few rows. Tied
  to the ids, which change in every step, the table is no longer invariant."""
  table, ids = jax.lax.optimization_barrier((table, ids))
  return table[ids]


class Norm(nnx.Module):
  """RMSNorm or LayerNorm over the last axis, of width `size` (default E). Gemma's x * (1 + w) is
  this with the checkpoint's w + 1 as scale (the family module adds the 1 when loading)."""

  def __init__(self, cfg: ModelConfig, dtype, size: int | None = None):
    size = cfg.hidden_size if size is None else size
    self.kind, self.eps = cfg.norm, cfg.norm_eps
    self.scale = nnx.Param(jnp.ones((size,), dtype))
    if cfg.norm == "layer":
      self.bias = nnx.Param(jnp.zeros((size,), dtype))

  def __call__(self, x):  # [..., size]
    if self.kind == "layer":
      h = x.astype(jnp.float32)
      h = rms_unit(h - fixed_mean(h, keepdims=True), self.eps)
      return (h.astype(x.dtype) * self.scale[...].astype(x.dtype)
              + self.bias[...].astype(x.dtype))
    return self.scale[...].astype(x.dtype) * rms_unit(x, self.eps).astype(x.dtype)


def attention_mask(mask, start, positions, window: int, empty_cache: bool):
  """The caller's mask [B,T,S] over cache slots -> the mask [B,T,S+T] (or [B,T,T] on an empty
  cache) over the old cache beside the T new entries, as Attention reads them, intersected with
  the layer's sliding band when window > 0.

  The band comes from token positions, not slots: a query at position p sees a key at position
  q only if p - q < window. Committed cache slot s holds position s; the new entries are at
  `positions` [B,T], so a tree's node at depth d (position length + d) sees its own band,
  whatever slot it was written to."""
  b, t, s = mask.shape
  new = mask[:, :, :t] if empty_cache else jax.vmap(
      lambda m, st: jax.lax.dynamic_slice(m, (0, st), (t, t)))(mask, start)  # [B,T,T]
  if window and positions is not None:
    new = new & (positions[:, :, None] - positions[:, None, :] < window)
  if empty_cache:
    return new
  # The mask is over cache slots; the new entries' columns are slots [start, start + T), so
  # those columns of the old cache are masked out and read from the new block instead.
  old = mask & (jnp.arange(s)[None, None, :] < start[:, None, None])  # [B,T,S]
  if window and positions is not None:
    old = old & (positions[:, :, None] - jnp.arange(s)[None, None, :] < window)
  return jnp.concatenate([old, new], axis=-1)  # [B,T,S+T]


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, layer: int | None = None):
    e, k, g, d = cfg.hidden_size, cfg.num_kv_heads, cfg.group_size, cfg.head_dim
    self.cfg = cfg
    self.window = cfg.window(layer)  # static: 0 = global
    self.wqkv = _param(rngs, (e, k, g + 2, d), dtype)  # per kv head: G queries, then k, then v
    if cfg.qkv_bias:
      self.bqkv = nnx.Param(jnp.zeros((k, g + 2, d), dtype))
    if cfg.qk_norm:
      self.q_norm, self.k_norm = Norm(cfg, dtype, d), Norm(cfg, dtype, d)
    self.wo = _param(rngs, (cfg.num_heads, d, e), dtype)
    if cfg.out_bias:
      self.bo = nnx.Param(jnp.zeros((e,), dtype))

  def __call__(self, x, rope, layer_cache, start, mask, empty_cache: bool = False, positions=None,
               write: bool = True, norm=None):
    """x [B,T,E] (normed by `norm` first where given: `normed_dense`); rope (cos, sin) [B,T,D/2] or None; layer_cache {k,v: [B,K,S,D]}; start [B];
    mask [B,T,S]; positions [B,T] (for the sliding band; None: no band) -> (y [B,T,E],
    layer_cache). empty_cache (static): the caller guarantees start == 0 (a prefill), so only
    the T new entries are attended (mask[:, :, :T]). write (static) False: the cache is only
    read, and the second result is the T new entries {k,v: [B,T,K,D]} instead (`kv.write_new`
    writes them later)."""
    cfg = self.cfg
    b, t, _ = x.shape
    g = cfg.group_size
    qkv = normed_dense(norm, x, self.wqkv[...], _packed(self, "wqkv"))  # [B,T,K,G+2,D]
    if cfg.qkv_bias:
      qkv = qkv + self.bqkv[...]
    q, k, v = qkv[:, :, :, :g], qkv[:, :, :, g], qkv[:, :, :, g + 1]  # [B,T,K,G,D] [B,T,K,D] x2
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    if rope is not None:
      q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    # The new entries as the cache will hold them (a bf16 cache beside float32 activations):
    # the rows of this call read them as a later call will read them from the cache.
    if layer_cache["k"].dtype != k.dtype:
      k, v = (a.astype(layer_cache["k"].dtype).astype(k.dtype) for a in (k, v))
    # Attention reads the cache as it was before this call plus the T new entries beside it, and
    # the new entries are written into the cache separately. Reading the freshly written cache
    # instead made XLA materialise a second, updated copy of every layer's K and V for the matmul
    # on every step (the in-place write feeds only the loop), which cost more than the reads.
    # The decode attention kernel runs where the layer's dense products run on a CPU kernel: a
    # packed copy of wqkv (one CPU device, kernels on; or a quantized self-draft's copy).
    scale = cfg.attn_scale or cfg.head_dim ** -0.5
    full = attention_mask(mask, start, positions, self.window, empty_cache)  # [B,T,W]
    o = attend(q, None if empty_cache else layer_cache["k"],
               None if empty_cache else layer_cache["v"], k, v, full, scale=scale,
               softcap=cfg.attn_softcap,
               kernel=_packed(self, "wqkv") is not None)  # [B,T,K,G,D]
    # The write must come after the reads. XLA orders them only by data dependence: with none,
    # it copied every layer's K and V twice per decode step so that the read saw the old values
    # (measured: 120 full-cache copies per step). The write position is therefore made to depend
    # on the attention output, by adding (o > inf), which is 0 for every value, NaN included.
    if write:
      start = start + (o[:, 0, 0, 0, 0] > jnp.inf).astype(start.dtype)
      layer_cache = kv.write_layer(layer_cache, k, v, start)
    else:
      layer_cache = {"k": k.astype(layer_cache["k"].dtype), "v": v.astype(layer_cache["v"].dtype)}
    # Head h = k * G + g (HF's order). One plain [B*T, H*D] x [H*D, E] matmul: contracting (h, d)
    # as an einsum made XLA transpose the weight on every step.
    o = o.reshape(b, t, cfg.num_heads * cfg.head_dim)
    y = dense(o, self.wo[...].reshape(cfg.num_heads * cfg.head_dim, -1), _packed(self, "wo"))
    if cfg.out_bias:
      y = y + self.bo[...]
    return y, layer_cache


class MLP(nnx.Module):

  def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
    self.cfg = cfg
    m = 2 if cfg.gated_mlp else 1
    self.w_in = _param(rngs, (cfg.hidden_size, m, cfg.intermediate_size), dtype)  # gate, up
    self.w_out = _param(rngs, (cfg.intermediate_size, cfg.hidden_size), dtype)
    if cfg.out_bias:
      self.b_in = nnx.Param(jnp.zeros((m, cfg.intermediate_size), dtype))
      self.b_out = nnx.Param(jnp.zeros((cfg.hidden_size,), dtype))

  def __call__(self, x, norm=None):  # [B,T,E] (normed by `norm` first where given)
    h = normed_dense(norm, x, self.w_in[...], _packed(self, "w_in"))  # [B,T,M,F]
    if self.cfg.out_bias:
      h = h + self.b_in[...]
    # In float32, rounded once to h's dtype where h is not float32 (a drafter's bf16 input):
    # jax.nn.silu in bf16 would round after each of its five steps.
    g = h[:, :, 0].astype(jnp.float32)
    if self.cfg.activation == "silu":
      a = jax.nn.silu(g).astype(h.dtype)
    else:  # gelu_new / gelu_tanh: the tanh approximation (GPT-2, Gemma's GeGLU)
      a = jax.nn.gelu(g, approximate=True).astype(h.dtype)
    h = a * h[:, :, 1] if self.cfg.gated_mlp else a
    y = dense(h, self.w_out[...], _packed(self, "w_out"))
    if self.cfg.out_bias:
      y = y + self.b_out[...]
    return y


class Block(nnx.Module):
  """One decoder layer. layer: its index in the model, which picks its sliding window (None: a
  drafter's own layer on the target's config, global attention)."""

  def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, layer: int | None = None):
    self.attn_norm = Norm(cfg, dtype)
    self.attn = Attention(cfg, dtype, rngs, layer)
    self.mlp_norm = Norm(cfg, dtype)
    self.mlp = MLP(cfg, dtype, rngs)
    if cfg.post_norms:  # Gemma 2 / 3: each sublayer's output is normed before the residual add
      self.post_attn_norm, self.post_mlp_norm = Norm(cfg, dtype), Norm(cfg, dtype)

  def __call__(self, x, rope, layer_cache, start, mask, empty_cache: bool = False, positions=None,
               write: bool = True):
    y, layer_cache = self.attn(x, rope, layer_cache, start, mask, empty_cache, positions, write,
                               norm=self.attn_norm)
    if hasattr(self, "post_attn_norm"):
      y = self.post_attn_norm(y)
    x = x + y
    y = self.mlp(x, norm=self.mlp_norm)
    if hasattr(self, "post_mlp_norm"):
      y = self.post_mlp_norm(y)
    return x + y, layer_cache


def layer_runner(x):
  """How one forward runs its layers. Inside a trace (jit), through a jitted function made for
  this forward alone: layers of the same graphdef (shape and settings) are traced and lowered
  once per forward instead of once each, and XLA inlines the calls, so the compiled program is
  the one an unrolled loop gives. Made per forward, not once per process, so that whatever a
  trace reads (the kernels' availability, a patched function) is read again by every new
  program. Eagerly (x not traced), the layers are called directly."""
  if not isinstance(x, jax.core.Tracer):
    return lambda block, *args: block(*args)
  # A fresh partial, not _apply_block itself: jax keys its trace cache on the function object,
  # so two jits of one function share traces, and this one must be this forward's own.
  run = jax.jit(partial(_apply_block), static_argnums=(0, 7, 9))

  def call(block, *args):
    graphdef, state = nnx.split(block)
    return run(graphdef, state, *args)

  return call


def _apply_block(graphdef, state, x, rope, layer_cache, start, mask, empty_cache, positions,
                 write=True):
  return nnx.merge(graphdef, state)(x, rope, layer_cache, start, mask, empty_cache, positions,
                                    write)


class Decoder(nnx.Module):
  """The whole model. Build abstractly with `nnx.eval_shape` and fill from a checkpoint."""

  def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype)  # [V,E]
    if cfg.position == "learned":
      self.pos_embed = _param(rngs, (cfg.max_position_embeddings, cfg.hidden_size), dtype)
    self.layers = nnx.List([Block(cfg, dtype, rngs, i) for i in range(cfg.num_layers)])
    self.final_norm = Norm(cfg, dtype)
    if not cfg.tie_word_embeddings:
      self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), dtype)  # [E,V]
    # Each distinct rope (Gemma 3: local and global layers' bases) as static floats, not arrays:
    # hashable attributes, constant-folded under jit; layer i uses ropes[layer_rope[i]].
    freqs = [tuple(rope_inv_freq(cfg, i).tolist()) if cfg.position == "rope" else ()
             for i in range(cfg.num_layers)]
    self.ropes = tuple(dict.fromkeys(freqs))
    self.layer_rope = tuple(self.ropes.index(f) for f in freqs)

  def head(self, h: jax.Array) -> jax.Array:
    """Final-normed hidden [..., E] -> logits [..., V] (float32), soft-capped where the family
    does (Gemma 2)."""
    if self.cfg.tie_word_embeddings:
      logits = dense(h, self.embed[...], _packed(self, "head"), transposed=True)
    else:
      logits = dense(h, self.lm_head[...], _packed(self, "head"))
    logits = logits.astype(jnp.float32)
    if self.cfg.final_softcap:
      logits = self.cfg.final_softcap * jnp.tanh(logits / self.cfg.final_softcap)
    return logits

  def _embed(self, tokens, positions):
    """tokens, positions [B,T] -> (x [B,T,E], one (cos, sin) [B,T,D/2] per distinct rope)."""
    x = lookup(self.embed[...], tokens).astype(jnp.float32)  # [B,T,E]
    if self.cfg.embed_scale != 1.0:
      x = x * jnp.asarray(self.cfg.embed_scale, x.dtype)
    if self.cfg.position == "learned":
      return x + lookup(self.pos_embed[...], positions).astype(jnp.float32), [None]
    ropes = []
    for freqs in self.ropes:
      angles = positions[..., None].astype(jnp.float32) * jnp.asarray(freqs, jnp.float32)
      ropes.append(_once(jnp.cos(angles), jnp.sin(angles), positions))
    return x, ropes

  def __call__(self, tokens, positions, cache: kv.KVCache, mask, *, num_layers: int | None = None,
               logits_at: jax.Array | None = None, empty_cache: bool = False, taps: tuple = (),
               raw_taps: bool = False, write_cache: bool = True):
    """tokens, positions [B,T] int32; mask [B,T,S] bool: which cache slots each token may attend
    (causal, tree or lookahead); each layer's sliding window is applied here, from positions.

    num_layers: run only the first k layers (layer-skip drafting); their cache entries are
    written, the rest are passed through. logits_at [B,N]: compute logits only at these of the
    T positions (prefill needs one). empty_cache: the cache holds nothing yet (every length
    is 0), so attention reads only the T new entries. taps (i, j, ...): also return the residual
    stream after the first i, j, ... layers, each RMS-normalised without a scale (fused EAGLE
    features, drafters/eagle.py), or as it is with raw_taps (EAGLE-3's fc reads the raw states
    entering layers i, j, ...). Returns (logits [B,T or N,V] float32, hidden [B,T,E] after the
    final norm (with taps: [B,T,(n+1)E], the n taps then that), cache).

    write_cache False: the cache is only read, and the third result is the T new entries of each
    layer run (kv.NewEntries), which `kv.write_new` writes later. A verification inside a
    lax.cond returns them from its branch and writes them after it: a branch that wrote the
    cache made XLA copy every layer's K and V into and out of the branch on every step.
    """
    n = self.cfg.num_layers if num_layers is None else num_layers
    check_inputs(self.cfg, tokens, positions, cache, mask, n)
    x, ropes = self._embed(tokens, positions)
    layers = list(cache.layers)
    tapped = []
    run = layer_runner(x)
    for i in range(n):
      rope = ropes[self.layer_rope[i] if self.cfg.position == "rope" else 0]
      x, layers[i] = run(self.layers[i], x, rope, layers[i], cache.lengths, mask, empty_cache,
                         positions, write_cache)
      if i + 1 in taps:
        tapped.append(x if raw_taps else rms_unit(x, self.cfg.norm_eps).astype(x.dtype))
    if len(tapped) != len(taps):
      raise ValueError(f"taps {taps} must be layer counts in [1, {n - 1}]")
    hidden = self.final_norm(x)
    sel = hidden
    if logits_at is not None:
      sel = jnp.take_along_axis(hidden, logits_at[..., None], axis=1)  # [B,N,E]
    if tapped:
      hidden = jnp.concatenate(tapped + [hidden], axis=-1)
    if not write_cache:
      return self.head(sel), hidden, kv.NewEntries(layers=tuple(layers[:n]))
    return self.head(sel), hidden, cache.replace(layers=tuple(layers))


def check_inputs(cfg: ModelConfig, tokens, positions, cache, mask, num_layers: int) -> None:
  """InputError, at trace time, for arguments of the wrong kind or shape (not raw JAX errors)."""
  from specjax.errors import InputError

  if not isinstance(cache, kv.KVCache):
    raise InputError(f"cache must be a KVCache (Model.init_cache(batch, max_len)), got "
                     f"{type(cache).__name__}")
  for name, x in (("tokens", tokens), ("positions", positions), ("mask", mask)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise InputError(f"{name} must be an array, got {type(x).__name__}")
  if tokens.ndim != 2 or tuple(positions.shape) != tuple(tokens.shape):
    raise InputError(f"tokens and positions must both be [B,T]; got {tuple(tokens.shape)} and "
                     f"{tuple(positions.shape)}")
  b, t = tokens.shape
  s = cache.max_len
  if tuple(mask.shape) != (b, t, s):
    raise InputError(f"mask must be [B,T,S] = {(b, t, s)} (batch, new tokens, cache slots); "
                     f"got {tuple(mask.shape)}")
  if len(cache.layers) < num_layers or cache.lengths.shape != (b,):
    raise InputError(f"cache holds {len(cache.layers)} layer(s) for batch "
                     f"{tuple(cache.lengths.shape)}; this call needs {num_layers} for batch {b}")


class Model:
  """A loaded model: frozen `config`, NNX `graphdef`, parameter pytree `params`, `tokenizer`.

  Pure use: `model.apply(params, tokens, positions, cache, mask)`; `params` can be swapped for a
  traced copy inside jit (nnx.merge happens at trace time only).
  """

  def __init__(self, config: ModelConfig, graphdef, params, tokenizer=None, name: str = "",
               dtype=jnp.float32, shared: tuple = ()):
    self.config, self.graphdef, self.params = config, graphdef, params
    self.tokenizer, self.name, self.dtype = tokenizer, name, jnp.dtype(dtype)
    self.shared = shared  # parameter paths borrowed from another model (e.g. a draft's embeddings)

  def module(self, params=None) -> Decoder:
    return nnx.merge(self.graphdef, self.params if params is None else params)

  def apply(self, params, tokens, positions, cache, mask, **kw):
    return self.module(params)(tokens, positions, cache, mask, **kw)

  def init_cache(self, batch: int, max_len: int, num_layers: int | None = None) -> kv.KVCache:
    c = self.config
    return kv.init(num_layers or c.num_layers, batch, max_len, c.num_kv_heads, c.head_dim, self.dtype)

  @property
  def num_param_bytes(self) -> int:
    return sum(x.size * x.dtype.itemsize for p, x in jax.tree_util.tree_leaves_with_path(self.params)
               if "packed_" not in jax.tree_util.keystr(p))  # kernels' packed copies excluded

  def __repr__(self):
    c = self.config
    return (f"Model({self.name or c.arch}: L={c.num_layers} E={c.hidden_size} H={c.num_heads} "
            f"K={c.num_kv_heads} V={c.vocab_size}, {self.arithmetic})")

  @property
  def arithmetic(self) -> str:
    """What decoding multiplies: the dtype, or the GGUF's blocks times float32 or int8
    activations (load_model's weights= and activations=)."""
    if getattr(self, "weights", "float32") == "blocks":
      return f"GGUF blocks x {getattr(self, 'activations', 'float32')} activations"
    if self.dtype == jnp.float32:
      return "float32"
    return f"{self.dtype.name} weights and cache x float32 activations"

  @classmethod
  def random(cls, config: ModelConfig, *, seed: int = 0, dtype=jnp.float32, tokenizer=None,
             scale: float = 0.02) -> "Model":
    """A randomly initialised model (tests, drafts trained from scratch)."""
    config.validate()
    module = Decoder(config, dtype=dtype, rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(module)
    if scale != 0.02:
      params = jax.tree_util.tree_map(lambda x: x * (scale / 0.02), params)
    return cls(config, graphdef, params, tokenizer, name="random", dtype=dtype)


def path_key(path) -> tuple:
  """A jax tree path into an nnx.State -> specjax's flat key, e.g. ("layers", 3, "attn", "wqkv")."""
  out = []
  for p in path:
    k = getattr(p, "key", getattr(p, "name", getattr(p, "idx", None)))
    if k == "value":
      continue
    out.append(k)
  return tuple(out)


def head_rows(config: ModelConfig, params, ids) -> jax.Array:
  """The LM-head rows [Vs,E] for token ids [Vs] (the embedding when tied): logits over just those
  tokens are final-normed hidden @ head_rows(...).T, as in `Decoder.head` restricted to `ids`."""
  head = params["embed"][...] if config.tie_word_embeddings else params["lm_head"][...].T
  return head[ids]


def subset_index(vocab: jax.Array, ids: jax.Array):
  """Token ids [...] -> (their positions [...] in the sorted subset vocab [Vs], whether each is
  there): the label index into logits over head_rows(..., vocab). Negative ids are never there."""
  idx = jnp.clip(jnp.searchsorted(vocab, ids), 0, vocab.shape[0] - 1)
  return idx, (ids >= 0) & (vocab[idx] == ids)


def subset_logits(h: jax.Array, arrays: dict) -> jax.Array:
  """h [...,E] (final-normed) -> logits [...,Vs] float32 over a vocabulary subset. arrays:
  `packing.subset_head`'s {"head": rows [Vs,E]}, with "packed_head" when the target is packed."""
  return dense(h, arrays["head"], arrays.get("packed_head"), transposed=True).astype(jnp.float32)


def from_flat(config: ModelConfig, flat: dict, *, dtype=jnp.float32, place=None, where: str = ""):
  """Flat params in specjax layout -> (graphdef, params). Every key and shape is checked before
  any tensor is read or converted.

  flat: key -> a numpy array, or a checkpoint tensor not read yet (specjax.lazy.Tensor, what
  weights.open_checkpoint gives): tensors are read, converted to `dtype` and placed one at a time.
  place(key, np_array) -> jax.Array puts each tensor on its device(s) (default: jnp.asarray). A
  placer that reads slices (`place.reads_slices`, as sharding.placer's does) is given a
  lazy.Slices instead and reads only its devices' slices: a sharded model is never materialised
  whole, on one device or on the host.
  """
  from specjax import lazy
  from specjax.errors import WeightsError

  abstract = nnx.eval_shape(lambda: Decoder(config, dtype=dtype, rngs=nnx.Rngs(0)))
  graphdef, abs_state = nnx.split(abstract)
  wanted = {path_key(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(abs_state)[0]}
  for key, leaf in wanted.items():
    if key not in flat:
      raise WeightsError(f"{where}: no tensor for parameter {'.'.join(map(str, key))}")
    if tuple(flat[key].shape) != tuple(leaf.shape):
      raise WeightsError(f"{where}: parameter {'.'.join(map(str, key))} has shape "
                         f"{tuple(flat[key].shape)}, expected {tuple(leaf.shape)}")
  extra = set(flat) - set(wanted)
  if extra:
    raise WeightsError(f"{where}: unexpected parameters {sorted(map(str, extra))[:5]}")
  slices = getattr(place, "reads_slices", False)

  def fill(path, leaf):
    key = path_key(path)
    host = lazy.host(flat[key], dtype)
    if place is None:
      return jnp.asarray(np.asarray(host))
    return place(key, host if slices else np.asarray(host))

  return graphdef, jax.tree_util.tree_map_with_path(fill, abs_state)


# ----------------------------------------------------------------------------- whole sequences


def forward_sequence(config: ModelConfig, forward, tokens: jax.Array, *, cache=None, dtype=None,
                     lengths: jax.Array | None = None, **kw):
  """One causal forward over whole sequences from position 0: what training reads from a frozen
  target (its features, its logits) and what a prefill runs over a prompt.

  forward(tokens, positions, cache, mask, **kw): a Decoder (`Model.module(params)`) or anything
  called like one (decoding passes its Program's forward, which adds its method's taps). tokens
  [B,T] int32 sit at positions 0..T-1 and attend causally (and within the sliding window).
  cache: where their K/V go (default: a fresh cache of T slots of `dtype`, which training
  drops); its lengths must be 0. lengths [B]: rows are right-padded, row b attends only its
  first lengths[b] slots (default: all T). kw: the Decoder's logits_at, taps, empty_cache.
  Returns forward's (logits, hidden, cache); no gradient is stopped here (callers that freeze
  the target do that, or never differentiate its params)."""
  b, t = tokens.shape
  if cache is None:
    cache = kv.init(config.num_layers, b, t, config.num_kv_heads, config.head_dim,
                    jnp.float32 if dtype is None else dtype)
  s = cache.max_len
  mask = kv.causal_mask(cache.lengths, t, s)  # [B,T,S]
  if lengths is not None:
    mask = mask & (jnp.arange(s) < lengths[:, None])[:, None, :]
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  return forward(tokens, positions, cache, mask, **kw)
