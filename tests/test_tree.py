"""Candidate trees (specjax/tree.py) and tree verification (specjax/acceptance.py).

Tree tables against a brute-force reference; the tree forward against plain causal forwards of
each node's path; the greedy builder against exhaustive search; the budget chooser; the rules
(greedy, exact multi-draft, typical) on hand-made distributions.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import acceptance, sampling, tree as T
from specjax import cache as kv
from specjax.errors import InputError

from tests.helpers.models import tiny_model

TREES = [
    [(0,)],
    [(0,), (0, 0), (0, 0, 0)],
    [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)],
    [(1, 0), (0,), (1,), (0, 2), (0, 2, 1), (3,), (0, 0)],  # unsorted input, gaps in ranks
    [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)],
]


def brute(paths):
  """Reference tables computed from prefixes alone."""
  nodes = [()] + sorted(map(tuple, paths), key=lambda p: (len(p), p))
  n1 = len(nodes)
  parent = [-1] + [nodes.index(p[:-1]) for p in nodes[1:]]
  anc = np.array([[len(q) <= len(p) and p[:len(q)] == q for q in nodes] for p in nodes])
  dmax = max(len(p) for p in nodes)
  path = np.zeros((n1, dmax), int)
  for i, p in enumerate(nodes):
    for d in range(1, len(p) + 1):
      path[i, d - 1] = nodes.index(p[:d])
  leaves = [i for i, p in enumerate(nodes) if not any(len(q) > len(p) and q[:len(p)] == p
                                                      for q in nodes)]
  return nodes, parent, anc, path, leaves


@pytest.mark.parametrize("paths", TREES, ids=lambda p: f"N{len(p)}")
def test_tables_match_brute_force(paths):
  t = T.Tree(paths)
  nodes, parent, anc, path, leaves = brute(paths)
  assert t.num_nodes == len(paths)
  assert t.paths == tuple(nodes[1:])
  np.testing.assert_array_equal(t.parent, parent)
  np.testing.assert_array_equal(t.depth, [len(p) for p in nodes])
  np.testing.assert_array_equal(t.head[1:], [len(p) - 1 for p in nodes[1:]])
  np.testing.assert_array_equal(t.rank[1:], [p[-1] for p in nodes[1:]])
  np.testing.assert_array_equal(t.ancestor, anc)
  np.testing.assert_array_equal(t.path, path)
  np.testing.assert_array_equal(t.leaves, leaves)
  assert all(t.parent[i] < i for i in range(1, t.num_nodes + 1))  # verification order
  # Device helpers give the same tables (what a dynamic tree uses).
  np.testing.assert_array_equal(T.ancestors_from_parents(jnp.asarray(t.parent), t.max_depth), anc)
  rows = jnp.asarray(anc)
  np.testing.assert_array_equal(T.path_nodes(rows, jnp.asarray(t.depth), t.max_depth), path)


def test_tree_is_hashable_and_normalised():
  a = T.Tree([(1,), (0,), (0, 0)])
  b = T.Tree([[0], [1], [0, 0]])
  assert a == b and hash(a) == hash(b)
  assert a.paths == ((0,), (1,), (0, 0))
  assert T.chain(3).paths == ((0,), (0, 0), (0, 0, 0))


@pytest.mark.parametrize("paths,match", [
    ([], "empty"),
    ([(0,), (0,)], "listed twice"),
    ([(0,), (1, 0)], "no parent"),
    ([(0,), (-1,)], ">= 0"),
    ([(0,), ()], "non-empty"),
    ("01", "list of paths"),
    ([(0.5,)], "integers"),
])
def test_bad_trees(paths, match):
  with pytest.raises(InputError, match=match):
    T.Tree(paths)


# ----------------------------------------------------------------------------- the tree forward


@pytest.mark.parametrize("paths", TREES[1:4], ids=lambda p: f"N{len(p)}")
def test_tree_forward_equals_causal_forward_of_each_path(paths):
  """Logits at every node of one tree forward == the causal forward of prompt + root + its path."""
  model = tiny_model(seed=2)
  t = T.Tree(paths)
  rng = np.random.default_rng(0)
  prompt = rng.integers(0, 61, 7).tolist()
  block = rng.integers(0, 61, t.num_nodes + 1)  # root + nodes
  s = 32
  p = len(prompt)
  cache = model.init_cache(1, s)
  toks = jnp.asarray([prompt])
  _, _, cache = model.apply(model.params, toks, jnp.arange(p)[None], cache,
                            kv.causal_mask(cache.lengths, p, s))
  cache = kv.rollback(cache, jnp.asarray([p]))
  pos = p + jnp.asarray(t.depth)[None]
  mask = kv.tree_mask(cache.lengths, jnp.asarray(t.ancestor), s)
  logits, _, _ = model.apply(model.params, jnp.asarray(block)[None], pos, cache, mask)
  for i in range(t.num_nodes + 1):
    seq = prompt + [int(block[j]) for j in [0] + [int(x) for x in t.path[i, :t.depth[i]]]]
    c2 = model.init_cache(1, s)
    ref, _, _ = model.apply(model.params, jnp.asarray([seq]), jnp.arange(len(seq))[None], c2,
                            kv.causal_mask(c2.lengths, len(seq), s))
    np.testing.assert_allclose(logits[0, i], ref[0, -1], atol=1e-5, rtol=1e-5)


def test_commit_keeps_the_accepted_path_in_order():
  c = kv.init(1, 2, 16, 1, 1)
  vals = jnp.arange(16, dtype=jnp.float32)[None, None, :, None] + jnp.array([0, 100.])[:, None, None, None]
  c = c.replace(layers=({"k": vals, "v": vals},), lengths=jnp.array([3, 5]))
  out = kv.commit(c, jnp.array([[0, 2, 4], [0, 1, 3]]), jnp.array([3, 2]))
  np.testing.assert_array_equal(out.lengths, [6, 7])
  np.testing.assert_array_equal(out.layers[0]["k"][0, 0, 3:6, 0], [3, 5, 7])
  np.testing.assert_array_equal(out.layers[0]["k"][1, 0, 5:7, 0], [105, 106])
  np.testing.assert_array_equal(out.layers[0]["k"][1, 0, :5, 0], np.arange(100, 105))  # untouched


# ----------------------------------------------------------------------------- construction


def _closed_subsets(k, r, n):
  """Every parent-closed set of n nodes in the full tree of depth k and r ranks."""
  all_nodes = [p for d in range(1, k + 1) for p in itertools.product(range(r), repeat=d)]
  for sub in itertools.combinations(all_nodes, n):
    s = set(sub)
    if all(len(p) == 1 or p[:-1] in s for p in sub):
      yield sub


@pytest.mark.parametrize("n", [1, 3, 5])
def test_builder_is_optimal(n):
  rng = np.random.default_rng(n)
  acc = np.sort(rng.uniform(0, 0.5, (3, 3)), axis=1)[:, ::-1]
  t = T.build_tree(acc, n)
  assert t.num_nodes == n
  best = max(T.expected_accepted(T.Tree(s), acc) for s in _closed_subsets(3, 3, n))
  assert T.expected_accepted(t, acc) == pytest.approx(best)


def test_builder_prefers_likely_heads_and_default_tree():
  acc = np.array([[0.9, 0.05], [0.9, 0.05], [0.01, 0.0]])
  assert T.build_tree(acc, 2).paths == ((0,), (0, 0))
  t = T.default_tree(4)
  assert t.num_nodes == 15 and t.max_depth <= 4
  assert T.expected_accepted(t, T.prior_accuracies(4)) > T.expected_accepted(T.chain(4), T.prior_accuracies(4))


def test_budget_chooser():
  acc = T.prior_accuracies(4)
  flat = T.choose_budget({1: 1.0, 64: 1.0}, acc, max_nodes=20)  # free verification: biggest tree
  assert flat["num_nodes"] == 20
  steep = T.choose_budget({1: 1.0, 2: 2.0, 3: 3.0}, acc, max_nodes=20)  # cost ~ tokens: smallest
  assert steep["num_nodes"] == 1
  cpu = T.choose_budget({1: 1, 2: 1.53, 4: 1.71, 8: 2.15, 16: 2.82}, acc, max_nodes=64)
  assert 1 < cpu["num_nodes"] < 16
  n, tau, c, speed = cpu["table"][cpu["num_nodes"] - 1]
  assert speed == pytest.approx(max(row[3] for row in cpu["table"]))
  assert tau == pytest.approx(1 + T.expected_accepted(cpu["tree"], acc))
  assert c == pytest.approx(T.interpolate_cost({1: 1, 2: 1.53, 4: 1.71, 8: 2.15, 16: 2.82},
                                               cpu["num_nodes"] + 1))
  assert T.interpolate_cost({1: 1, 2: 1.5, 4: 2.0}, 3) == pytest.approx(1.75)
  assert T.interpolate_cost({1: 1, 2: 1.5, 4: 2.0}, 8) == pytest.approx(3.0)
  # A noisy curve (c(8) measured below c(2)) is read as non-decreasing: 8 tokens never look
  # cheaper than 2, and a tree of 7 nodes is not preferred for a spurious dip.
  noisy = {1: 1.0, 2: 1.6, 4: 1.7, 8: 1.3, 16: 2.4}
  assert [T.interpolate_cost(noisy, t) for t in (2, 6, 8, 12)] == pytest.approx([1.6, 1.7, 1.7, 2.05])
  assert T.choose_budget(noisy, acc, max_nodes=20)["table"][6][2] == pytest.approx(1.7)
  with pytest.raises(InputError, match="accuracies"):
    T.choose_budget({1: 1.0}, [[1.5]])
  with pytest.raises(InputError, match="cost"):
    T.choose_budget({0: 1.0}, acc)


# ----------------------------------------------------------------------------- the rules

V = 6
SMALL = T.Tree([(0,), (1,), (2,), (0, 0), (1, 0)])  # nodes 1-3 children of the root, 4 of 1, 5 of 2


def _setup(b):
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(0, 1.5, (1, SMALL.num_nodes + 1, V)), jnp.float32)
  logits = jnp.broadcast_to(logits, (b,) + logits.shape[1:])
  tokens = jnp.broadcast_to(jnp.array([[5, 0, 1, 2, 3, 4]], jnp.int32), (b, 6))
  return tokens, logits


def test_greedy_tree_takes_longest_matching_path():
  tokens, logits = _setup(1)
  top = np.asarray(jnp.argmax(logits[0], -1))
  # Make the argmax at the root equal node 2's token and at node 2 equal node 5's token.
  tok = np.array([[5, 0, int(top[0]), 2, 3, int(top[2])]], np.int32)
  if tok[0, 1] == top[0]:
    tok[0, 1] = (top[0] + 1) % V
  if tok[0, 3] == top[0]:
    tok[0, 3] = (top[0] + 2) % V
  best, n, nxt = acceptance.greedy_tree(jnp.asarray(tok), SMALL.parent, SMALL.ancestor,
                                        SMALL.depth, logits)
  assert int(best[0]) == 5 and int(n[0]) == 2 and int(nxt[0]) == int(top[5])


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 3)])
def test_exact_multi_draft_marginals(temperature, top_k):
  """The token after the root, and the pair (first, second), are distributed as the target's."""
  b = 40000
  tokens, logits = _setup(b)
  sp = sampling.SamplingParams.make(b, temperature, top_k)
  best, n, nxt = jax.jit(acceptance.multi_draft_tree)(jax.random.PRNGKey(1), tokens,
                                                      jnp.asarray(SMALL.parent), jnp.asarray(SMALL.depth),
                                                      logits, sp)
  path = np.asarray(SMALL.path)[np.asarray(best)]
  tok = np.asarray(tokens)
  first = np.where(np.asarray(n) >= 1, tok[np.arange(b), path[:, 0]], np.asarray(nxt))
  p = np.asarray(sampling.probs(logits[:1], sampling.SamplingParams.make(1, temperature, top_k)))[0]
  emp = np.bincount(first, minlength=V) / b
  tv = 0.5 * np.abs(emp - p[0]).sum()
  assert tv < 0.015, (emp, p[0])
  # Given the first token was node 1's (token 0), the second is distributed as p at node 1.
  sel = (np.asarray(n) >= 1) & (path[:, 0] == 1)
  second = np.where(np.asarray(n)[sel] >= 2, tok[sel][:, 4], np.asarray(nxt)[sel])
  emp2 = np.bincount(second, minlength=V) / sel.sum()
  assert 0.5 * np.abs(emp2 - p[1]).sum() < 0.03
  # Accepting every first child is not exact.
  _, n_bad, nxt_bad = acceptance.multi_draft_tree(jax.random.PRNGKey(1), tokens, SMALL.parent,
                                                  SMALL.depth, logits, sp, accept_all=True)
  assert np.all(np.asarray(n_bad) >= 1)


