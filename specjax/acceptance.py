"""Acceptance rules: greedy verification and exact speculative (rejection) sampling.

Chain verification (Leviathan et al. 2023; Chen et al. 2023). A draft proposed tokens x_1..x_G
from distributions q_1..q_G; the target scored the G+1 positions and gives p_1..p_{G+1} (after the
same temperature / top-k / top-p as q). Accept x_i with probability min(1, p_i(x_i) / q_i(x_i))
while they are accepted; at the first rejection i sample from norm(max(0, p_i - q_i)); if all G
are accepted sample a bonus token from p_{G+1}. The output is distributed exactly as the target's.

Greedy (temperature 0) is the same rule with one-hot p: accept while x_i == argmax p_i, then emit
the target's argmax. Deterministic drafters (prompt lookup, lookahead) pass q = one-hot(x).

Batched: each row accepts its own number n[b] in [0, G]; every shape is static.

Trees (Medusa, EAGLE; bottom of this file): the same rules over a candidate tree verified in one
call: greedy / token matching, exact multi-draft verification of deterministic candidates
(SpecInfer's rule), and Medusa-2's typical acceptance (lossy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax import sampling
from specjax.sampling import SamplingParams


def _leading_true(ok: jax.Array) -> jax.Array:
  """ok [B,G] bool -> [B] int32 number of leading True values."""
  return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def greedy_chain(draft: jax.Array, target_logits: jax.Array):
  """draft [B,G]; target_logits [B,G+1,V] -> (n_accepted [B], next_token [B]).

  The emitted tokens are draft[:, :n] followed by next_token (the target's argmax at n).
  """
  best = sampling.argmax(target_logits)  # [B,G+1]
  n = _leading_true(draft == best[:, :-1])
  return n, jnp.take_along_axis(best, n[:, None], axis=1)[:, 0]


def rejection_chain(key: jax.Array, draft: jax.Array, q: jax.Array | None, target_logits: jax.Array,
                    sp: SamplingParams):
  """Exact speculative sampling.

  draft [B,G] int32; q [B,G,V] the draft's (already filtered) distributions, or None for a
  deterministic draft (q = one-hot(draft)); target_logits [B,G+1,V].
  Returns (n_accepted [B], next_token [B]).
  """
  b, g = draft.shape
  v = target_logits.shape[-1]
  p = sampling.probs(target_logits, sp)  # [B,G+1,V]
  if q is None:
    q = jax.nn.one_hot(draft, v, dtype=jnp.float32)
  k_acc, k_res = jax.random.split(key)
  px = jnp.take_along_axis(p[:, :g], draft[..., None], axis=-1)[..., 0]  # [B,G]
  qx = jnp.take_along_axis(q, draft[..., None], axis=-1)[..., 0]
  r = jax.random.uniform(k_acc, (b, g))
  # r < p/q  <=>  r * q < p (no division; a token q could not have drawn is rejected).
  ok = (r * qx < px) & (qx > 0)
  n = _leading_true(ok)
  # Distribution of the next token: residual at the first rejection, else the bonus p_{G+1}.
  q_pad = jnp.concatenate([q, jnp.zeros((b, 1, v), q.dtype)], axis=1)  # [B,G+1,V]
  p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]  # [B,V]
  q_n = jnp.take_along_axis(q_pad, n[:, None, None], axis=1)[:, 0]
  res = jnp.maximum(p_n - q_n, 0.0)
  total = jnp.sum(res, axis=-1, keepdims=True)
  # p == q exactly leaves no residual mass; then rejection had probability 0, and p_n is right.
  res = jnp.where(total > 0, res / jnp.where(total > 0, total, 1.0), p_n)
  nxt = sampling.sample_probs(k_res, res)
  return n, nxt


def verify_chain(key: jax.Array, draft: jax.Array, q: jax.Array | None, target_logits: jax.Array,
                 sp: SamplingParams):
  """Greedy rows take the cheap argmax path when the whole batch is greedy; otherwise exact
  rejection sampling (which reduces to greedy verification on temperature-0 rows)."""
  return jax.lax.cond(
      jnp.all(sp.temperature == 0),
      lambda: greedy_chain(draft, target_logits),
      lambda: rejection_chain(key, draft, q, target_logits, sp),
  )


def greedy_candidates(cands: jax.Array, target_logits: jax.Array):
  """Greedy verification of N candidate chains at once (lookahead's n-grams).

  cands [B,N,G] int32 (-1 = no candidate); target_logits [B,N,G+1,V]: row n scored
  [pending, cands[:, n]]. Returns (best [B] the candidate with the longest accepted prefix, the
  first on ties; n_accepted [B]; next_token [B] the target's argmax after it).
  """
  top = sampling.argmax(target_logits)  # [B,N,G+1]
  b, num, g = cands.shape
  acc = _leading_true((cands == top[:, :, :-1]).reshape(b * num, g)).reshape(b, num)
  best = jnp.argmax(acc, axis=1).astype(jnp.int32)
  n = jnp.take_along_axis(acc, best[:, None], axis=1)[:, 0]
  row = jnp.take_along_axis(top, best[:, None, None], axis=1)[:, 0]  # [B,G+1]
  return best, n, jnp.take_along_axis(row, n[:, None], axis=1)[:, 0]


def verify_candidates(key: jax.Array, cands: jax.Array, target_logits: jax.Array,
                      sp: SamplingParams):
  """Verifies N deterministic candidate chains; returns (best [B], n_accepted [B], next [B]).

  cands [B,N,G] int32 (-1 = none); target_logits [B,N,G+1,V]. Greedy batches: the longest
  argmax-matching prefix (`greedy_candidates`). Otherwise one candidate per row is chosen from
  the target's probabilities alone (the most tokens expected to be accepted, sum_j prod_i<=j
  p_i(x_i)) and exact rejection with a one-hot draft runs on it. The choice uses no acceptance
  randomness, and rejection sampling is exact for any draft fixed before its coins are drawn, so
  the output is distributed as the target's. Temperature-0 rows pick the greedy choice.
  """

  def sampled():
    p = sampling.probs(target_logits, sp)  # [B,N,G+1,V]
    g = cands.shape[2]
    px = jnp.take_along_axis(p[:, :, :g], jnp.maximum(cands, 0)[..., None], axis=-1)[..., 0]
    px = jnp.where(cands >= 0, px, 0.0)  # [B,N,G]
    score = jnp.sum(jnp.cumprod(px, axis=-1), axis=-1)  # expected accepted tokens
    best = jnp.argmax(score, axis=1).astype(jnp.int32)
    draft = jnp.take_along_axis(cands, best[:, None, None], axis=1)[:, 0]  # [B,G]
    logits = jnp.take_along_axis(target_logits, best[:, None, None, None], axis=1)[:, 0]
    n, nxt = rejection_chain(key, draft, None, logits, sp)
    return best, n, nxt

  return jax.lax.cond(jnp.all(sp.temperature == 0),
                      lambda: greedy_candidates(cands, target_logits), sampled)


# ----------------------------------------------------------------------------- trees
#
# Tree verification (Medusa, SpecInfer, EAGLE). The target scored one block [root, node_1..node_N]
# (root = the pending token) under a tree mask; tokens [B,N+1] holds the block, parents [N+1] or
# [B,N+1] each node's parent (root: -1; a parent's index is below its children's, and siblings
# are tried in index order), target_logits [B,N+1,V] the target at every node (its distribution
# for the node's children). Every rule returns (best [B] the deepest accepted node, 0 = only the
# root; n_accepted [B] its depth; next_token [B] the token emitted after it).


def _per_row(table, b: int, ndim: int) -> jax.Array:
  """table of `ndim` dims per tree, or with a leading [B]: -> [B, ...]."""
  table = jnp.asarray(table)
  return table if table.ndim == ndim + 1 else jnp.broadcast_to(table, (b,) + table.shape)


def _deepest(ok: jax.Array, ancestor, depth) -> jax.Array:
  """ok [B,N+1] (node's own test passed; root True) -> the deepest node whose whole path passed
  (the first in index order on ties) [B]."""
  b = ok.shape[0]
  anc = _per_row(ancestor, b, 2)  # [B,N+1,N+1]
  path_ok = jnp.all(jnp.where(anc, ok[:, None, :], True), axis=-1)  # [B,N+1]
  return jnp.argmax(jnp.where(path_ok, _per_row(depth, b, 1), -1), axis=1).astype(jnp.int32)


def _at_parent(x: jax.Array, parents) -> jax.Array:
  """x [B,N+1,...] -> x at each node's parent [B,N+1,...] (the root reads itself)."""
  b = x.shape[0]
  par = jnp.maximum(_per_row(parents, b, 1), 0)
  return jnp.take_along_axis(x, par.reshape(par.shape + (1,) * (x.ndim - 2)), axis=1)


def _depth_of(best, depth, b):
  return jnp.take_along_axis(_per_row(depth, b, 1), best[:, None], axis=1)[:, 0]


def greedy_tree(tokens: jax.Array, parents, ancestor, depth, target_logits: jax.Array,
                choice: jax.Array | None = None):
  """Greedy: the longest root-to-node path whose every token is the target's argmax at its parent
  (one path at most can match, since siblings differ), then the argmax after it.

  choice [B,N+1]: the target's token at each node if not its argmax. With one independent sample
  per node (`sampling.sample`), this is token matching under sampling: every emitted token is the
  target's own draw at the node it follows, so it is exact, with less acceptance than
  `multi_draft_tree` (a child is accepted only if the one draw equals it).
  """
  top = sampling.argmax(target_logits) if choice is None else choice
  b = tokens.shape[0]
  ok = (tokens == _at_parent(top, parents)).at[:, 0].set(True)
  best = _deepest(ok, ancestor, depth)
  return best, _depth_of(best, depth, b), jnp.take_along_axis(top, best[:, None], axis=1)[:, 0]


def multi_draft_tree(key: jax.Array, tokens: jax.Array, parents, depth, target_logits: jax.Array,
                     sp: SamplingParams, accept_all: bool = False):
  """Exact verification of deterministic candidates (SpecInfer's multi-draft rule, as EAGLE).

  From the root, the children of the current node are tried in index order: child x is accepted
  with probability r(x) / sum(r), r = the target's p at the current node with the children
  already rejected there zeroed; an accepted child becomes the current node (r = p at it),
  a rejected one is zeroed out of r. When no child is left, the next token is sampled from r.
  P(emit x) = p(x) for every x at every node, so the output is distributed as the target's.
  Temperature-0 rows (one-hot p) accept exactly the argmax. accept_all=True breaks the rule on
  purpose (every first child is accepted), for the test that must catch it.
  """
  b, n1 = tokens.shape
  p = sampling.probs(target_logits, sp)  # [B,N+1,V]
  par = _per_row(parents, b, 1)
  k_acc, k_res = jax.random.split(key)
  u = jax.random.uniform(k_acc, (b, n1))
  rows = jnp.arange(b)

  def body(i, carry):
    cur, r, mass = carry  # [B], [B,V] residual (unnormalised), [B] its mass
    x = tokens[:, i]
    tried = par[:, i] == cur
    rx = r[rows, x]
    ok = tried & ((u[:, i] * mass < rx) | accept_all)
    rejected = tried & ~ok
    p_i = jax.lax.dynamic_index_in_dim(p, i, axis=1, keepdims=False)  # [B,V]
    r = jnp.where(ok[:, None], p_i, r.at[rows, x].set(jnp.where(rejected, 0.0, rx)))
    mass = jnp.where(ok, jnp.sum(p_i, axis=-1), jnp.where(rejected, jnp.maximum(mass - rx, 0.0),
                                                            mass))
    return jnp.where(ok, i, cur), r, mass

  cur0 = jnp.zeros((b,), jnp.int32)
  best, r, _ = jax.lax.fori_loop(1, n1, body, (cur0, p[:, 0], jnp.sum(p[:, 0], axis=-1)))
  nxt = sampling.sample_probs(k_res, r)
  return best, _depth_of(best, depth, b), nxt


def typical_threshold(p: jax.Array, epsilon: float, delta: float) -> jax.Array:
  """Medusa-2's typical acceptance threshold min(epsilon, delta * exp(-H(p))); p [...,V] -> [...]."""
  ent = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
  return jnp.minimum(epsilon, delta * jnp.exp(-ent))


def typical_tree(key: jax.Array, tokens: jax.Array, parents, ancestor, depth,
                 target_logits: jax.Array, sp: SamplingParams, epsilon: float, delta: float):
  """Typical acceptance (Medusa-2; lossy): node x passes when p(x) > min(epsilon, delta exp(-H(p)))
  under the target's (temperature-scaled, filtered) p at its parent; the deepest node whose path
  passes is accepted (first on ties), and the next token is sampled from p there. At temperature
  0 p is one-hot, the threshold is min(epsilon, delta) < 1, and this is greedy verification."""
  b = tokens.shape[0]
  p = sampling.probs(target_logits, sp)  # [B,N+1,V]
  thr = typical_threshold(p, epsilon, delta)  # [B,N+1]
  px = jnp.take_along_axis(_at_parent(p, parents), tokens[:, :, None], axis=-1)[..., 0]
  ok = (px > _at_parent(thr, parents)).at[:, 0].set(True)
  best = _deepest(ok, ancestor, depth)
  p_best = jnp.take_along_axis(p, best[:, None, None], axis=1)[:, 0]
  return best, _depth_of(best, depth, b), sampling.sample_probs(key, p_best)


def verify_tree(key: jax.Array, tokens: jax.Array, parents, ancestor, depth,
                target_logits: jax.Array, sp: SamplingParams, rule: str = "exact",
                epsilon: float = 0.09, delta: float = 0.3):
  """rule "greedy" (token matching: exact at any temperature, see `greedy_tree`) | "exact"
  (`multi_draft_tree`) | "typical" (`typical_tree`, lossy). All-greedy batches take the argmax
  path whatever the rule (every rule reduces to it at temperature 0). Returns (best, n, next) [B].
  "accept_all" is a deliberately wrong rule (every first child accepted) for the tests that must
  catch it.
  """
  if rule not in ("greedy", "exact", "typical", "accept_all"):
    raise ValueError(f"unknown tree acceptance rule {rule!r}")

  def sampled():
    if rule == "greedy":
      choice = sampling.sample(key, target_logits, sp)  # [B,N+1] one draw per node
      return greedy_tree(tokens, parents, ancestor, depth, target_logits, choice)
    if rule == "typical":
      return typical_tree(key, tokens, parents, ancestor, depth, target_logits, sp, epsilon, delta)
    return multi_draft_tree(key, tokens, parents, depth, target_logits, sp,
                            accept_all=(rule == "accept_all"))

  return jax.lax.cond(jnp.all(sp.temperature == 0),
                      lambda: greedy_tree(tokens, parents, ancestor, depth, target_logits), sampled)
