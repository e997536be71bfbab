"""Suffix decoding: draft a tree of what followed earlier occurrences of the context's suffix.

SuffixDecoding (Oliaro et al. 2024) looks the last tokens of the context up in a suffix tree over
the prompt, the output so far and earlier outputs, and proposes the continuations seen most often
after the longest match as a tree. Here the same search runs in fixed shapes on device, one step,
all rows at once:

  propose  for every position e of the row's tokens (prompt and output so far) and of the store
           (earlier outputs, `SuffixStore`), m[b, e] counts how many of the last max_match tokens
           equal the tokens ending at e (one vectorised comparison per pattern length, as prompt
           lookup's search). The `occurrences` best positions (longest match, then the current
           row before the store, then the most recent) each propose the max_depth tokens that
           followed them. Equal continuations share their prefix: `merge.merge` folds them into
           one tree whose node scores add up (score m / max_match per occurrence, times
           DECAY^depth), so a continuation seen after several long matches ranks first, and keeps
           the best num_nodes nodes;
  verify   the shared tree step (`verify.tree`): one target forward over [pending token, N
           nodes] under the tree mask (nothing drafted in any row: a one-token forward instead);
           greedy: the longest path matching the target's argmax; sampling: the exact
           multi-draft rule (every candidate is a deterministic function of the context); the
           accepted path is committed and emitted with the target's token.

The store is a fixed-size token table (capacity tokens, -1 between outputs and in empty slots),
held on the host and passed to every generate call as it is then: the in-loop search stays
fixed-size. With remember=True each call's outputs are added to it after the call (oldest outputs
evicted first), so later requests in the same session can copy from earlier answers.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decode import DRAFT, DecodeState, Method, Program, phase
from specjax.errors import InputError, check_int
from specjax.methods import merge, verify

DECAY = 0.9  # a copied node's score shrinks with depth: a long chain's tail yields to alternatives
RULES = ("exact", "greedy")


class SuffixStore:
  """A bounded, per-session store of earlier outputs: one int32 table [capacity] (outputs one
  after another, -1 after each and in the empty slots). `add` appends outputs and evicts the
  oldest until the newest fit; an output longer than the table keeps its last tokens. The table
  is updated in place, so a method holding the store reads the current one on every call."""

  def __init__(self, capacity: int = 4096):
    check_int("capacity", capacity, 2)
    self.capacity = int(capacity)
    self.table = np.full((self.capacity,), -1, np.int32)
    self._outputs: collections.deque = collections.deque()

  def add(self, outputs) -> None:
    """outputs: token-id lists (e.g. GenerateOutput.tokens); empty ones are skipped."""
    for out in outputs:
      out = [int(t) for t in out][-(self.capacity - 1):]
      if out:
        self._outputs.append(out)
    while sum(len(o) + 1 for o in self._outputs) > self.capacity:
      self._outputs.popleft()
    flat = [t for o in self._outputs for t in (*o, -1)]
    self.table[:] = -1
    self.table[:len(flat)] = flat

  def __len__(self) -> int:
    """Tokens held (separators not counted)."""
    return sum(len(o) for o in self._outputs)


def suffix_search(seq: jax.Array, seq_len: jax.Array, table: jax.Array | None, max_match: int,
                  occurrences: int, max_depth: int):
  """The best earlier occurrences of each row's suffix and what followed them.

  seq [B,S] int32 tokens; seq_len [B] valid tokens (the suffix ends at seq_len - 1); table [C]
  int32 the store (-1 separates outputs) or None. Returns (cont [B,K,D] the tokens after each of
  the K = occurrences best matches, ok [B,K,D] which of them exist (prefix-closed), match [B,K]
  each one's matched length, 0 = none)."""
  b, s = seq.shape
  u = seq if table is None else jnp.concatenate(
      [seq, jnp.full((b, 1), -1, seq.dtype), jnp.broadcast_to(table, (b,) + table.shape)], axis=1)
  n = u.shape[1]
  e = jnp.arange(n)[None, :]
  run = jnp.ones((b, n), bool)
  m = jnp.zeros((b, n), jnp.int32)  # matched suffix length ending at e
  for j in range(max_match):
    shifted = jnp.pad(u, ((0, 0), (j, 0)), constant_values=-1)[:, :n]  # u[b, e - j]
    t = seq_len - 1 - j
    tgt = jnp.take_along_axis(seq, jnp.maximum(t, 0)[:, None], axis=1)  # [B,1]
    run = run & (shifted == tgt) & (t >= 0)[:, None]
    m = m + run.astype(jnp.int32)
  in_seq = e < s
  m = jnp.where(in_seq & (e >= (seq_len - 1)[:, None]), 0, m)  # the suffix itself is no match
  rank = jnp.where(m > 0, m * (2 * n) + jnp.where(in_seq, n + e, e), -1)
  top, at = jax.lax.top_k(rank, occurrences)  # [B,K]
  match = jnp.where(top >= 0, jnp.take_along_axis(m, at, axis=1), 0)
  idx = at[:, :, None] + 1 + jnp.arange(max_depth)[None, None, :]  # [B,K,D]
  cont = jnp.take_along_axis(u, jnp.clip(idx, 0, n - 1).reshape(b, -1), axis=1).reshape(idx.shape)
  inside = jnp.where(idx < s, idx < seq_len[:, None, None], idx < n)
  ok = inside & (cont >= 0) & (match > 0)[:, :, None]
  ok = jnp.cumprod(ok.astype(jnp.int32), axis=2).astype(bool)
  return cont, ok, match


def chain_parents(k: int, d: int) -> np.ndarray:
  """Parents of k chains of d nodes laid out chain by chain ([K*D]; the first of each: -1)."""
  j = np.arange(k * d)
  return np.where(j % d == 0, -1, j - 1).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class SuffixDecoding(verify.TreeSizes, Method):
  """Suffix decoding (module docstring). num_nodes: the tree verified per step (N); max_depth:
  tokens copied after each occurrence; max_match: the longest suffix matched; occurrences: how many
  earlier occurrences feed the tree; store: a SuffixStore of earlier outputs (None: the row's own
  tokens only); remember: add each call's outputs to the store; acceptance: "exact" | "greedy"."""
  num_nodes: int = 12
  max_depth: int = 8
  max_match: int = 8
  occurrences: int = 4
  store: Any = dataclasses.field(default=None, compare=False, repr=False)
  remember: bool = True
  acceptance: str = "exact"
  capacity: int = dataclasses.field(default=0, init=False)  # the store's table size (a shape)

  name = "suffix"
  lossless = True

  def __post_init__(self):
    check_int("max_depth", self.max_depth, 1, 64)
    check_int("max_match", self.max_match, 1, 64)
    check_int("occurrences", self.occurrences, 1, 64)
    check_int("num_nodes", self.num_nodes, 1, self.occurrences * self.max_depth,
              f" (occurrences * max_depth = {self.occurrences * self.max_depth} candidates)")
    if self.store is not None and not isinstance(self.store, SuffixStore):
      raise InputError(f"store={self.store!r} is invalid: must be a SuffixStore or None")
    if self.acceptance not in RULES:
      raise InputError(f"acceptance={self.acceptance!r} is invalid: must be one of "
                       f"{', '.join(RULES)}")
    object.__setattr__(self, "capacity", 0 if self.store is None else self.store.capacity)


  def arrays(self, model):
    # The store's own numpy table (not a copy): generate passes its current contents every call.
    return {} if self.store is None else {"store": self.store.table}

  def init(self, prog, arrays, state, hidden):
    z = jnp.zeros_like(state.seq_len)
    return {"rounds": z, "accepted": z, "drafted": z}

  def candidates(self, arrays, state: DecodeState):
    """-> (tokens [B,M], parents [M], valid [B,M], score [B,M]) with M = occurrences * max_depth:
    the continuations of the best occurrences, chain by chain (`merge` candidates)."""
    k, d = self.occurrences, self.max_depth
    cont, ok, match = suffix_search(state.seq, state.seq_len, arrays.get("store"),
                                    self.max_match, k, d)
    b = cont.shape[0]
    score = (match[:, :, None] / self.max_match) * DECAY ** jnp.arange(d)[None, None, :]
    return (cont.reshape(b, k * d), jnp.asarray(chain_parents(k, d)), ok.reshape(b, k * d),
            score.reshape(b, k * d).astype(jnp.float32))

  def step(self, prog: Program, params, arrays, state: DecodeState) -> DecodeState:
    key, sub = jax.random.split(state.key)
    with phase(DRAFT):
      tok, par, valid, score = self.candidates(arrays, state)
      draft, parents, depth, filled, _ = merge.merge(tok, par, valid, score, self.num_nodes,
                                                     self.max_depth)
    drafted = jnp.any(filled, axis=1)
    a = (~state.done).astype(jnp.int32)
    state, _, n, _, _ = verify.tree(prog, params, state, sub, draft, parents, depth,
                                    self.max_depth, rule=self.acceptance, skip_empty=~drafted)
    return state.replace(key=key, method=_count(state.method, a, n, drafted))

  def learn(self, state) -> None:
    """Adds a finished call's outputs to the store (with remember=True; stats calls it, the one
    host-side hook the driver gives a method after a call)."""
    if self.store is not None and self.remember:
      seq, end, start = (np.asarray(x) for x in (state.seq, state.seq_len, state.prompt_len))
      self.store.add([seq[i, start[i]:end[i]] for i in range(len(seq))])

  def stats(self, state) -> dict:
    self.learn(state)
    m = state.method
    rounds = int(np.asarray(m["rounds"]).sum())
    return {"tree_nodes": self.num_nodes, "draft_rounds": rounds,
            "accepted_tokens": int(np.asarray(m["accepted"]).sum()),
            "match_rate": int(np.asarray(m["drafted"]).sum()) / max(1, rounds),
            "store_tokens": 0 if self.store is None else len(self.store)}


def _count(m: dict, active: jax.Array, n: jax.Array, drafted: jax.Array) -> dict:
  return {"rounds": m["rounds"] + active, "accepted": m["accepted"] + active * n,
          "drafted": m["drafted"] + active * drafted}