def test_exact_reduces_to_greedy_at_temperature_0():
  tokens, logits = _setup(3)
  sp = sampling.SamplingParams.make(3, 0.0)
  top = np.asarray(jnp.argmax(logits[0], -1))
  tokens = tokens.at[:, 2].set(int(top[0]))  # node 2 matches
  g = acceptance.greedy_tree(tokens, SMALL.parent, SMALL.ancestor, SMALL.depth, logits)
  e = acceptance.multi_draft_tree(jax.random.PRNGKey(0), tokens, SMALL.parent, SMALL.depth, logits, sp)
  for x, y in zip(g, e):
    np.testing.assert_array_equal(x, y)


def test_typical_rule_on_hand_made_distributions():
  # Threshold min(eps, delta * exp(-H)): a peaked p has H ~ 0 -> min(0.09, 0.3) = 0.09;
  # the uniform over 6 has H = log 6 -> 0.3 / 6 = 0.05.
  peaked = jnp.array([0.97, 0.01, 0.01, 0.01, 0.0, 0.0])
  uniform = jnp.full((6,), 1 / 6)
  thr = acceptance.typical_threshold(jnp.stack([peaked, uniform]), 0.09, 0.3)
  h = -np.sum([x * np.log(x) for x in np.asarray(peaked) if x > 0])
  np.testing.assert_allclose(thr, [min(0.09, 0.3 * np.exp(-h)), 0.3 / 6], rtol=1e-5)
  # A tree of two children under the root: under the uniform p (1/6 > 0.05) node 1 passes, and
  # its child passes under the peaked p only if it is token 0.
  t = T.Tree([(0,), (1,), (0, 0)])
  logp = jnp.log(jnp.stack([uniform, peaked, uniform, peaked]) + 1e-30)[None]  # [1,4,6]
  sp = sampling.SamplingParams.make(1, 1.0)
  for child, want in [(0, 3), (1, 1)]:
    tokens = jnp.array([[0, 4, 5, child]], jnp.int32)
    best, n, _ = acceptance.typical_tree(jax.random.PRNGKey(0), tokens, t.parent, t.ancestor,
                                         t.depth, logp, sp, 0.09, 0.3)
    assert int(best[0]) == want and int(n[0]) == t.depth[want]
  # A low-probability token under a peaked p fails: nothing past the root.
  logp2 = jnp.log(jnp.stack([peaked] * 4) + 1e-30)[None]
  best, n, _ = acceptance.typical_tree(jax.random.PRNGKey(0), jnp.array([[0, 1, 2, 0]]), t.parent,
                                       t.ancestor, t.depth, logp2, sp, 0.09, 0.3)
  assert int(n[0]) == 0


