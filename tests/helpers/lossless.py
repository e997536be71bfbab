"""The lossless suite's cases and its distribution check (tests/methods/test_lossless.py runs them;
the kernel and sharding tests run the same cases).

Cases are named by the method's registry name (specjax.methods), "name" or "name/variant". To add
a method: append (name, factory) pairs to GREEDY_METHODS and SAMPLING_METHODS; factory(target) ->
method. Every registered method must have both (test_every_registered_method_is_in_the_suite).
"""

from __future__ import annotations

import jax
import numpy as np

import specjax as sj
from specjax import cache as kv
from specjax import sampling

from tests.helpers.models import random_prompts, tiny_model


GREEDY_METHODS = [
    ("autoregressive", lambda target: sj.Autoregressive()),
    ("prompt-lookup", lambda target: sj.PromptLookup(ngram=2, num_tokens=4)),
    ("prompt-lookup/adaptive", lambda target: sj.PromptLookup(ngram=2, num_tokens=4,
                                                              adaptive=True)),
    ("lookahead", lambda target: sj.Lookahead(window=3, ngram=3, guess=2)),
]
SAMPLING_METHODS = [
    ("autoregressive", lambda target: sj.Autoregressive()),
    ("prompt-lookup", lambda target: sj.PromptLookup(ngram=2, num_tokens=3)),
    ("prompt-lookup/adaptive", lambda target: sj.PromptLookup(ngram=2, num_tokens=3,
                                                              adaptive=True)),
    ("lookahead", lambda target: sj.Lookahead(window=3, ngram=3, guess=2)),
]


# ---- draft.py (issue 3): a separate draft model (as its own draft: alpha = 1; random: alpha ~ 0;
# the target's first layer over a vocabulary subset: in between), adaptive gamma, layer-skip.


def _random_draft(target, seed=7):
  return tiny_model(seed=seed, scale=0.15, vocab_size=target.config.vocab_size)


def _layer_draft(target):
  from specjax.shipped import draft_from_target
  v = target.config.vocab_size
  return draft_from_target(target, 1, vocab=np.arange(0, v, 2) if v > 20 else np.arange(v - 3))


GREEDY_METHODS += [
    ("draft/self", lambda target: sj.DraftModel(target, gamma=4)),
    ("draft/random", lambda target: sj.DraftModel(_random_draft(target), gamma=3)),
    ("draft/subset-adaptive", lambda target: sj.DraftModel(_layer_draft(target), gamma=4,
                                                           adaptive=True, threshold=0.3)),
    ("layer-skip", lambda target: sj.SelfSpeculative(exit_layer=1, gamma=3)),
    ("layer-skip/adaptive", lambda target: sj.SelfSpeculative(exit_layer=1, gamma=4, adaptive=True)),
    ("layer-skip/subset-threshold", lambda target: sj.SelfSpeculative(
        exit_layer=1, gamma=4, threshold=0.3, vocab=_layer_draft(target).vocab_subset)),
]
SAMPLING_METHODS += [
    ("draft/random", lambda target: sj.DraftModel(_random_draft(target), gamma=3)),
    ("draft/subset-adaptive", lambda target: sj.DraftModel(_layer_draft(target), gamma=3,
                                                           adaptive=True, threshold=0.2)),
    ("layer-skip", lambda target: sj.SelfSpeculative(exit_layer=1, gamma=2)),
    ("layer-skip/subset", lambda target: sj.SelfSpeculative(exit_layer=1, gamma=2,
                                                           vocab=_layer_draft(target).vocab_subset)),
]


# ---- methods/pard.py: a parallel draft fills gamma - 1 masks in one forward. The target as its
# own parallel draft gets q_1 right at every step, so the multi-token acceptance path runs.


def _pard(draft, **options):
  return lambda target: sj.ParallelDraft(draft(target), mask_token_id=target.config.vocab_size - 1,
                                         **options)


