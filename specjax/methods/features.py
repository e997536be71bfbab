"""Feature drafters' shared parts: EAGLE's head and MTP's modules both read the target's features.

Both drafters run their modules (specjax.drafters: `eagle.EagleLayer`, `mtp.MtpModule`,
`eagle3.Eagle3Head`, built over the device arrays by `modules`: a linear and one decoder layer of
the target's type) over [embedding of the next token, a feature], keep their own static head
cache, re-read the
last W committed positions each round with the target's true features (`catch_up`, from a rolling
`feature_buffer` that `shift_in` advances), and score drafts through the target's frozen LM head
(`lm_logits`, optionally over a vocabulary subset, `to_tokens` mapping back to token ids).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import cache as kv
from specjax.decode import Program
from specjax.drafters.heads_file import Heads
from specjax.drafters.kinds import drafter, module_type
from specjax.drafters.layer import module_arrays, pack_module
from specjax.errors import InputError
from specjax.model import lookup, subset_logits
from specjax.packing import drafter_qtype, on_kernel, subset_head


def check_heads(heads, kind, method: str) -> None:
  """kind: the heads kind `method` runs, or a tuple of them."""
  kinds = (kind,) if isinstance(kind, str) else tuple(kind)
  if not isinstance(heads, Heads):
    raise InputError(f"heads={heads!r} is invalid: must be specjax Heads (sj.init_heads(target, "
                     f"{kinds[0]!r}) or sj.load_heads(...))")
  if heads.config.kind not in kinds:
    raise InputError(f"heads of kind {heads.config.kind!r} cannot run {method}: need kind "
                     f"{' or '.join(map(repr, kinds))}")


def modules(heads_config, prog: Program, arrays) -> list:
  """The drafter's modules, of its kind's type, over the device arrays (`head_arrays`; inside the
  traced program)."""
  return [drafter(heads_config, prog.config, m) for m in arrays["mods"]]


def target_logits(prog: Program, params, arrays, h: jax.Array, final_norm: bool = False):
  """Logits through the target's (frozen) LM head: h [...,E] -> [...,V or Vs] float32, or its
  rows for the subset arrays["vocab"]."""
  target = nnx.merge(prog.graphdef, params)
  if final_norm:
    h = target.final_norm(h)
  if "head" in arrays:
    return subset_logits(h, arrays)
  return target.head(h)


def lm_logits(prog: Program, params, arrays, mod, h: jax.Array):
  """Draft logits over the head's vocabulary: h [...,E] -> [...,V or Vs] float32: the module's
  own (an EAGLE-3 head's final norm and LM head over its draft vocabulary) or the target's."""
  return mod.logits(h, lambda x: target_logits(prog, params, arrays, x))


def mtp_logits(prog: Program, params, arrays, mod, h: jax.Array):
  """An MTP module's draft logits from its output h [...,E]: through its own output norm where it
  has one (published DeepSeek-V3 layers), else the target's final norm; then the LM head."""
  normed = mod.out(h)
  if normed is None:
    return target_logits(prog, params, arrays, h, final_norm=True)
  return target_logits(prog, params, arrays, normed)


def to_tokens(arrays, ids: jax.Array) -> jax.Array:
  """Indices into the head's vocabulary -> token ids."""
  return arrays["vocab"][ids] if "vocab" in arrays else ids


def over_vocab(q: jax.Array, ids, vocab_size: int) -> jax.Array:
  """q [...,Vs] over the subset ids [Vs] -> [...,V] over the whole vocabulary, zero outside the
  subset (a drafter's q for the exact rule, which reads the target's full p); q when ids is
  None."""
  if ids is None:
    return q
  return jnp.zeros(q.shape[:-1] + (vocab_size,), q.dtype).at[..., ids].set(q)


def check_vocab(vocab, vocab_size: int | None = None) -> np.ndarray | None:
  """vocab: distinct token ids (1-D) a drafter proposes over, or None; returns int32 or None."""
  if vocab is None:
    return None
  arr = np.asarray(vocab)
  ok = arr.ndim == 1 and arr.size > 0 and np.issubdtype(arr.dtype, np.integer)
  if ok and (arr.min() < 0 or len(np.unique(arr)) != arr.size or
             (vocab_size is not None and arr.max() >= vocab_size)):
    ok = False
  if not ok:
    bound = f"[0, {vocab_size})" if vocab_size is not None else "[0, vocab_size)"
    raise InputError(f"vocab must be distinct token ids in {bound} as a 1-D array, got "
                     f"shape {arr.shape} dtype {arr.dtype}")
  return arr.astype(np.int32)


def embed(table, tokens: jax.Array) -> jax.Array:
  """The target's (frozen, shared) token embedding [V,E]: tokens [...] -> [...,E]."""
  return lookup(table, tokens)


def feature_buffer(hidden: jax.Array, lengths: jax.Array, width: int) -> jax.Array:
  """The features at positions [lengths - width, lengths) of hidden [B,P,E] -> [B,width,E]
  (right-aligned; positions below 0 read position 0, never used)."""
  idx = jnp.maximum(lengths[:, None] - width + jnp.arange(width)[None, :], 0)
  return jnp.take_along_axis(hidden, idx[..., None], axis=1)


def shift_in(buf: jax.Array, new: jax.Array, c: jax.Array) -> jax.Array:
  """Appends the first c[b] rows of new [B,M,E] to the rolling buffer buf [B,W,E] (oldest out)."""
  w = buf.shape[1]
  both = jnp.concatenate([buf, new.astype(buf.dtype)], axis=1)  # [B,W+M,E]
  idx = c[:, None] + jnp.arange(w)[None, :]
  return jnp.take_along_axis(both, idx[..., None], axis=1)


def prompt_pass(prog: Program, mods, arrays, seq, hidden, head_cache):
  """Runs every module over the prompt bucket after prefill (positions 0..P-1, module k reading
  token x_{i+k+1}); fills the head cache's layers. mods: `modules`; hidden [B,P,E]; seq [B,S].
  Entries whose
  tokens are not known yet hold garbage that the first catch-up rewrites."""
  b, p, _ = hidden.shape
  s = seq.shape[1]
  pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
  start = jnp.zeros((b,), jnp.int32)
  mask = kv.causal_mask(start, p, head_cache.max_len, prog.config.sliding_window)
  h = hidden
  layers = list(head_cache.layers)
  for k, mod in enumerate(mods):
    tok = jnp.take_along_axis(seq, jnp.minimum(pos + k + 1, s - 1), axis=1)
    h, layers[k] = mod(embed(arrays["embed"], tok), h, pos, layers[k], start, mask)
  return head_cache.replace(layers=tuple(layers))


def head_arrays(heads, model) -> dict:
  """The device arrays EAGLE / MTP read: the modules, the target's embedding (shared, not a copy)
  and, for a vocabulary subset, its ids and LM-head rows."""
  kind = module_type(heads.config)
  mods = [module_arrays(heads.params, k) for k in range(heads.config.num_heads)]
  # The modules' products on the kernel, as the target's (EAGLE-3's layer runs on XLA's dot).
  if on_kernel(model) and kind.packs and all(m["fc_w"].dtype == jnp.float32 for m in mods):
    mods = [pack_module(m, drafter_qtype(model)) for m in mods]
  # The target's embedding (shared, not a copy), unless an EAGLE-3 head brought its own.
  own = mods[0].pop("embed", None)
  out = {"mods": mods, "embed": model.params["embed"][...] if own is None else own}
  if heads.vocab is not None and kind.own_vocab:  # EAGLE-3: its own LM head, draft ids -> ids
    out["vocab"] = jnp.asarray(heads.vocab, jnp.int32)
  elif heads.vocab is not None:
    out.update(subset_head(model, heads.vocab))  # vocab [Vs], head [Vs,E]
  return out


def catch_up(prog: Program, mods, arrays, seq, feats, lengths, head_cache, num_modules: int = 1,
             draft_fn=None):
  """Re-runs the modules over the last W = feats.shape[1] committed positions.

  mods: `modules`; seq [B,S]; feats [B,W,E] the target's features at positions [L - W, L) (L =
  lengths [B], the committed target length; x_L is pending); head_cache: one layer per module.
  Module k at position i reads token x_{i+k+1}: seq for i + k + 1 <= L, else drafts[:, i + k - L]
  (MTP's chain, [B,K]; filled as modules run). Returns (head_cache with lengths = L, outputs at
  position L - 1 per module [B,K,E], drafts [B,K] or None). draft_fn(out [B,E], k) -> tokens [B]
  (MTP): module k's draft x_{L+k+1} from its output at L - 1, which module k + 1 then reads.
  """
  b, w, _ = feats.shape
  s = seq.shape[1]
  start = jnp.maximum(lengths - w, 0)
  pos = start[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]  # [B,W]
  # Position i's feature sits at buffer index i - L + W (rows with L < W: clipped, garbage).
  h = jnp.take_along_axis(feats, jnp.clip(pos - lengths[:, None] + w, 0, w - 1)[..., None], axis=1)
  mask = kv.causal_mask(start, w, head_cache.max_len, prog.config.sliding_window)
  last = (lengths - 1 - start)[:, None, None]  # [B,1,1] index of position L - 1
  layers = list(head_cache.layers)
  outs = []
  drafts = None if draft_fn is None else jnp.zeros((b, num_modules), jnp.int32)
  for k in range(num_modules):
    j = pos + k + 1  # token index read at each position
    tok = jnp.take_along_axis(seq, jnp.minimum(j, s - 1), axis=1)
    if drafts is not None:
      d = jnp.take_along_axis(drafts, jnp.clip(j - lengths[:, None] - 1, 0, drafts.shape[1] - 1),
                              axis=1)
      tok = jnp.where(j <= lengths[:, None], tok, d)
    h, layers[k] = mods[k](embed(arrays["embed"], tok), h, pos, layers[k], start, mask)
    outs.append(jnp.take_along_axis(h, last, axis=1)[:, 0])
    if draft_fn is not None:
      drafts = drafts.at[:, k].set(draft_fn(outs[-1], k).astype(jnp.int32))
  cache = head_cache.replace(layers=tuple(layers), lengths=lengths)
  return cache, jnp.stack(outs, axis=1), drafts
