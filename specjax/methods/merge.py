"""Candidate trees merged from several drafters, verified in one target forward.

Shared by suffix decoding (methods/suffix.py: the continuations of many earlier occurrences of the
context's suffix) and hybrid trees (methods/hybrid.py: copied and predicted candidates together).
Both describe their candidates the same way, as a flat list of M nodes per row:

    tokens  [B,M] int32   each candidate's token
    parents [B,M] int32   its parent among the M (-1: the root, i.e. the pending token); a parent
                          comes before its children
    valid   [B,M] bool    whether the drafter filled the slot (a valid node's parent is valid)
    score   [B,M] float   how much the drafter believes in it (larger is tried first)

`merge` turns that into one tree of exactly N nodes per row: nodes with the same path from the
root (the same token sequence) are one node whose score is the sum of theirs (a candidate two
drafters, or two earlier occurrences, agree on is worth more), each score is clipped to its
parent's (so a parent always ranks before its children), the best N unique valid nodes are kept,
and they are numbered depth by depth (siblings by score: the order verification tries them).
Slots nobody filled are masked out: parent -1 and depth 0, so no rule ever accepts them (the
greedy rule takes the deepest matching path, and depth 0 never beats the root; the multi-draft
rule only tries a node whose parent is the current node, and -1 never is). Everything has static
shapes; rows get different trees.

Such per-row trees go to the shared tree step (`verify.tree`): greedy, or the exact multi-draft
rule (every candidate here is a deterministic function of the context, fixed before the
acceptance coins are drawn, which is all that rule needs to emit exactly the target's
distribution).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _take(x: jax.Array, idx: jax.Array) -> jax.Array:
  """x [B,M] at idx [B,K] (clamped at 0: callers mask what -1 reads)."""
  return jnp.take_along_axis(x, jnp.maximum(idx, 0), axis=1)


def path_keys(tokens: jax.Array, parents: jax.Array, max_depth: int):
  """Each node's path as tokens upwards: tokens, parents [B,M] -> (up [B,M,max_depth] the token
  k steps above the node (k = 0: itself), -1 past the root; depth [B,M] its depth). Two nodes
  have the same path from the root iff their rows of `up` are equal (max_depth must bound the
  candidates' depth)."""
  cur = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  alive = jnp.ones(tokens.shape, bool)
  ups, depth = [], jnp.zeros(tokens.shape, jnp.int32)
  for _ in range(max_depth):
    ups.append(jnp.where(alive, _take(tokens, cur), -1))
    depth = depth + alive
    cur = jnp.where(alive, _take(parents, cur), -1)
    alive = alive & (cur >= 0)
  return jnp.stack(ups, axis=-1), depth


def merge(tokens: jax.Array, parents: jax.Array, valid: jax.Array, score: jax.Array,
          num_nodes: int, max_depth: int, tags: jax.Array | None = None, num_tags: int = 0):
  """Candidates (module docstring) -> one tree of num_nodes nodes per row.

  max_depth bounds the candidates' depth. tags [B,M] int32 bit flags (e.g. which drafter proposed
  a node): a merged node carries the OR of its duplicates' (the first num_tags bits).
  Returns (draft [B,N] int32 (0 where unfilled), parents [B,N+1] (root -1, unfilled -1),
  depth [B,N+1] (root and unfilled 0), filled [B,N] bool, tags [B,N] int32).
  """
  b, m = tokens.shape
  n = num_nodes
  parents = jnp.broadcast_to(parents, (b, m)).astype(jnp.int32)
  up, depth = path_keys(tokens, parents, max_depth)
  same = jnp.all(up[:, :, None, :] == up[:, None, :, :], axis=-1) & valid[:, None, :]  # [B,M,M]
  canon = jnp.argmax(same, axis=2).astype(jnp.int32)  # the first valid node on the same path
  into = (canon[:, :, None] == jnp.arange(m)[None, None, :]) & valid[:, :, None]  # [B,i,j]: i -> j
  total = jnp.einsum("bij,bi->bj", into.astype(score.dtype), jnp.where(valid, score, 0.0))
  unique = valid & (canon == jnp.arange(m)[None, :])
  cpar = jnp.where(parents >= 0, _take(canon, parents), -1)  # the canonical parent
  for _ in range(max_depth):  # a node never outranks its parent
    total = jnp.where(cpar >= 0, jnp.minimum(total, _take(total, cpar)), total)
  key = jnp.where(unique, total, -jnp.inf)
  # Best first: score descending, then shallower, then earlier (stable sorts, last key first).
  order = jnp.argsort(depth, axis=1, stable=True)
  order = jnp.take_along_axis(order, jnp.argsort(-_take(key, order), axis=1, stable=True), axis=1)
  best = order[:, :n]  # [B,N] (M >= N is checked by the callers)
  filled = jnp.isfinite(_take(key, best))
  # Depth by depth (stable: siblings keep score order); unfilled slots last.
  dsort = jnp.where(filled, _take(depth, best), max_depth + 1)
  best = jnp.take_along_axis(best, jnp.argsort(dsort, axis=1, stable=True), axis=1)
  filled = jnp.isfinite(_take(key, best))
  pc = _take(cpar, best)
  newpar = jnp.where(pc < 0, 0, 1 + jnp.argmax(best[:, None, :] == pc[:, :, None], axis=-1))
  newpar = jnp.where(filled, newpar, -1).astype(jnp.int32)
  root = jnp.full((b, 1), -1, jnp.int32)
  zero = jnp.zeros((b, 1), jnp.int32)
  out_tags = jnp.zeros((b, n), jnp.int32)
  if tags is not None:
    for bit in range(num_tags):
      has = jnp.any(into & (((tags >> bit) & 1) > 0)[:, :, None], axis=1)  # [B,M] per canonical
      out_tags = out_tags | (_take(has.astype(jnp.int32), best) << bit)
  out_tags = jnp.where(filled, out_tags, 0)
  return (jnp.where(filled, _take(tokens, best), 0), jnp.concatenate([root, newpar], axis=1),
          jnp.concatenate([zero, jnp.where(filled, _take(depth, best), 0)], axis=1), filled,
          out_tags)