GREEDY_METHODS += [
    ("pard/self", _pard(lambda target: target, gamma=4)),
    ("pard/random", _pard(_random_draft, gamma=3)),
    ("pard/subset-adaptive", _pard(_layer_draft, gamma=4, adaptive=True, threshold=0.3)),
]
SAMPLING_METHODS += [
    ("pard/self", _pard(lambda target: target, gamma=2)),
    ("pard/subset-threshold", _pard(_layer_draft, gamma=3, threshold=0.2)),
]

# ---- methods/quantized.py: the target drafts for itself with 4- / 8-bit weights and int8
# activations, writing into the target's cache (shared) or keeping its own.

GREEDY_METHODS += [
    ("quantized", lambda target: sj.QuantizedDraft(gamma=3)),
    ("quantized/own-8bit", lambda target: sj.QuantizedDraft(bits=8, cache="own", gamma=3)),
]
SAMPLING_METHODS += [
    ("quantized/own-8bit", lambda target: sj.QuantizedDraft(bits=8, cache="own", gamma=2)),
]


# ---- methods/medusa.py (issue 11): Medusa heads over a static tree. Random heads (scale large
# enough that some candidates are accepted) and heads fitted to the target's own greedy text;
# exact multi-draft verification, token matching ("greedy" rule) and typical acceptance (lossy:
# greedy identity only, since at temperature 0 it is greedy verification).

_MEDUSA_TREE = [(0,), (1,), (2,), (3,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)]


def _medusa_random_heads(target):
  from specjax.heads import init_heads
  return init_heads(target, "medusa", num_heads=3, seed=4, scale=3.0)


_FITTED: dict = {}


def _fitted_heads(target, kind: str, fit, lr: float, **kw):
  """Heads of `kind` (init_heads' settings kw) fitted with `fit` (plain Adam, 150 steps, ~2 s)
  to text the target generated itself. Kept per target weights, not per id(target): test_sharding
  builds equal targets afresh per call, and each would otherwise fit its heads again."""
  import hashlib
  h = hashlib.sha1()
  for leaf in jax.tree_util.tree_leaves(target.params):
    h.update(np.asarray(leaf).tobytes())
  key = (target.config, kind, tuple(sorted(kw.items())), h.hexdigest())
  if key not in _FITTED:
    from specjax.heads import init_heads
    ps = random_prompts(32, target.config.vocab_size, seed=11, lo=3, hi=8)
    gen = sj.generate(target, ps, max_new_tokens=32, stop_at_eos=False).tokens
    toks = np.array([(p + g)[:32] for p, g in zip(ps, gen)])
    _FITTED[key], _ = fit(target, init_heads(target, kind, seed=0, **kw), toks, steps=150, lr=lr)
  return _FITTED[key]


def _medusa_fitted_heads(target):
  from specjax.training.medusa import fit
  return _fitted_heads(target, "medusa", fit, 3e-2, num_heads=3)


def _medusa(heads_fn, **kw):
  from specjax.methods.medusa import Medusa
  return lambda target: Medusa(heads_fn(target), **kw)


GREEDY_METHODS += [
    ("medusa/random", _medusa(_medusa_random_heads)),
    ("medusa/fitted-wide", _medusa(_medusa_fitted_heads, tree=_MEDUSA_TREE)),
    ("medusa/typical", _medusa(_medusa_random_heads, tree=_MEDUSA_TREE, acceptance="typical")),
]
SAMPLING_METHODS += [
    ("medusa/exact-random", _medusa(_medusa_random_heads, tree=_MEDUSA_TREE)),
    ("medusa/exact-fitted", _medusa(_medusa_fitted_heads, tree=_MEDUSA_TREE)),
    ("medusa/token-matching", _medusa(_medusa_random_heads, tree=_MEDUSA_TREE,
                                      acceptance="greedy")),
]