def test_typical_equals_greedy_at_temperature_0():
  tokens, logits = _setup(4)
  top = np.asarray(jnp.argmax(logits[0], -1))
  tokens = tokens.at[1, 1].set(int(top[0])).at[2, 3].set(int(top[0]))
  sp = sampling.SamplingParams.make(4, 0.0)
  g = acceptance.greedy_tree(tokens, SMALL.parent, SMALL.ancestor, SMALL.depth, logits)
  ty = acceptance.typical_tree(jax.random.PRNGKey(0), tokens, SMALL.parent, SMALL.ancestor,
                               SMALL.depth, logits, sp, 0.09, 0.3)
  for x, y in zip(g, ty):
    np.testing.assert_array_equal(x, y)


def test_rules_take_per_row_trees():
  """Dynamic trees (EAGLE-2) pass parents / ancestors / depths per row: same results as static."""
  b = 3
  tokens, logits = _setup(b)
  top = np.asarray(jnp.argmax(logits[0], -1))
  tokens = tokens.at[0, 1].set(int(top[0])).at[1, 2].set(int(top[0]))
  par = jnp.broadcast_to(jnp.asarray(SMALL.parent), (b, 6))
  anc = T.ancestors_from_parents(par, SMALL.max_depth)  # [B,6,6] built on device
  dep = jnp.broadcast_to(jnp.asarray(SMALL.depth), (b, 6))
  sp = sampling.SamplingParams.make(b, 0.8)
  key = jax.random.PRNGKey(3)
  for rule in ("greedy", "exact", "typical"):
    static = acceptance.verify_tree(key, tokens, SMALL.parent, SMALL.ancestor, SMALL.depth,
                                    logits, sp, rule)
    rows = acceptance.verify_tree(key, tokens, par, anc, dep, logits, sp, rule)
    for x, y in zip(static, rows):
      np.testing.assert_array_equal(x, y)
