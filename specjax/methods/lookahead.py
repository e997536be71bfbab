"""Lookahead decoding (Fu et al., "Break the Sequential Dependency of LLM Inference Using Lookahead
Decoding", ICML 2024): Jacobi guesses make n-grams, n-grams become drafts, one forward per step.

Two branches share one target forward over T = 1 + W*(N-1) + G*(N-1) tokens:

  lookahead  a window [B, N-1, W] of Jacobi guesses: level l, column w sits at position
             p + 1 + w + l (p = position of the pending last token) and attends the pending token,
             level 0 up to its column, then its own column up to its level, a causal sequence.
             The target's argmax at the top level gives one new token per column; column w with
             it is an n-gram (level 0 .. N-2, new), inserted into the pool under its first token.
             The window then drops level 0 and appends the new tokens as its top level.
  verify     up to G candidate (N-1)-token continuations from the pool entry of the pending
             token, each a causal chain at positions p + 1 .. p + N - 1.

The pool is fixed-size arrays per row: tokens [B, V, G, N-1] and insertion counts [B, V]; a key
holds its G most recent distinct n-grams (a ring buffer, the oldest evicted; an n-gram already
there is not inserted twice). Only the pending token and the accepted candidate's tokens are kept
in the cache (`kv.commit`); the lookahead entries are scratch.

Acceptance (`acceptance.verify_candidates`): greedy takes the candidate with the longest prefix
equal to the target's argmax, so greedy output is token-identical to autoregressive decoding.
Sampling picks one candidate from the target's probabilities alone (the most tokens expected to be
accepted) and runs exact rejection with a one-hot draft on it: the choice does not look at the
acceptance randomness, so the output is distributed exactly as the target's (lossless).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import acceptance, sampling
from specjax import cache as kv
from specjax.decode import DRAFT, DecodeState, Method, Program, emit, emitted, phase
from specjax.errors import InputError, check_int
from specjax.methods import sizing


@functools.lru_cache(maxsize=None)
def layout(window: int, ngram: int, guess: int):
  """The static block of one step: (tree [T,T] bool, offsets [T] int32, verify_idx [G,N] int32).

  Node 0 is the pending token; lookahead node (l, w) is 1 + l*W + w; verify node (g, j) is
  1 + W*(N-1) + g*(N-1) + j. tree[i, j]: node i attends node j. offsets: position minus p.
  verify_idx[g]: nodes [0, (g, 0), .., (g, N-2)], whose logits score candidate g.
  """
  w_, m, g_ = window, ngram - 1, guess
  t = 1 + w_ * m + g_ * m
  tree = np.zeros((t, t), bool)
  offsets = np.zeros((t,), np.int32)
  tree[:, 0] = True
  look = lambda l, w: 1 + l * w_ + w
  for l in range(m):
    for w in range(w_):
      i = look(l, w)
      offsets[i] = 1 + w + l
      tree[i, [look(0, c) for c in range(w + 1)]] = True
      tree[i, [look(k, w) for k in range(1, l + 1)]] = True
  base = 1 + w_ * m
  verify_idx = np.zeros((g_, m + 1), np.int32)
  for g in range(g_):
    for j in range(m):
      i = base + g * m + j
      offsets[i] = 1 + j
      tree[i, base + g * m: i + 1] = True
      verify_idx[g, j + 1] = i
  return tree, offsets, verify_idx


# ----------------------------------------------------------------------------- the n-gram pool


@flax.struct.dataclass
class Pool:
  tokens: jax.Array  # [B,V,G,M] int32: per key (first token) up to G continuations of M tokens
  count: jax.Array  # [B,V] int32: n-grams ever inserted under the key (slot = count % G)


def pool_init(batch: int, vocab: int, guess: int, cont: int) -> Pool:
  return Pool(tokens=jnp.zeros((batch, vocab, guess, cont), jnp.int32),
              count=jnp.zeros((batch, vocab), jnp.int32))


def pool_lookup(pool: Pool, key: jax.Array):
  """key [B] -> (candidates [B,G,M] int32 with -1 rows where empty, valid [B,G] bool)."""
  b = key.shape[0]
  g = pool.tokens.shape[2]
  cands = pool.tokens[jnp.arange(b), key]  # [B,G,M]
  valid = jnp.arange(g)[None, :] < jnp.minimum(pool.count[jnp.arange(b), key], g)[:, None]
  return jnp.where(valid[:, :, None], cands, -1), valid


def pool_insert(pool: Pool, key: jax.Array, cont: jax.Array, ok: jax.Array | None = None) -> Pool:
  """Inserts one n-gram per row: key [B] first token, cont [B,M] the rest; ok [B] (default all).

  An n-gram already under its key is skipped; otherwise it overwrites the oldest slot once the
  key holds G.
  """
  b = key.shape[0]
  g = pool.tokens.shape[2]
  rows = jnp.arange(b)
  cands, valid = pool_lookup(pool, key)
  dup = jnp.any(valid & jnp.all(cands == cont[:, None, :], axis=-1), axis=1)  # [B]
  add = ~dup if ok is None else ~dup & ok
  cnt = pool.count[rows, key]
  slot = jnp.where(add, cnt % g, g)  # g: out of range, dropped
  tokens = pool.tokens.at[rows, key, slot].set(cont, mode="drop")
  return Pool(tokens=tokens, count=pool.count.at[rows, key].add(add.astype(jnp.int32)))


# ----------------------------------------------------------------------------- the method


@flax.struct.dataclass
class LookaheadState:
  window: jax.Array  # [B,M,W] int32 Jacobi guesses, level 0 first
  pool: Pool
  hits: jax.Array  # [B] int32 active steps whose pending token had >= 1 candidate
  accepted: jax.Array  # [B] int32 candidate tokens accepted
  useful: jax.Array  # [B] int32 active steps that accepted >= 1 candidate token


@dataclasses.dataclass(frozen=True)
class Lookahead(Method):
  """Lookahead decoding. window W: Jacobi columns; ngram N: n-gram size (the window has N-1
  levels, candidates N-1 tokens); guess G: candidates verified per step (= pool slots per key).
  One step's forward runs 1 + (W + G) * (N - 1) tokens. All three left out (None): the largest
  shape that verifies nearly free on the target's cost curve (methods/sizing.py), else (4, 3, 4)."""
  window: int | None = None
  ngram: int | None = None
  guess: int | None = None
  name: str = dataclasses.field(default="lookahead", init=False)
  lossless: bool = dataclasses.field(default=True, init=False)
  left_out: tuple = dataclasses.field(default=(), init=False, compare=False, repr=False)

  def __post_init__(self):
    sizing.left_out(self, {"window": 4, "ngram": 3, "guess": 4})
    check_int("window", self.window, 1)
    check_int("ngram", self.ngram, 1)
    if self.ngram < 2:
      raise InputError(f"ngram={self.ngram!r} is invalid: must be an integer >= 2 (an n-gram of "
                       f"one token proposes nothing)")
    check_int("guess", self.guess, 1)

  def prepare(self, model) -> "Lookahead":
    return sizing.prepare(self, "lookahead", model, None)

  @property
  def tokens_per_step(self) -> int:
    return 1 + (self.window + self.guess) * (self.ngram - 1)

  @property
  def extra_slots(self) -> int:
    return self.tokens_per_step

  @property
  def max_emit(self) -> int:
    return self.ngram

  def init(self, prog, arrays, state, hidden):
    b = state.seq.shape[0]
    m, w = self.ngram - 1, self.window
    # Initial guesses: tokens drawn from each row's prompt (any tokens would do; the prompt's are
    # likelier to recur). A fixed key: the guesses must not consume the sampling stream.
    u = jax.random.uniform(jax.random.PRNGKey(0), (b, m, w))
    pos = jnp.floor(u * state.prompt_len[:, None, None]).astype(jnp.int32)
    window = jnp.take_along_axis(state.seq, pos.reshape(b, m * w), axis=1).reshape(b, m, w)
    z = jnp.zeros((b,), jnp.int32)
    return LookaheadState(window=window,
                          pool=pool_init(b, prog.config.vocab_size, self.guess, m),
                          hits=z, accepted=z, useful=z)

  def step(self, prog: Program, params, arrays, state: DecodeState) -> DecodeState:
    b = state.seq.shape[0]
    w_, m, g_ = self.window, self.ngram - 1, self.guess
    tree, offsets, verify_idx = layout(w_, self.ngram, g_)
    ms: LookaheadState = state.method
    cache = state.cache
    last = state.last_token  # [B]
    with phase(DRAFT):
      cands, valid = pool_lookup(ms.pool, last)  # [B,G,M] [B,G]

    tokens = jnp.concatenate([last[:, None], ms.window.reshape(b, m * w_),
                              jnp.maximum(cands, 0).reshape(b, g_ * m)], axis=1)  # [B,T]
    pos = cache.lengths[:, None] + jnp.asarray(offsets)[None, :]
    mask = kv.tree_mask(cache.lengths, jnp.asarray(tree), prog.max_len, prog.config.sliding_window)
    logits, _, cache = prog.forward(params, tokens, pos, cache, mask)  # [B,T,V]

    # Lookahead branch: the top level's argmax completes one n-gram per column.
    top = 1 + (m - 1) * w_
    new = sampling.argmax(logits[:, top:top + w_])  # [B,W]
    grams = jnp.concatenate([ms.window, new[:, None, :]], axis=1)  # [B,N,W]
    pool = ms.pool
    for w in range(w_):
      pool = pool_insert(pool, grams[:, 0, w], grams[:, 1:, w])
    window = jnp.concatenate([ms.window[:, 1:], new[:, None, :]], axis=1)

    # Verification branch.
    key, sub = jax.random.split(state.key)
    cand_logits = logits[:, jnp.asarray(verify_idx)]  # [B,G,M+1,V]
    best, n, nxt = acceptance.verify_candidates(sub, cands, cand_logits, state.sp)
    active = ~state.done
    keep = jnp.concatenate([jnp.zeros((b, 1), jnp.int32),
                            jnp.asarray(verify_idx)[best][:, 1:]], axis=1)  # [B,M+1] offsets
    cache = kv.commit(cache, keep, jnp.where(active, n + 1, 0))
    chosen = jnp.take_along_axis(cands, best[:, None, None], axis=1)[:, 0]  # [B,M]
    out = emitted(jnp.maximum(chosen, 0), n, nxt)  # [B,M+1]

    a = active.astype(jnp.int32)
    ms = LookaheadState(window=window, pool=pool, hits=ms.hits + a * jnp.any(valid, axis=1),
                        accepted=ms.accepted + a * n, useful=ms.useful + a * (n > 0))
    state = state.replace(cache=cache, key=key, method=ms)
    return emit(state, out, n + 1)

  def stats(self, state) -> dict:
    ms = state.method
    steps = int((state.calls - 1).sum())
    hits, accepted = int(ms.hits.sum()), int(ms.accepted.sum())
    return {
        "pool_hit_rate": hits / steps if steps else 0.0,  # steps with >= 1 candidate
        "pool_useful_rate": int(ms.useful.sum()) / steps if steps else 0.0,  # >= 1 accepted
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / (hits * (self.ngram - 1)) if hits else 0.0,
        "tokens_per_forward": self.tokens_per_step,
    }
