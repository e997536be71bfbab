"""Hybrid trees and suffix decoding (methods/merge.py, suffix.py, hybrid.py).

The merged tree against a plain-Python merge; a hybrid tree accepts at least what each of its
drafters accepts alone (greedy, the same states); the suffix store stays bounded and later calls
copy from earlier outputs; bad arguments raise before compiling. Greedy identity and the exact
distribution are the lossless suite's (tests/methods/test_lossless.py: "suffix", "hybrid").
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import specjax as sj
from specjax import methods
from specjax.heads import init_heads
from specjax.methods import merge
from specjax.methods.suffix import SuffixStore, suffix_search

from tests.helpers.models import memoryless_model, random_prompts, tiny_model


def _random_forest(rng, m: int, vocab: int):
  """m candidate nodes (parents before children), tokens from a small vocabulary so that paths
  repeat, prefix-closed validity, integer scores (ties happen, and add exactly in float32)."""
  parents = np.array([int(rng.integers(-1, i)) if i else -1 for i in range(m)], np.int32)
  tokens = rng.integers(0, vocab, size=m).astype(np.int32)
  valid = rng.random(m) < 0.85
  for i in range(m):
    valid[i] &= parents[i] < 0 or valid[parents[i]]
  return tokens, parents, valid, rng.integers(1, 6, size=m).astype(np.float32)


def _paths(tokens, parents):
  out = []
  for i in range(len(tokens)):
    p, j = [], i
    while j >= 0:
      p.append(int(tokens[j]))
      j = parents[j]
    out.append(tuple(reversed(p)))
  return out


def reference_merge(tokens, parents, valid, score, n: int) -> list[tuple]:
  """The merged tree's nodes as token paths, in slot order: equal paths are one node (scores
  summed, first index kept), each score clipped to its parent's, the best n by (score desc, depth,
  first index), then ordered by depth (stable)."""
  nodes: dict = {}
  for i, p in enumerate(_paths(tokens, parents)):
    if valid[i]:
      nodes.setdefault(p, [0.0, i])[0] += float(score[i])
  clipped: dict = {}
  for p in sorted(nodes, key=len):
    clipped[p] = min(nodes[p][0], clipped[p[:-1]]) if len(p) > 1 else nodes[p][0]
  best = sorted(nodes, key=lambda p: (-clipped[p], len(p), nodes[p][1]))[:n]
  return sorted(best, key=len)


def test_merge_matches_reference():
  rng = np.random.default_rng(0)
  b, m, n = 6, 14, 7
  rows = [_random_forest(rng, m, 3) for _ in range(b)]
  stack = [np.stack(x) for x in zip(*rows)]
  depth = max(len(p) for r in rows for p in _paths(r[0], r[1]))
  draft, parents, dep, filled, _ = jax.jit(merge.merge, static_argnums=(4, 5))(*stack, n, depth)
  draft, parents, dep, filled = (np.asarray(x) for x in (draft, parents, dep, filled))
  for r in range(b):
    want = reference_merge(*rows[r], n)
    k = int(filled[r].sum())
    assert k == len(want) and filled[r, :k].all(), "filled slots come first"
    got = _paths(draft[r][:k], parents[r, 1:k + 1] - 1)
    assert got == want, f"row {r}"
    assert (parents[r, 1:k + 1] < np.arange(1, k + 1)).all()  # parents before children
    assert (dep[r, 1:k + 1] == [len(p) for p in got]).all()
    assert (parents[r, k + 1:] == -1).all() and (dep[r, k + 1:] == 0).all()  # masked out


def test_merge_tags_record_every_proposer():
  tokens = np.array([[5, 6, 5, 7]], np.int32)  # drafter 0: 5 -> 6; drafter 1: 5 -> 7
  parents = np.array([[-1, 0, -1, 2]], np.int32)
  tags = np.array([[1, 1, 2, 2]], np.int32)
  draft, par, _, filled, t = merge.merge(tokens, parents, np.ones((1, 4), bool),
                                         np.array([[1.0, 1.0, 0.5, 0.5]], np.float32), 4, 2,
                                         tags, 2)
  assert np.asarray(draft)[0, :3].tolist() == [5, 6, 7]
  assert np.asarray(par)[0, :4].tolist() == [-1, 0, 1, 1]
  assert np.asarray(t)[0].tolist() == [3, 1, 2, 0]  # the shared root token came from both
  assert np.asarray(filled)[0].tolist() == [True, True, True, False]


def test_hybrid_accepts_at_least_each_drafter_alone():
  """From the same states (prefixes of text the model wrote, which repeats itself), one round
  each: the hybrid tree holds every candidate of each drafter, so greedy verification accepts at
  least as many tokens as the best of them, row by row and so in sum."""
  target = memoryless_model(seed=3)
  start = random_prompts(1, target.config.vocab_size, seed=3, lo=6, hi=7)[0]
  text = start + sj.generate(target, [start], max_new_tokens=40, stop_at_eos=False).tokens[0]
  states = [text[:i] for i in range(6, 46, 4)]  # 10 rows, mixed lengths; a cycle from 16 on
  heads = init_heads(target, "medusa", num_heads=3, seed=4, scale=3.0)
  lookup = sj.PromptLookup(ngram=2, num_tokens=4)
  medusa = sj.Medusa(heads, tree=[(0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0)])
  hybrid = sj.Hybrid([lookup, medusa])
  assert hybrid.num_nodes == lookup.num_tokens + medusa.tree.num_nodes  # every candidate kept
  got = {}
  for name, method in (("lookup", lookup), ("medusa", medusa), ("hybrid", hybrid)):
    out = sj.generate(target, states, method, max_new_tokens=2, stop_at_eos=False)
    assert out.stats["steps"] == 2  # the prefill and exactly one round
    got[name] = out.stats["accepted_tokens"]
  print(got)
  assert got["hybrid"] >= max(got["lookup"], got["medusa"]), got
  assert got["lookup"] >= 0.5 * len(states) * lookup.num_tokens, "the text should copy well"


def test_suffix_store_bounded_and_reused():
  store = SuffixStore(capacity=16)
  store.add([[1, 2, 3], [4, 5, 6, 7], []])
  assert store.table.tolist()[:9] == [1, 2, 3, -1, 4, 5, 6, 7, -1]
  for i in range(50):
    store.add([list(range(i, i + 5))])
  assert store.table.shape == (16,) and len(store) <= 15
  assert store.table.tolist() == [*range(48, 53), -1, *range(49, 54), -1] + [-1] * 4  # newest
  store.add([list(range(100))])  # longer than the table: its last tokens
  assert store.table.tolist() == list(range(85, 100)) + [-1]

  # Earlier outputs feed later calls: the same prompts again copy their own earlier answers.
  target = tiny_model(seed=0)
  ps = random_prompts(2, target.config.vocab_size, seed=5, lo=4, hi=9)
  method = sj.SuffixDecoding(store=SuffixStore(512))
  first = sj.generate(target, ps, method, max_new_tokens=24)
  assert first.stats["store_tokens"] == sum(len(t) for t in first.tokens)
  again = sj.generate(target, ps, method, max_new_tokens=24)
  assert again.tokens == first.tokens
  assert again.stats["mean_accepted"] > first.stats["mean_accepted"] + 1.0, (first.stats,
                                                                             again.stats)


def test_suffix_search_prefers_long_matches_then_the_context():
  seq = np.array([[7, 1, 2, 9, 3, 1, 2, 8, 1, 2]], np.int32)  # suffix "1 2": after it 9, 8
  table = np.array([5, 1, 2, 6, 6, -1, -1], np.int32)
  cont, ok, match = suffix_search(seq, np.array([10]), table, 3, 3, 2)
  cont, ok, match = np.asarray(cont)[0], np.asarray(ok)[0], np.asarray(match)[0]
  assert match.tolist() == [2, 2, 2]
  assert cont[0].tolist() == [8, 1] and cont[1].tolist() == [9, 3]  # the context, latest first
  assert cont[2].tolist() == [6, 6] and ok.all()  # then the store


def test_bad_arguments_raise():
  heads = init_heads(tiny_model(seed=0), "medusa", num_heads=2, seed=0)
  eagle = init_heads(tiny_model(seed=0), "eagle", seed=0)
  for bad, match in [(dict(drafters=[]), "empty"), (dict(drafters=sj.PromptLookup()), "list"),
                     (dict(drafters=[sj.Autoregressive()]), "cannot feed"),
                     (dict(drafters=[sj.PromptLookup(num_tokens=3)], num_nodes=4), "num_nodes"),
                     (dict(drafters=[sj.Medusa(heads)], acceptance="typical"), "acceptance"),
                     (dict(drafters=[sj.Medusa(heads), sj.Eagle(eagle)]), "at most one")]:
    with pytest.raises(sj.InputError, match=match):
      sj.Hybrid(**bad)
  with pytest.raises(sj.InputError, match="num_nodes"):
    sj.SuffixDecoding(num_nodes=40, occurrences=4, max_depth=8)
  with pytest.raises(sj.InputError, match="store"):
    sj.SuffixDecoding(store=[1, 2])
  with pytest.raises(sj.InputError, match="capacity"):
    SuffixStore(1)


def test_registry_defaults():
  target = tiny_model(seed=0)
  h = methods.build("hybrid", target)  # no heads for a random model: lookup and suffix
  assert [type(d).__name__ for d in h.drafters] == ["PromptLookup", "SuffixDecoding"]
  heads = init_heads(target, "medusa", num_heads=3, seed=0)
  h = methods.build("hybrid", target, heads=heads)
  assert [type(d).__name__ for d in h.drafters] == ["PromptLookup", "Medusa"]
  assert h.num_nodes == h.drafters[1].tree.num_nodes  # the heads' budget from the cost curve
  h = methods.build("hybrid", target, heads=init_heads(target, "eagle", seed=0))
  assert [type(d).__name__ for d in h.drafters] == ["PromptLookup", "Eagle"]
  assert h.num_nodes == h.drafters[1].num_nodes  # EAGLE's chosen budget
  assert h.drafters[0].num_tokens == min(10, h.num_nodes)
  with pytest.raises(sj.InputError, match="were made for a target of width"):  # another model's
    sj.generate(target, [[1, 2, 3]], sj.Hybrid([sj.PromptLookup(), sj.Eagle(
        init_heads(tiny_model(seed=0, hidden_size=48), "eagle", seed=0))]), max_new_tokens=2)
  assert methods.get("suffix-decoding").cls is sj.SuffixDecoding
