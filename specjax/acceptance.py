"""Acceptance rules: greedy verification and exact speculative (rejection) sampling.

Chain verification (Leviathan et al. 2023; Chen et al. 2023). A draft proposed tokens x_1..x_G
from distributions q_1..q_G; the target scored the G+1 positions and gives p_1..p_{G+1} (after the
same temperature / top-k / top-p as q). Accept x_i with probability min(1, p_i(x_i) / q_i(x_i))
while they are accepted; at the first rejection i sample from norm(max(0, p_i - q_i)); if all G
are accepted sample a bonus token from p_{G+1}. The output is distributed exactly as the target's.

Greedy (temperature 0) is the same rule with one-hot p: accept while x_i == argmax p_i, then emit
the target's argmax. Deterministic drafters (prompt lookup, lookahead) pass q = one-hot(x).

Batched: each row accepts its own number n[b] in [0, G]; every shape is static.
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
  best = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B,G+1]
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
  top = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B,N,G+1]
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
