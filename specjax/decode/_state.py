"""DecodeState, the while_loop's carry: its fields, the layout each declares over a mesh, and
the two verbs every step ends with (`emitted`: what a step emits; `emit`: append it to the rows).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from specjax import cache as kv
from specjax import sharding
from specjax.sampling import SamplingParams

ROWS, REPLICATED = "rows", "replicated"  # a state field's layout over a mesh


def rows(**kw):
  """A state field laid out by row: every array in it has leading axis B, split over the mesh's
  `data` axis (a KVCache: its buffers by sharding.cache_spec, its lengths over data)."""
  return flax.struct.field(metadata={"layout": ROWS}, **kw)


def replicated(pin: bool = True, **kw):
  """A state field held whole on every device (a PRNG key, stop tokens, a table all rows share).
  pin=False: placed whole on entry and left to XLA's propagation inside the loop, for a field
  the loop never changes or a scalar, where a constraint only moves the compiled loop's carry."""
  return flax.struct.field(metadata={"layout": REPLICATED, "pin": pin}, **kw)


@flax.struct.dataclass
class DecodeState:
  """The while_loop's carry. Every field declares its layout over a mesh (`rows` or
  `replicated`) and `constrain` pins exactly that: nothing is guessed from shapes.

  `method` is the method's own state (a draft cache, an n-gram pool, counters): any pytree, per-row
  by rule. Every array in it has leading axis B (a KVCache's buffers and lengths do), and
  `constrain` raises at trace time, on one device too, for one that does not. A leaf all rows
  share goes in a flax.struct.dataclass field declared `replicated()` (fields declared `rows()`,
  or not declared, follow the rule).
  """
  seq: jax.Array = rows()  # [B,S] int32: prompt then generated tokens; index = position
  seq_len: jax.Array = rows()  # [B] int32: valid tokens in seq
  prompt_len: jax.Array = rows()  # [B] int32
  max_new: jax.Array = rows()  # [B] int32
  done: jax.Array = rows()  # [B] bool
  cache: kv.KVCache = rows()  # target K/V for seq[:, :seq_len - 1]; the last token is pending
  key: jax.Array = replicated()  # PRNG key, split every step
  sp: SamplingParams = rows()  # [B] temperature, top_k, top_p
  eos: jax.Array = replicated(pin=False)  # [N_eos] int32 stop tokens (-1 = unused)
  steps: jax.Array = replicated(pin=False)  # [] int32: loop iterations so far
  calls: jax.Array = rows()  # [B] int32: target forwards while the row was active (prefill too)
  hist: jax.Array = rows()  # [B, max_emit + 1] int32: steps that emitted n tokens
  method: Any = rows(default=None)  # the method's own state (draft cache, n-gram pool, ...)

  @property
  def last_token(self) -> jax.Array:
    """[B] the pending token (emitted, not yet in the cache)."""
    return jnp.take_along_axis(self.seq, (self.seq_len - 1)[:, None], axis=1)[:, 0]


def _declares_layout(x) -> bool:
  return (dataclasses.is_dataclass(x) and not isinstance(x, type)
          and any("layout" in f.metadata for f in dataclasses.fields(x)))


def constrain(mesh, tree, batch: int):
  """Pins a decode state, a KV cache or a method's state inside jit to its declared layout:
  `rows` fields (and undeclared ones) with their leading axis B = batch over data, KV caches by
  sharding.constrain_cache, `replicated` fields whole on every device. With mesh None (one
  device) nothing is pinned, but the per-row rule is still checked, so a method whose state
  breaks it fails where it is written rather than first on a mesh."""
  pinned = _pin(mesh, tree, batch, {}, type(tree).__name__)
  return tree if mesh is None else pinned


def _pin(mesh, tree, batch: int, declared: dict, where: str):
  """`constrain` for one field: `declared` is its metadata (layout, pin), empty for rows."""
  if declared.get("layout", ROWS) == REPLICATED:
    pin = mesh is not None and declared.get("pin", True)
    return sharding.constrain_replicated(mesh, tree) if pin else tree

  def one(path, x):
    name = where + jax.tree_util.keystr(path)
    if _declares_layout(x):
      return x.replace(**{f.name: _pin(mesh, getattr(x, f.name), batch, f.metadata,
                                       f"{name}.{f.name}") for f in dataclasses.fields(x)})
    shape = (x.batch,) if isinstance(x, kv.KVCache) else getattr(x, "shape", None)
    if shape is None:
      return x
    if len(shape) == 0 or shape[0] != batch:
      raise ValueError(
          f"{name} has shape {tuple(shape)}, but a decode state's `rows` fields, and a method's "
          f"state, hold per-row arrays with leading axis B={batch} (split over the mesh's data "
          f"axis): make it [B, ...], or put a leaf all rows share in a flax.struct.dataclass "
          f"field declared decode.replicated()")
    if mesh is None:
      return x
    if isinstance(x, kv.KVCache):
      return sharding.constrain_cache(mesh, x)
    return sharding.constrain_rows(mesh, x)

  return jax.tree_util.tree_map_with_path(
      one, tree, is_leaf=lambda x: isinstance(x, kv.KVCache) or _declares_layout(x))


def emit(state: DecodeState, tokens: jax.Array, n: jax.Array) -> DecodeState:
  """Appends the first n[b] of tokens [B,N] to each active row, stopping at EOS and max_new.

  Rows already done emit nothing. Counts the step in `calls` and `hist` for active rows.
  """
  b, num = tokens.shape
  active = ~state.done
  n = jnp.where(active, n, 0).astype(jnp.int32)
  j = jnp.arange(num)[None, :]
  is_eos = jnp.any(tokens[:, :, None] == state.eos[None, None, :], axis=-1) & (j < n[:, None])
  hit = jnp.any(is_eos, axis=1)
  n = jnp.where(hit, jnp.minimum(n, jnp.argmax(is_eos, axis=1) + 1), n)
  n = jnp.minimum(n, state.max_new - (state.seq_len - state.prompt_len))
  s = state.seq.shape[1]
  idx = jnp.where(j < n[:, None], state.seq_len[:, None] + j, s)  # s = out of range: dropped
  seq = jax.vmap(lambda row, i, t: row.at[i].set(t, mode="drop"))(state.seq, idx, tokens)
  seq_len = state.seq_len + n
  done = state.done | (hit & active) | (seq_len - state.prompt_len >= state.max_new)
  hist = state.hist.at[jnp.arange(b), jnp.minimum(n, state.hist.shape[1] - 1)].add(
      active.astype(jnp.int32))
  return state.replace(seq=seq, seq_len=seq_len, done=done, hist=hist,
                       calls=state.calls + active.astype(jnp.int32))


def emitted(draft: jax.Array, n: jax.Array, nxt: jax.Array) -> jax.Array:
  """What a step emits (the input of `emit(state, out, n + 1)`): the first n[b] tokens of
  draft [B,D] (the accepted ones), then nxt [B] (the target's own token) -> [B,D+1]. Entries past
  n[b] are never emitted."""
  b, d = draft.shape
  out = jnp.concatenate([draft, jnp.zeros((b, 1), draft.dtype)], axis=1)
  return jnp.where(jnp.arange(d + 1)[None, :] == n[:, None], nxt[:, None], out)
