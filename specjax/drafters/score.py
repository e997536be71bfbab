"""Teacher-forced scoring of heads on a target: `head_logits`, to measure heads."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import cache as kv
from specjax.drafters import dflash
from specjax.drafters.heads_file import Heads
from specjax.drafters.kinds import check_fits, drafter, module_type
from specjax.drafters.layer import module_arrays
from specjax.errors import InputError
from specjax.model import forward_sequence

SCORED = ("medusa", "eagle", "eagle3", "mtp", "dflash")  # head kinds head_logits scores


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
  """head_logits' computation, one compiled program per shape: toks [B,T] -> [B,T,K,V] (Medusa),
  [B,T-1,V] (EAGLE), ... (see head_logits)."""
  dec = nnx.merge(graphdef, params)
  _, hidden, _ = forward_sequence(config, dec, toks, dtype=jnp.dtype(dtype),
                                  taps=heads_config.taps,
                                  raw_taps=module_type(heads_config).raw_taps)
  return _SCORE[heads_config.kind](config, dec, heads_config, p, vocab, toks, hidden,
                                   jnp.dtype(dtype))


def _medusa(config, dec, hc, p, vocab, toks, hidden, dtype) -> jax.Array:
  """[B,T,K,V]: each head's own LM head's logits, or the target's."""
  heads = drafter(hc, config, p)
  logits = heads.logits(heads(hidden), dec.head)  # [B,T,K,V or Vs]
  return _to_vocab(logits, vocab, config.vocab_size, heads.own_vocab)


def _eagle(config, dec, hc, p, vocab, toks, hidden, dtype) -> jax.Array:
  """The EAGLE (or EAGLE-3) module's first-step logits [B,T-1,V] over positions 0..T-2 (token
  t + 1, feature t)."""
  b, t = toks.shape
  n = t - 1
  arrays = module_arrays(p, 0)
  # EAGLE-3 may bring its own embedding
  table = arrays.pop("embed") if "embed" in arrays else dec.embed[...]
  mod = drafter(hc, config, arrays)
  feats = mod.fuse(hidden[:, :-1])  # [B,n,E]
  layer = kv.init(1, b, n, config.num_kv_heads, config.head_dim, dtype).layers[0]
  start = jnp.zeros((b,), jnp.int32)
  mask = kv.causal_mask(start, n, n, config.sliding_window)  # [B,n,n]
  pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
  h, _ = mod(table[toks[:, 1:]], feats, pos, layer, start, mask)
  return _to_vocab(mod.logits(h, dec.head), vocab, config.vocab_size, mod.own_vocab)


def _dflash(config, dec, c, params, vocab, toks, hidden, dtype) -> jax.Array:
  """A DFlash drafter's block logits [B,T-bs+1,bs-1,V], one block anchored at every position."""
  b, t = toks.shape
  anchors = jnp.broadcast_to(jnp.arange(t - c.block_size + 1, dtype=jnp.int32),
                             (b, t - c.block_size + 1))
  feats = hidden[..., :len(c.target_layer_ids) * c.hidden_size]
  h = dflash.anchored_hidden(drafter(c, config, params), dec.embed[...], toks, feats, anchors,
                             c.block_size, c.mask_token_id)
  return dec.head(h[:, :, 1:])


def _mtp(config, dec, hc, params, vocab, toks, hidden, dtype) -> jax.Array:
  """The MTP modules' logits [B,T-K,K,V] over positions 0..T-K-1, teacher-forced."""
  b, t = toks.shape
  k_all = params["fc_w"].shape[0]
  n = t - k_all
  h = hidden[:, :n]
  layer = kv.init(1, b, n, config.num_kv_heads, config.head_dim, dtype).layers[0]
  start = jnp.zeros((b,), jnp.int32)
  mask = kv.causal_mask(start, n, n, config.sliding_window)
  pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
  out = []
  for k in range(k_all):
    mod = drafter(hc, config, module_arrays(params, k))
    h, _ = mod(dec.embed[...][toks[:, k + 1:k + 1 + n]], h, pos, layer, start, mask)
    normed = mod.out(h)
    out.append(dec.head(dec.final_norm(h) if normed is None else normed).astype(jnp.float32))
  return _to_vocab(jnp.stack(out, axis=2), vocab, config.vocab_size, False)


# kind -> its teacher-forced scoring, given the target's forward over the tokens
_SCORE = {"medusa": _medusa, "eagle": _eagle, "eagle3": _eagle, "mtp": _mtp, "dflash": _dflash}
