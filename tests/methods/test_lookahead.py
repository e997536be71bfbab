"""Lookahead decoding: the combined mask, the n-gram pool, candidate verification, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax import acceptance
from specjax import cache as kv
from specjax import sampling
from specjax.methods.lookahead import layout, pool_init, pool_insert, pool_lookup

from tests.helpers.models import memoryless_model


# ----------------------------------------------------------------------------- mask and layout


@pytest.mark.parametrize("w,n,g", [(3, 3, 2), (1, 2, 1), (4, 4, 3)])
def test_layout_every_node_sees_one_causal_sequence(w, n, g):
  tree, offsets, verify_idx = layout(w, n, g)
  m = n - 1
  t = 1 + (w + g) * m
  assert tree.shape == (t, t) and offsets.shape == (t,) and verify_idx.shape == (g, n)
  for i in range(t):
    seen = np.flatnonzero(tree[i])
    # Positions 0 .. offset[i], each exactly once: the node reads a plain causal context.
    assert sorted(offsets[seen].tolist()) == list(range(offsets[i] + 1)), i
    assert tree[i, 0] and tree[i, i]


def test_layout_branches_are_separate():
  w, n, g = 3, 3, 2
  tree, offsets, verify_idx = layout(w, n, g)
  look = slice(1, 1 + w * (n - 1))
  ver = slice(1 + w * (n - 1), None)
  assert not tree[look, ver].any() and not tree[ver, look].any()
  # Level 1, column 2 (node 1 + 3 + 2 = 6) reads level 0 columns 0..2, itself, at positions 1..4.
  assert np.flatnonzero(tree[6]).tolist() == [0, 1, 2, 3, 6]
  assert offsets[6] == 4
  # Candidate 1 = nodes 7 + 2 = 9, 10: a chain after the pending token, not seeing candidate 0.
  assert verify_idx.tolist() == [[0, 7, 8], [0, 9, 10]]
  assert np.flatnonzero(tree[10]).tolist() == [0, 9, 10] and offsets[9:11].tolist() == [1, 2]


def test_combined_mask_over_cache():
  tree, _, _ = layout(2, 2, 1)  # T = 4
  mask = np.asarray(kv.tree_mask(jnp.array([3, 5]), jnp.asarray(tree), 12))  # [B,T,S]
  assert mask.shape == (2, 4, 12)
  for b, length in enumerate([3, 5]):
    assert mask[b, :, :length].all()  # the committed cache is visible to every node
    assert (mask[b, :, length:length + 4] == tree).all()
    assert not mask[b, :, length + 4:].any()


# ----------------------------------------------------------------------------- the pool


def rows(pool, key):
  cands, valid = pool_lookup(pool, jnp.asarray(key))
  return np.asarray(cands).tolist(), np.asarray(valid).tolist()


def test_pool_insert_lookup_evict():
  pool = pool_init(2, 10, 2, 2)  # B=2, V=10, G=2 slots per key, continuations of 2
  ins = lambda p, k, c, ok=None: pool_insert(p, jnp.asarray(k), jnp.asarray(c),
                                             None if ok is None else jnp.asarray(ok))
  assert rows(pool, [5, 5]) == ([[[-1, -1]] * 2] * 2, [[False, False]] * 2)
  pool = ins(pool, [5, 1], [[1, 2], [7, 7]])
  pool = ins(pool, [5, 5], [[3, 4], [8, 8]])
  assert rows(pool, [5, 5]) == ([[[1, 2], [3, 4]], [[8, 8], [-1, -1]]],
                                [[True, True], [True, False]])
  assert rows(pool, [1, 1])[0][1] == [[7, 7], [-1, -1]]  # rows are independent
  pool = ins(pool, [5, 5], [[1, 2], [8, 8]])  # duplicates: not inserted again
  assert np.asarray(pool.count)[:, 5].tolist() == [2, 1]
  pool = ins(pool, [5, 5], [[6, 7], [9, 9]])  # row 0 full: evicts its oldest, [1, 2]
  assert rows(pool, [5, 5])[0] == [[[6, 7], [3, 4]], [[8, 8], [9, 9]]]
  pool = ins(pool, [5, 5], [[0, 0], [0, 0]], [False, True])  # ok masks a row out
  assert rows(pool, [5, 5])[0] == [[[6, 7], [3, 4]], [[0, 0], [9, 9]]]


# ----------------------------------------------------------------------------- verification


def test_greedy_candidates_picks_longest():
  v = 6
  top = np.array([[[1, 2, 3], [1, 4, 5], [2, 2, 2]]])  # target argmax per candidate row
  logits = jax.nn.one_hot(jnp.asarray(top), v) * 5.0  # [B=1,N=3,G+1=3,V]
  cands = jnp.array([[[1, 9], [1, 4], [-1, -1]]])
  best, n, nxt = acceptance.greedy_candidates(cands, logits)
  assert (int(best[0]), int(n[0]), int(nxt[0])) == (1, 2, 5)
  best, n, nxt = acceptance.greedy_candidates(jnp.full((1, 3, 2), -1), logits)
  assert (int(best[0]), int(n[0]), int(nxt[0])) == (0, 0, 1)


def test_sampled_candidates_first_token_exact():
  """Whatever candidate is chosen, the first emitted token is distributed as the target's."""
  v, b = 5, 40000
  logits0 = jnp.array([0.5, 1.0, -0.3, 0.2, 0.8])
  logits = jax.random.normal(jax.random.PRNGKey(1), (1, 3, 3, v)).at[:, :, 0].set(logits0)
  logits = jnp.broadcast_to(logits, (b, 3, 3, v))
  cands = jnp.broadcast_to(jnp.array([[1, 2], [4, 0], [1, 3]]), (b, 3, 2))
  sp = sampling.SamplingParams.make(b, 1.0)
  best, n, nxt = acceptance.verify_candidates(jax.random.PRNGKey(0), cands, logits, sp)
  chosen = jnp.take_along_axis(cands, best[:, None, None], axis=1)[:, 0]
  first = np.asarray(jnp.where(n > 0, chosen[:, 0], nxt))
  emp = np.bincount(first, minlength=v) / b
  exact = np.asarray(jax.nn.softmax(logits0))
  assert np.abs(emp - exact).max() < 4 * np.sqrt(exact.max() / b)


# ----------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("kw,arg", [(dict(window=0), "window"), (dict(ngram=0), "ngram"),
                                    (dict(ngram=1), "ngram"), (dict(guess=0), "guess"),
                                    (dict(window=2.0), "window"), (dict(guess=-1), "guess")])
def test_bad_arguments(kw, arg):
  with pytest.raises(sj.InputError, match=arg):
    sj.Lookahead(**kw)


# ----------------------------------------------------------------------------- end to end




def test_pool_drafts_are_accepted():
  model = memoryless_model()
  prompts = [[3, 17, 40, 8, 22, 51, 9], [30, 2, 14]]
  ref = sj.generate(model, prompts, sj.Autoregressive(), max_new_tokens=40)
  out = sj.generate(model, prompts, sj.Lookahead(window=6, ngram=3, guess=3), max_new_tokens=40)
  assert out.tokens == ref.tokens
  assert out.stats["accepted_tokens"] > 0 and out.stats["pool_hit_rate"] > 0
  assert out.stats["mean_accepted"] > 1.5 and out.stats["accept_hist"][3] > 0
