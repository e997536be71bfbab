"""Prompt lookup decoding: draft by copying what followed an earlier occurrence of the suffix.

As transformers' `prompt_lookup_num_tokens` and vLLM's n-gram proposer. Each step:

  propose  find the most recent earlier occurrence of the last `ngram` tokens of the prompt plus
           generated text (falling back to shorter suffixes, down to one token) and take up to
           `num_tokens` tokens that followed it;
  verify   the shared chain step (`verify.chain`): one target forward over [last token,
           draft_1 .. draft_k]; greedy: the longest prefix matching the target's argmax;
           sampling: exact rejection with a one-hot draft distribution; keep the last token and
           the n accepted drafts in the cache, emit n + 1 tokens.

The search is one vectorised comparison over the whole token buffer `seq` [B,S] (no host loop):
for every slot e, m[b, e] counts how many tokens ending at e equal the tokens ending at the
pending position; the best match maximises (min(m, ngram), e). Rows with no earlier occurrence of
even their last token propose nothing; when no row proposes anything the step runs a one-token
forward instead of k + 1 tokens (the chain step's `skip_empty`).

adaptive=True: each row copies at most g[b] tokens, g following what the row's copies earn: it
starts at 1, doubles (up to num_tokens) after a round that accepted the whole copy and drops to
the accepted count + 1 after a rejection. The round verifies only as wide as its longest copy
(the chain step's traced width, 0 when nobody copied). Text that copies its context (code edits,
summaries) then verifies long copies, and text that does not stays at one cheap token, where a
fixed num_tokens must choose one size for both.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from specjax.decode import DRAFT, DecodeState, Method, Program, phase
from specjax.errors import InputError, check_int
from specjax.methods import sizing, verify


def ngram_search(seq: jax.Array, seq_len: jax.Array, ngram: int, num_tokens: int):
  """Finds the continuation of the most recent earlier occurrence of each row's suffix.

  seq [B,S] int32 tokens; seq_len [B] valid tokens (the suffix ends at seq_len - 1).
  Longer matches (up to `ngram` tokens) win; among equally long ones the most recent.
  Returns (draft [B,num_tokens] int32, -1 past the proposal; n_draft [B] int32 proposed tokens;
  match [B] int32 length of the matched suffix, 0 = no occurrence).
  """
  b, s = seq.shape
  e = jnp.arange(s)
  run = jnp.ones((b, s), bool)
  m = jnp.zeros((b, s), jnp.int32)  # matched suffix length ending at slot e (capped at ngram)
  for j in range(ngram):
    shifted = jnp.pad(seq, ((0, 0), (j, 0)), constant_values=-1)[:, :s]  # [B,S]: seq[b, e - j]
    tgt_pos = seq_len - 1 - j  # [B]
    tgt = jnp.take_along_axis(seq, jnp.maximum(tgt_pos, 0)[:, None], axis=1)  # [B,1]
    run = run & (shifted == tgt) & (tgt_pos >= 0)[:, None]
    m = m + run.astype(jnp.int32)
  earlier = e[None, :] < (seq_len - 1)[:, None]  # the suffix itself is no match
  m = jnp.where(earlier, m, 0)
  best = jnp.argmax(jnp.where(m > 0, m * s + e[None, :], -1), axis=1).astype(jnp.int32)  # [B]
  match = jnp.take_along_axis(m, best[:, None], axis=1)[:, 0]
  n_draft = jnp.where(match > 0, jnp.minimum(num_tokens, seq_len - 1 - best), 0).astype(jnp.int32)
  j = jnp.arange(num_tokens)[None, :]
  idx = jnp.clip(best[:, None] + 1 + j, 0, s - 1)
  draft = jnp.where(j < n_draft[:, None], jnp.take_along_axis(seq, idx, axis=1), -1)
  return draft.astype(jnp.int32), n_draft, match


@flax.struct.dataclass
class LookupState:
  proposed: jax.Array  # [B] int32 draft tokens verified
  accepted: jax.Array  # [B] int32 draft tokens accepted
  matched_steps: jax.Array  # [B] int32 active steps that found an earlier occurrence
  g: jax.Array  # [B] int32 the most tokens the row copies next (num_tokens unless adaptive)


@dataclasses.dataclass(frozen=True)
class PromptLookup(verify.ChainSizes, Method):
  """Prompt lookup decoding. ngram: longest suffix to match (falls back to 1);
  num_tokens: most tokens copied per step (the verify forward runs num_tokens + 1 tokens; None:
  as many as verify nearly free on the target's cost curve, methods/sizing.py; else 10);
  adaptive: each row's copy length follows its acceptance, up to num_tokens (None: 10; the
  module docstring)."""
  ngram: int = 3
  num_tokens: int | None = None
  adaptive: bool = False
  name: str = dataclasses.field(default="prompt-lookup", init=False)
  lossless: bool = dataclasses.field(default=True, init=False)
  left_out: tuple = dataclasses.field(default=(), init=False, compare=False, repr=False)

  def __post_init__(self):
    sizing.left_out(self, {"num_tokens": 10})
    check_int("ngram", self.ngram, 1)
    check_int("num_tokens", self.num_tokens, 1)
    if not isinstance(self.adaptive, bool):
      raise InputError(f"adaptive must be True or False, got {self.adaptive!r}")

  def prepare(self, model) -> "PromptLookup":
    if self.adaptive:  # num_tokens is only the cap: the rows' g choose each round's width
      return self
    return sizing.prepare(self, "prompt-lookup", model, self.ngram)

  @property
  def chain_len(self) -> int:
    return self.num_tokens

  def init(self, prog, arrays, state, hidden):
    z = jnp.zeros_like(state.seq_len)
    return LookupState(proposed=z, accepted=z, matched_steps=z,
                       g=z + (1 if self.adaptive else self.num_tokens))

  def propose(self, state: DecodeState):
    """-> (draft [B,num_tokens] (-1 = none), n_draft [B], match [B]); see `ngram_search`."""
    return ngram_search(state.seq, state.seq_len, self.ngram, self.num_tokens)

  def step(self, prog: Program, params, arrays, state: DecodeState) -> DecodeState:
    key, sub = jax.random.split(state.key)
    with phase(DRAFT):
      draft, n_draft, match = self.propose(state)  # [B,k] [B] [B]
    active = ~state.done
    a = active.astype(jnp.int32)
    if self.adaptive:
      n_draft = jnp.minimum(n_draft, state.method.g)
      draft = jnp.where(jnp.arange(self.num_tokens)[None, :] < n_draft[:, None], draft, -1)
      width = jnp.max(jnp.where(active, n_draft, 0))
      state, n, _ = verify.chain(prog, params, state.replace(key=key), sub, draft, width=width,
                                 min_width=0)
    else:
      state, n, _ = verify.chain(prog, params, state.replace(key=key), sub, draft,
                                 skip_empty=n_draft == 0)
    ms = state.method
    g = ms.g
    if self.adaptive:  # doubles after a whole copy accepted, else the accepted count + 1
      grown = jnp.where(n >= n_draft, jnp.minimum(2 * g, self.num_tokens), n + 1)
      g = jnp.where(active & (n_draft > 0), grown, g)
    return state.replace(method=LookupState(proposed=ms.proposed + a * n_draft,
                                            accepted=ms.accepted + a * n,
                                            matched_steps=ms.matched_steps + a * (match > 0),
                                            g=g))

  def stats(self, state) -> dict:
    ms = state.method
    proposed, accepted = int(ms.proposed.sum()), int(ms.accepted.sum())
    steps = int((state.calls - 1).sum())  # loop steps while active (calls include the prefill)
    return {
        "draft_tokens": proposed,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "match_rate": int(ms.matched_steps.sum()) / steps if steps else 0.0,
    }
