"""Prompt lookup decoding: the vectorised n-gram search, argument errors, acceptance paths."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.methods.prompt_lookup import PromptLookup, ngram_search

from tests.helpers.models import memoryless_model, random_prompts, tiny_model


def search(rows, ngram=3, k=3, width=16):
  seq = np.full((len(rows), width), 7, np.int32)  # garbage past seq_len must never match
  for i, r in enumerate(rows):
    seq[i, :len(r)] = r
  draft, n, match = ngram_search(jnp.asarray(seq), jnp.asarray([len(r) for r in rows]), ngram, k)
  return np.asarray(draft).tolist(), np.asarray(n).tolist(), np.asarray(match).tolist()


def test_search_most_recent_occurrence():
  # suffix [2, 3] occurs ending at 2 and at 6: the later one wins; [7, 2, 3] occurs nowhere.
  draft, n, match = search([[1, 2, 3, 4, 9, 2, 3, 5, 8, 2, 3]])
  assert (draft, n, match) == ([[5, 8, 2]], [3], [2])


def test_search_prefers_longer_match():
  # [1, 2, 3] (3 tokens, early) beats [2, 3] (2 tokens, later).
  draft, n, match = search([[1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]])
  assert (draft, n, match) == ([[4, 9, 2]], [3], [3])


def test_search_falls_back_to_one_token():
  draft, n, match = search([[5, 6, 1, 2, 5]], ngram=3, k=4)
  assert (draft, n, match) == ([[6, 1, 2, 5]], [4], [1])


def test_search_truncates_at_end_and_overlaps():
  # [4, 4] ends at slot 1; only one token (slot 2) follows it.
  draft, n, match = search([[4, 4, 4]], ngram=3, k=3)
  assert (draft, n, match) == ([[4, -1, -1]], [1], [2])


def test_search_no_match_and_batch_rows_independent():
  draft, n, match = search([[1, 2, 3, 4], [3, 1, 2, 3]], ngram=2, k=2)
  assert draft == [[-1, -1], [1, 2]] and n == [0, 2] and match == [0, 1]


def test_search_never_matches_past_seq_len():
  # the buffer past seq_len is filled with 7s: the suffix [7] must not match there.
  draft, n, _ = search([[1, 7]], ngram=1, k=2)
  assert draft == [[-1, -1]] and n == [0]


@pytest.mark.parametrize("kw,arg", [(dict(ngram=0), "ngram"), (dict(num_tokens=0), "num_tokens"),
                                    (dict(ngram=-2), "ngram"), (dict(num_tokens=2.5), "num_tokens"),
                                    (dict(ngram=True), "ngram")])
def test_bad_arguments(kw, arg):
  with pytest.raises(sj.InputError, match=arg):
    sj.PromptLookup(**kw)


def test_bad_adaptive():
  with pytest.raises(sj.InputError, match="adaptive must be True or False"):
    sj.PromptLookup(adaptive=1)


def test_adaptive_copies_long_where_copies_pay_and_short_where_not():
  """adaptive=True: where every copy is right (text repeating itself) the rows' copy length
  grows from one token and tau is the fixed-length copy's; where most copies are wrong (a random
  model) it stays short, so far fewer copied tokens are verified. Tokens as autoregressive's
  both ways, batch 1 and 2; the adaptive copy is never re-sized by the cost curve."""
  model = memoryless_model()
  y = sj.generate(model, [[3]], max_new_tokens=40).tokens[0]
  prompts = [y + [y[0]], [5, 9] + y + [y[0]]]
  ref = sj.generate(model, prompts, sj.Autoregressive(), max_new_tokens=32)
  fixed = sj.generate(model, prompts, sj.PromptLookup(ngram=2, num_tokens=6), max_new_tokens=32)
  method = sj.PromptLookup(ngram=2, num_tokens=6, adaptive=True)
  assert method.prepare(model) is method
  out = sj.generate(model, prompts, method, max_new_tokens=32)
  assert out.tokens == ref.tokens == fixed.tokens
  assert out.stats["acceptance_rate"] == 1.0
  assert sum(out.stats["accept_hist"][3:]) > 0  # copies grew from 1 to 2 tokens and more
  assert out.stats["mean_accepted"] >= 0.85 * fixed.stats["mean_accepted"]
  assert sj.generate(model, prompts[:1], method, max_new_tokens=32).tokens == ref.tokens[:1]

  model = tiny_model()
  prompts = random_prompts(4, model.config.vocab_size, seed=2, lo=3, hi=16)
  ref = sj.generate(model, prompts, sj.Autoregressive(), max_new_tokens=24)
  fixed = sj.generate(model, prompts, sj.PromptLookup(ngram=2, num_tokens=6), max_new_tokens=24)
  out = sj.generate(model, prompts, method, max_new_tokens=24)
  assert out.tokens == ref.tokens == fixed.tokens
  assert out.stats["draft_tokens"] < 0.5 * fixed.stats["draft_tokens"]


def test_copies_repeating_text():
  """The prompt is the model's own output plus its first token again: every draft is right."""
  model = memoryless_model()
  y = sj.generate(model, [[3]], max_new_tokens=40).tokens[0]
  prompts = [y + [y[0]], [5, 9] + y + [y[0]]]
  ref = sj.generate(model, prompts, sj.Autoregressive(), max_new_tokens=24)
  out = sj.generate(model, prompts, sj.PromptLookup(ngram=2, num_tokens=4), max_new_tokens=24)
  assert out.tokens == ref.tokens
  assert out.stats["acceptance_rate"] == 1.0 and out.stats["mean_accepted"] > 2.5
  assert out.stats["accept_hist"][5] > 0  # all 4 drafts and the bonus token


@dataclasses.dataclass(frozen=True)
class AlwaysWrong(PromptLookup):
  """Proposes num_tokens copies of a token the target never emits: every draft is rejected."""
  bad: int = 0

  def propose(self, state):
    b = state.seq.shape[0]
    draft = jnp.full((b, self.num_tokens), self.bad, jnp.int32)
    n = jnp.full((b,), self.num_tokens, jnp.int32)
    return draft, n, n


def test_always_wrong_drafts():
  model = tiny_model()
  prompts = random_prompts(4, model.config.vocab_size, seed=1)
  ref = sj.generate(model, prompts, sj.Autoregressive(), max_new_tokens=16)
  unused = sorted(set(range(model.config.vocab_size)) - {t for r in ref.tokens for t in r})
  out = sj.generate(model, prompts, AlwaysWrong(num_tokens=3, bad=unused[0]), max_new_tokens=16)
  assert out.tokens == ref.tokens
  assert out.stats["accepted_tokens"] == 0 and out.stats["mean_accepted"] == 1.0
