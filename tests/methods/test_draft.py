"""draft.py: input errors before compiling, statistics, hashing, seeding, cost model."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import specjax as sj
from specjax import decode, kernels
from specjax.methods.draft import DraftModel, SelfSpeculative, leviathan_speedup, measure_cost_ratio

from tests.helpers.models import random_prompts, tiny_model


@pytest.fixture(scope="module")
def target():
  return tiny_model(seed=0)


def test_bad_input_raises_before_compiling(target):
  before = decode.compile_cache.count
  with pytest.raises(sj.InputError, match="gamma=0"):
    DraftModel(target, gamma=0)
  with pytest.raises(sj.InputError, match="min_gamma"):
    DraftModel(target, gamma=2, min_gamma=3)
  with pytest.raises(sj.InputError, match="threshold"):
    SelfSpeculative(exit_layer=1, threshold=1.5)
  with pytest.raises(sj.InputError, match="draft="):
    DraftModel("not a model")
  with pytest.raises(sj.InputError, match="vocabulary size 50 differs"):
    sj.generate(target, [[1, 2, 3]], DraftModel(tiny_model(vocab_size=50)))
  with pytest.raises(sj.InputError, match="vocab must be"):
    DraftModel(target, vocab=[1, 1, 2])
  with pytest.raises(sj.InputError, match="exit_layer=0"):
    SelfSpeculative(exit_layer=0)
  with pytest.raises(sj.InputError, match="vocab must be"):
    SelfSpeculative(exit_layer=1, vocab=[[1, 2]])
  with pytest.raises(sj.InputError, match=r"vocab must be distinct token ids in \[0, 61\)"):
    sj.generate(target, [[1, 2, 3]], SelfSpeculative(exit_layer=1, vocab=[0, 5, 999]))
  # Tokenizers that disagree: another size, or the same size with other token strings.
  class Tok:
    def __init__(self, words):
      self.words = words

    def __len__(self):
      return len(self.words)

    def convert_ids_to_tokens(self, ids):
      return [self.words[i] for i in ids]

  words = [f"t{i}" for i in range(61)]
  tgt = sj.Model(target.config, target.graphdef, target.params, tokenizer=Tok(words))
  other = tiny_model(seed=1)
  for draft_words, match in ((words[:60], "draft tokenizer \\(60 tokens\\) differs"),
                             (words[:30] + ["x"] + words[31:], "token 30 is 'x' for the draft")):
    draft = sj.Model(other.config, other.graphdef, other.params, tokenizer=Tok(draft_words))
    with pytest.raises(sj.InputError, match=match):
      sj.generate(tgt, [[1, 2, 3]], DraftModel(draft))
  same = sj.Model(other.config, other.graphdef, other.params, tokenizer=Tok(list(words)))
  DraftModel(same).validate(tgt)  # agreeing tokenizers pass
  for k in (2, 5):  # the tiny target has 2 layers: exit_layer must be in [1, 1]
    with pytest.raises(sj.InputError, match=rf"exit_layer={k} is invalid for a 2-layer"):
      sj.generate(target, [[1, 2, 3]], SelfSpeculative(exit_layer=k))
  assert decode.compile_cache.count == before


def test_own_draft_accepts_everything(target):
  """The target as its own draft: alpha = 1 and every step emits gamma + 1 tokens (tau)."""
  gamma = 3
  p = random_prompts(2, target.config.vocab_size, seed=4)
  out = sj.generate(target, p, DraftModel(target, gamma=gamma), max_new_tokens=1 + 5 * (gamma + 1))
  s = out.stats
  assert s["alpha"] == 1.0
  assert s["accepted_per_step"] == gamma
  assert s["accept_hist"][gamma + 1] == 2 * 5  # 5 full steps per row (+ the prefill's one token)


def test_random_draft_stats(target):
  out = sj.generate(target, random_prompts(1, 61, seed=2),
                    DraftModel(tiny_model(seed=9), gamma=4, adaptive=True), max_new_tokens=20)
  s = out.stats
  assert s["alpha"] < 0.3 and s["drafted_per_step"] < 4  # adaptive gamma shrank
  assert {"alpha", "accepted_per_step", "drafted_tokens", "gamma"} <= set(s)


def test_verification_width_follows_drafting(target):
  """When drafting can stop early, the target scores only the drafted positions (+ the pending
  token); a fixed-gamma method always scores gamma + 1. Same tokens either way."""
  p = random_prompts(1, 61, seed=6)  # batch 1: the width is this row's own drafted count + 1
  draft = tiny_model(seed=9, scale=0.3)
  fixed = sj.generate(target, p, DraftModel(draft, gamma=4), max_new_tokens=16)
  short = sj.generate(target, p, DraftModel(draft, gamma=4, threshold=0.99), max_new_tokens=16)
  assert fixed.tokens == short.tokens
  assert fixed.stats["verified_per_step"] == 5
  s = short.stats
  assert s["drafted_per_step"] < 3.5 and s["verified_per_step"] == s["drafted_per_step"] + 1
  grow = sj.generate(target, p, DraftModel(target, gamma=4, min_gamma=1, adaptive=True),
                     max_new_tokens=16)  # alpha = 1: every row drafts (and verifies) the most
  assert grow.stats["verified_per_step"] == grow.stats["drafted_per_step"] + 1 == 5


def test_method_hash_ignores_param_values(target):
  a = DraftModel(tiny_model(seed=1), gamma=3)
  b = DraftModel(tiny_model(seed=2), gamma=3)  # same structure, other weights: same program
  assert a == b and hash(a) == hash(b)
  assert a != DraftModel(tiny_model(seed=1), gamma=4)
  assert a != DraftModel(tiny_model(seed=1, num_layers=1), gamma=3)
  assert SelfSpeculative(exit_layer=1) == SelfSpeculative(exit_layer=1)


def test_seeded_sampling_reproducible(target):
  p = random_prompts(3, 61, seed=5)
  m = SelfSpeculative(exit_layer=1, gamma=3)
  a = sj.generate(target, p, m, max_new_tokens=12, temperature=0.8, seed=3)
  b = sj.generate(target, p, m, max_new_tokens=12, temperature=0.8, seed=3)
  c = sj.generate(target, p, m, max_new_tokens=12, temperature=0.8, seed=4)
  assert a.tokens == b.tokens and a.tokens != c.tokens


def test_leviathan_and_cost_ratio(target):
  assert leviathan_speedup(1.0, 4, 0.0) == 5.0
  assert abs(leviathan_speedup(0.5, 1, 0.0) - 1.5) < 1e-9
  assert abs(leviathan_speedup(0.8, 3, 0.1) - (1 - 0.8 ** 4) / (0.2 * 1.3)) < 1e-9
  assert abs(leviathan_speedup(0.8, 3, 0.1, verify=1.4) - (1 - 0.8 ** 4) / (0.2 * 1.7)) < 1e-9
  r = measure_cost_ratio(target, DraftModel(tiny_model(seed=1, num_layers=1), gamma=2),
                         cache_len=64, reps=2)
  assert r["c"] > 0 and r["verify_over_step"] > 0 and "verify_by_width" not in r
  r = measure_cost_ratio(target, SelfSpeculative(exit_layer=1, gamma=3, adaptive=True),
                         cache_len=64, reps=2)
  assert sorted(r["verify_by_width"]) == [2, 3, 4] and min(r["verify_by_width"].values()) > 0


@pytest.mark.slow
def test_named_draft_loads_on_a_mesh():
  """load_model(name, mesh=) for a shipped draft builds it around a mesh-placed target."""
  d = sj.load_model("smollm2-135m-draft", mesh="model=1", tokenizer=False)
  assert d.config.vocab_size == 49152


def test_named_draft_on_a_target_checks_its_arguments():
  """target= builds a shipped draft around a loaded target; anything that is not a shipped draft,
  not a Model, or not its target is refused with a specific error."""
  from specjax.errors import InputError, WeightsError

  target = tiny_model()
  with pytest.raises(InputError, match="target= is for shipped drafts"):
    sj.load_model("smollm2-135m", target=target)
  with pytest.raises(InputError, match="must be a loaded specjax Model"):
    sj.load_model("smollm2-135m-draft", target="smollm2-135m")
  with pytest.raises(InputError, match="pass mesh= / place= when loading the target"):
    sj.load_model("smollm2-135m-draft", target=target, mesh="model=1")
  with pytest.raises(WeightsError, match="does not fit target"):
    sj.load_model("smollm2-135m-draft", target=target)


@pytest.mark.slow
def test_named_draft_shares_the_loaded_target(smollm2):
  """load_model(draft, target=) borrows the loaded target's embeddings (the same array, no second
  copy), is packed for the kernel where its target is (its layers; not the whole LM head, since it
  scores a vocabulary subset), and drafts exactly like the draft loaded on its own on XLA; the
  packed copies are not among the tensors an export writes."""
  from specjax import packing, shipped

  d = sj.load_model("smollm2-135m-draft", target=smollm2)
  assert d.params["embed"][...] is smollm2.params["embed"][...]
  assert packing.on_kernel(d) == packing.on_kernel(smollm2) == kernels.available()
  packed = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(d.params)
            if packing.is_packed_path(p)]
  assert d.vocab_subset is not None and "packed_head" not in " ".join(packed)
  assert len(packed) == (4 * d.config.num_layers if kernels.available() else 0), packed
  alone = sj.load_model("smollm2-135m-draft", tokenizer=False, kernels=False)
  assert not packing.is_packed(alone)
  own, own_alone = shipped.own_params(d), shipped.own_params(alone)
  assert sorted(own) == sorted(own_alone)
  assert all(np.array_equal(np.asarray(own[k]), np.asarray(own_alone[k])) for k in own)
  prompts = ["def fibonacci(n):"]
  a = sj.generate(smollm2, prompts, sj.DraftModel(d, gamma=3), max_new_tokens=24)
  b = sj.generate(smollm2, prompts, sj.DraftModel(alone, gamma=3), max_new_tokens=24)
  assert a.tokens == b.tokens and a.stats["accepted_tokens"] == b.stats["accepted_tokens"]
