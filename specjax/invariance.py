"""Batch invariance, checked: row r of a T-token forward against the one-token forward at the
same position over the same cache contents.

Speculative decoding verifies T drafted tokens in one forward and keeps those the target would
have produced one at a time. Its output is the autoregressive output only if each row of that
forward has the bits a one-token forward has there; a last-bit difference decides a near-tie
the other way. So the property is tested directly, not through greedy runs on some prompts:

    probe = BatchInvariance(model, cache_len=256)
    report = probe.check(parents=[-1, 0, 1, 1], context=40, batch=4)
    report.identical   # [B, N] bool: row b, block token n equals its one-token forward
    report.max_abs     # the largest difference in the logits

The block is N tokens whose `parents` (topologically ordered; -1 for the first) make a chain
(`parents=range(-1, T - 1)`, or `chain(T)`) or a tree, as tree verification feeds one. Token n
sits at position context + depth(n) and sees the cache and its own ancestors. Its reference runs
its root-to-n path one token a call, batch 1, from the same cache. Every batch row gets its own
random context and tokens; the block's cache is the batch-1 prefills stacked, so the two sides
read the same cache contents. context=0 starts from an empty cache (`empty=True` also runs the
block as a prefill, the model's empty_cache form).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax import cache as kv
from specjax import compile_options


def chain(t: int) -> tuple[int, ...]:
  """The parents of a chain of t tokens."""
  return tuple(range(-1, t - 1))


def _depths(parents) -> np.ndarray:
  depth = np.zeros(len(parents), np.int32)
  for n, p in enumerate(parents):
    if p >= n or (n > 0) != (p >= 0):
      raise ValueError(f"parents={tuple(parents)}: token 0 has parent -1 and every other token "
                       f"a parent before it")
    depth[n] = 0 if p < 0 else depth[p] + 1
  return depth


def _ancestors(parents) -> np.ndarray:
  n = len(parents)
  anc = np.eye(n, dtype=bool)
  for i in range(n):
    j = parents[i]
    while j >= 0:
      anc[i, j] = True
      j = parents[j]
  return anc


@dataclasses.dataclass
class Case:
  """One block to test: parents [N], depth [N], context [B, C], tokens [B, N], and each row's
  batch-1 cache holding its context."""
  parents: tuple
  depth: np.ndarray
  context: np.ndarray
  tokens: np.ndarray
  caches: list

  def prefix(self, t: int) -> "Case":
    """The first t tokens (a chain's prefix is the chain of length t)."""
    return Case(self.parents[:t], self.depth[:t], self.context, self.tokens[:, :t], self.caches)


@dataclasses.dataclass
class Report:
  """identical [B, N] bool; max_abs: the largest |block - one-token| over all logits; logits
  [B, N, V]: the block's (to compare kernel paths with each other)."""
  identical: np.ndarray
  max_abs: float
  logits: np.ndarray = dataclasses.field(repr=False)

  @property
  def ok(self) -> bool:
    return bool(self.identical.all())

  def __str__(self):
    b, n = self.identical.shape
    return (f"{int(self.identical.sum())} of {b * n} rows identical (B={b}, N={n}); "
            f"max |diff| {self.max_abs:.3g}")


class BatchInvariance:
  """One model's forward under test, jitted once per shape (rerun it under another kernel
  path with no recompile: the kernels choose their path at run time)."""

  def __init__(self, model, cache_len: int = 256, params=None):
    self.model, self.cache_len = model, cache_len
    self.params = model.params if params is None else params
    # compiled as decoding compiles its programs (the elemental emitters on CPU)
    self._fwd = jax.jit(self._apply, static_argnames=("empty",),
                        compiler_options=compile_options.options())

  def _apply(self, params, tokens, positions, cache, ancestors, empty=False):
    """ancestors [N, N] bool: the block's tree (a chain's is lower-triangular)."""
    mask = kv.tree_mask(cache.lengths, ancestors, self.cache_len)
    logits, _, cache = self.model.apply(params, tokens, positions, cache, mask, empty_cache=empty)
    return logits, cache

  def _prefill(self, ctx: np.ndarray) -> kv.KVCache:
    """ctx [C] -> a batch-1 cache holding it (C = 0: a fresh cache)."""
    cache = self.model.init_cache(1, self.cache_len)
    if len(ctx) == 0:
      return cache
    t = jnp.asarray(ctx[None], jnp.int32)
    pos = jnp.arange(len(ctx), dtype=jnp.int32)[None]
    _, cache = self._fwd(self.params, t, pos, cache, jnp.tril(jnp.ones((len(ctx),) * 2, bool)))
    return kv.advance(cache, jnp.asarray([len(ctx)], jnp.int32))

  def _one_by_one(self, cache, tokens, parents) -> np.ndarray:
    """Batch 1: logits [N, V] of each block token from its root-to-token path, a call a token."""
    out = [None] * len(parents)
    children = {p for p in parents if p >= 0}
    for leaf in (n for n in range(len(parents)) if n not in children):
      path, j = [], leaf
      while j >= 0:
        path.append(j)
        j = parents[j]
      c = cache
      for n in reversed(path):
        tok = jnp.asarray([[tokens[n]]], jnp.int32)
        pos = c.lengths[:, None]
        logits, c = self._fwd(self.params, tok, pos, c, jnp.ones((1, 1), bool))
        c = kv.advance(c, jnp.ones((1,), jnp.int32))
        out[n] = np.asarray(logits[0, 0])
    return np.stack(out)

  def case(self, parents=(-1,), *, context: int = 32, batch: int = 1, seed: int = 0) -> Case:
    """A block to test: random contexts [B, C] and tokens [B, N] (seeded) for these parents."""
    parents = tuple(int(p) for p in parents)
    depth = _depths(parents)
    vocab = self.model.config.vocab_size
    rng = np.random.default_rng(seed)
    ctx = rng.integers(0, vocab, (batch, context))
    toks = rng.integers(0, vocab, (batch, len(parents)))
    return Case(parents, depth, ctx, toks, [self._prefill(ctx[b]) for b in range(batch)])

  def reference(self, case: Case) -> np.ndarray:
    """[B, N, V]: each token's logits from one-token forwards along its path, batch 1."""
    return np.stack([self._one_by_one(c, t, case.parents)
                     for c, t in zip(case.caches, case.tokens)])

  def block(self, case: Case, empty: bool = False) -> np.ndarray:
    """[B, N, V]: the block's logits from one forward of all B x N tokens (empty: as a prefill,
    the model's empty_cache form; the case needs context 0)."""
    b, n = case.tokens.shape
    if empty and case.context.shape[1]:
      raise ValueError("empty=True runs the block as a prefill: it needs context=0")
    cache = jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs), *case.caches)
    pos = jnp.asarray(np.broadcast_to(case.context.shape[1] + case.depth, (b, n)), jnp.int32)
    got, _ = self._fwd(self.params, jnp.asarray(case.tokens, jnp.int32), pos, cache,
                       jnp.asarray(_ancestors(case.parents)), empty=empty)
    return np.asarray(got)

  def check(self, parents=(-1,), *, context: int = 32, batch: int = 1, empty: bool = False,
            seed: int = 0) -> Report:
    """The block against its reference (see the module docstring)."""
    if empty and context:
      raise ValueError("empty=True runs the block as a prefill: it needs context=0")
    case = self.case(parents, context=context, batch=batch, seed=seed)
    return compare(self.block(case, empty), self.reference(case))

  def check_chains(self, lengths, *, context: int = 32, batch: int = 1, seed: int = 0) -> dict:
    """{T: Report} for chains of each length in `lengths`, all prefixes of one chain, so the
    one-token reference runs once, for the longest."""
    case = self.case(chain(max(lengths)), context=context, batch=batch, seed=seed)
    want = self.reference(case)
    return {t: compare(self.block(case.prefix(t)), want[:, :t]) for t in lengths}


def compare(got: np.ndarray, want: np.ndarray) -> Report:
  """A block's logits [B, N, V] against the one-token reference's."""
  same = (got == want) | (np.isnan(got) & np.isnan(want))
  return Report(identical=same.all(-1), max_abs=float(np.nanmax(np.abs(got - want))), logits=got)