# ---- methods/eagle.py, methods/mtp.py (issue 12): EAGLE heads over a static tree (EAGLE-1) and
# a dynamic tree (EAGLE-2), MTP modules drafting a chain. Random heads (scaled so some drafts are
# accepted) and heads fitted to the target's own greedy text.

_EAGLE_TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def _feature_heads(kind, fitted, **kw):
  def make(target):
    from specjax.heads import init_heads
    if not fitted:
      return init_heads(target, kind, seed=4, scale=0.3, **kw)
    from specjax.training import eagle as te, mtp as tm
    return _fitted_heads(target, kind, te.fit if kind == "eagle" else tm.fit, 3e-3, **kw)
  return make


def _eagle(fitted, **kw):
  return lambda target: sj.Eagle(_feature_heads("eagle", fitted)(target), **kw)


def _mtp(fitted, num_heads=2, **kw):
  return lambda target: sj.MTP(_feature_heads("mtp", fitted, num_heads=num_heads)(target), **kw)


def _eagle_taps(**kw):
  """EAGLE with fused features (the target's layer-1 output beside the last, random fuse)."""
  return lambda target: sj.Eagle(_feature_heads("eagle", False, taps=(1,))(target), **kw)


GREEDY_METHODS += [
    ("eagle/static-random", _eagle(False, tree=_EAGLE_TREE)),
    ("eagle/dynamic-taps-random", _eagle_taps(depth=3, top_k=3, num_nodes=8)),
    ("eagle/dynamic-fitted", _eagle(True, depth=4, top_k=3, num_nodes=12)),
    ("mtp/fitted", _mtp(True, num_heads=3)),
]
SAMPLING_METHODS += [
    ("eagle/static-exact", _eagle(False, tree=_EAGLE_TREE)),
    ("eagle/dynamic-exact", _eagle(False, depth=3, top_k=3, num_nodes=8)),
    ("eagle/dynamic-taps-exact", _eagle_taps(depth=3, top_k=3, num_nodes=8)),
    ("mtp/exact", _mtp(False)),
]


# ---- methods/suffix.py, methods/hybrid.py (issue 29): suffix decoding's merged tree of earlier
# continuations; one hybrid tree from prompt lookup, suffix matches and random Medusa heads, cut to
# fewer nodes than its drafters list (so the merge's selection and masked slots are exercised);
# prompt lookup beside EAGLE heads (fitted; random with fused features for the distribution).


def _hybrid(target):
  from specjax.heads import init_heads
  heads = init_heads(target, "medusa", num_heads=3, seed=4, scale=3.0)
  return sj.Hybrid([sj.PromptLookup(ngram=2, num_tokens=3),
                    sj.SuffixDecoding(num_nodes=4, max_depth=3, occurrences=2, max_match=3),
                    sj.Medusa(heads, tree=_MEDUSA_TREE)], num_nodes=10)


def _hybrid_eagle(fitted, taps=False):
  """Prompt lookup beside EAGLE-2 heads in one tree; the copied chain (4) runs deeper than the
  heads' tree (2), so a round can commit more tokens than EAGLE alone would."""
  def make(target):
    heads = (_feature_heads("eagle", False, taps=(1,)) if taps else
             _feature_heads("eagle", fitted))(target)
    return sj.Hybrid([sj.PromptLookup(ngram=2, num_tokens=4),
                      sj.Eagle(heads, depth=2, top_k=3, num_nodes=6)], num_nodes=8)
  return make


GREEDY_METHODS += [
    ("suffix", lambda target: sj.SuffixDecoding(num_nodes=6, max_depth=4, occurrences=3,
                                                max_match=4)),
    ("hybrid", _hybrid),
    ("hybrid/eagle-fitted", _hybrid_eagle(True)),
]
SAMPLING_METHODS += [
    ("suffix", lambda target: sj.SuffixDecoding(num_nodes=6, max_depth=3, occurrences=3,
                                                max_match=3)),
    ("hybrid", _hybrid),
    ("hybrid/eagle-taps", _hybrid_eagle(False, taps=True)),
]


# ---- methods/dflash.py (issue 49): a DFlash drafter drafts a whole block in one forward (random,
# scaled so that some drafts are accepted); the chain is verified with the drafter's own q, the
# tree with the multi-draft rule for fixed candidates.


def _dflash(block_size=None, tree=None, subset=False):
  """subset: the drafter proposes over every other token id only (FR-Spec style: q is zero
  outside them, and the target's p verifies)."""
  def make(target):
    v = target.config.vocab_size
    heads = sj.init_heads(target, "dflash", mask_token_id=v - 1, block_size=4, seed=4, scale=0.3)
    return sj.DFlash(heads, block_size=block_size, tree=tree,
                     vocab=np.arange(0, v, 2) if subset else None)
  return make


# The tree variant: offset d's ranked tokens as candidates (two at depth 1, a second branch under
# the runner-up), verified in one forward.
DFLASH_TREE = [(0,), (1,), (0, 0), (1, 0), (0, 1), (0, 0, 0)]
GREEDY_METHODS += [("dflash/random", _dflash()), ("dflash/tree", _dflash(tree=DFLASH_TREE)),
                   ("dflash/subset", _dflash(subset=True)),
                   ("dflash/tree-subset", _dflash(tree=DFLASH_TREE, subset=True))]
SAMPLING_METHODS += [("dflash/exact", _dflash(block_size=3)),
                     ("dflash/tree-exact", _dflash(tree=DFLASH_TREE[:4])),
                     ("dflash/subset-exact", _dflash(block_size=3, subset=True))]


# ----------------------------------------------------------------------------- sampling

SMALL_VOCAB = 13
N_SAMPLES = 12000
SAMPLING_SETTINGS = [
    dict(temperature=1.0, top_k=0, top_p=1.0),
    dict(temperature=0.7, top_k=0, top_p=1.0),
    dict(temperature=1.0, top_k=5, top_p=1.0),
    dict(temperature=0.7, top_k=0, top_p=0.8),
]


def small_target():
  return tiny_model(seed=3, scale=0.15, vocab_size=SMALL_VOCAB)


def exact_two_token_dist(model, prompt, settings) -> np.ndarray:
  """[V,V] joint probability of the first two generated tokens, from the target alone."""
  v = model.config.vocab_size
  sp = sampling.SamplingParams.make(1 + v, **settings)
  seqs = [prompt] + [prompt + [t] for t in range(v)]
  t = len(prompt) + 1
  toks = np.zeros((1 + v, t), np.int32)
  for i, s in enumerate(seqs):
    toks[i, :len(s)] = s
  lengths = np.array([len(s) for s in seqs])
  cache = model.init_cache(1 + v, t)
  mask = kv.causal_mask(cache.lengths, t, t)
  logits, _, _ = model.apply(model.params, toks, np.broadcast_to(np.arange(t), toks.shape), cache,
                             mask, logits_at=(lengths - 1)[:, None])
  p = np.asarray(sampling.probs(logits[:, 0], sp), np.float64)
  return p[0][:, None] * p[1:]


def tv_check(model, method, settings, seed=0):
  prompt = [3, 1, 4, 1, 5]
  exact = exact_two_token_dist(model, prompt, settings)
  out = sj.generate(model, [prompt] * N_SAMPLES, method, max_new_tokens=2, seed=seed,
                    stop_at_eos=False, **settings)
  counts = np.zeros_like(exact)
  for t in out.tokens:
    counts[t[0], t[1]] += 1
  emp = counts / counts.sum()
  tv = 0.5 * np.abs(emp - exact).sum()
  expected = 0.5 * np.sum(np.sqrt(2 * exact * (1 - exact) / (np.pi * N_SAMPLES)))
  return tv, expected
