"""The shared verify step: verify, accept, commit and emit, once for every method.

A method drafts; everything after its draft is the same for all of them and lives here, in two
shapes:

  chain  draft [B,G] (d_1 .. d_G after the pending token x0; -1 where a row drafted nothing):
         one causal target forward over [x0, d_1 .. d_G]; the chain rule (greedy, or exact
         rejection sampling: acceptance.verify_chain) keeps the first n[b]; `cache.advance`
         keeps x0 and d_1 .. d_n; x0's successors d_1 .. d_n and the target's own token are
         emitted.
  tree   draft [B,N] over a tree (parents, depth: one static tree or one per row): one target
         forward over [x0, nodes] under `cache.tree_mask` (each node sees the committed cache,
         its ancestors and itself); acceptance.verify_tree picks the accepted node; `cache.commit`
         moves x0 and the accepted path's K/V (scattered through the block) into place; the path
         and the target's own token are emitted.

Both take the acceptance rule's key as an argument and leave `state.key` alone: a method splits
its own stream (a drafter that samples takes its own key from it too).

Nobody drafted: with `skip_empty` [B] (rows that drafted nothing), a step in which every active
row drafted nothing runs a one-token forward instead of the whole block (`single`; a lax.cond, so
the program stays one while_loop). A chain's verification width may also follow the round (a
traced `width`: one compiled forward per width, lax.switch), for drafters that stop early.
The branches only read the cache: each returns its forward's new entries (padded to the widest
branch's tokens), written after the branch (`kv.write_new`). A branch that wrote the cache itself
made XLA copy every layer's K and V into and out of the branch on every step (two whole-cache
copies a round: 6% of a prompt-lookup run's cycles on the W4A8 target at a 176-slot cache, and
more with a longer one).

Below them, the accepted-depth counts the tree and feature-drafter methods keep (`depth_counts`,
`count`, `depth_stats`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import acceptance
from specjax import cache as kv
from specjax import tree as trees
from specjax.decode import DecodeState, Program, emit, emitted


class ChainSizes:
  """A chain method's step sizes: `chain_len` drafted tokens after the pending one (gamma unless
  the method says otherwise) take that many cache slots past the committed length and one more,
  and a step emits at most chain_len + 1 tokens."""

  @property
  def chain_len(self) -> int:
    return self.gamma

  @property
  def extra_slots(self) -> int:
    return self.chain_len + 1

  @property
  def max_emit(self) -> int:
    return self.chain_len + 1


class TreeSizes:
  """A tree method's step sizes: `num_nodes` candidates after the pending token, a path of at
  most `max_depth` of them accepted, plus the target's own token."""

  @property
  def extra_slots(self) -> int:
    return self.num_nodes + 1

  @property
  def max_emit(self) -> int:
    return self.max_depth + 1


@dataclasses.dataclass(frozen=True)
class HeadsTree:
  """The settings every heads-drafted tree method (Medusa, EAGLE) starts with: the drafter
  (`heads`), its tree, and the acceptance rule ("exact" | "greedy" | "typical") with typical
  acceptance's hard (`epsilon`) and entropy-scaled (`delta`) thresholds. `key` and `left_out` are
  the method's own (set in its __post_init__)."""
  heads: Any = dataclasses.field(default=None, compare=False, repr=False)
  tree: Any = None
  acceptance: str = "exact"
  epsilon: float = 0.09
  delta: float = 0.3
  key: tuple = dataclasses.field(default=(), init=False, repr=False)
  left_out: tuple = dataclasses.field(default=(), init=False, compare=False, repr=False)


def one_hot_rule(key, draft, logits, sp):
  """The chain rule for a deterministic draft (q = one-hot): greedy token matching when every row
  is greedy, else exact rejection sampling. draft [B,G], logits [B,G+1,V] -> (n [B], next [B])."""
  return acceptance.verify_chain(key, draft, None, logits, sp)


def _causal_forward(prog: Program, params, cache, tokens, write: bool = True):
  """tokens [B,T] at the cache's next T positions, causally -> (logits [B,T,V], hidden, cache;
  with write=False, the new entries (kv.NewEntries) instead of the cache)."""
  t = tokens.shape[1]
  pos = cache.lengths[:, None] + jnp.arange(t)[None, :]
  return prog.forward(params, tokens, pos, cache, prog.causal_mask(cache.lengths, t),
                      write_cache=write)


def single(prog: Program, params, state: DecodeState, key, pad_to: int):
  """The step when nobody drafted: the pending token alone, the chain rule over no drafts.
  Returns (n [B] = 0, next [B] the target's token, x0's new entries padded to `pad_to` tokens
  (kv.NewEntries: a branch's result, written after the lax.cond, module docstring))."""
  b = state.seq.shape[0]
  logits, _, new = _causal_forward(prog, params, state.cache, state.last_token[:, None], False)
  _, nxt = acceptance.verify_chain(key, jnp.zeros((b, 0), jnp.int32), None, logits, state.sp)
  return jnp.zeros((b,), jnp.int32), nxt, new.pad(pad_to)


def chain(prog: Program, params, state: DecodeState, key, draft, *, rule=one_hot_rule,
          width=None, min_width: int = 1, skip_empty=None):
  """Verify, accept, commit and emit a chain: draft [B,G] int32 (-1: not drafted).

  rule(key, draft [B,G], logits [B,G+1,V], sp) -> (n [B], next [B]): the acceptance rule
  (default `one_hot_rule`; a drafter with its own distributions q passes a rule that reads them).
  width [] int32 in [min_width, G] (optional): verify only [x0, d_1 .. d_width] this round (one
  compiled branch per width, 0: x0 alone; the logits past it are zero, so the rule must reject
  drafts there).
  skip_empty [B] bool (optional): rows that drafted nothing (module docstring).
  Returns (state after emit (its key as given), n [B] drafts accepted, hidden [B,G+1,E] the
  target's hidden states over the block (None with width or skip_empty))."""
  active = ~state.done
  g = draft.shape[1]
  tokens = jnp.concatenate([state.last_token[:, None], jnp.maximum(draft, 0)], axis=1)  # [B,G+1]
  if width is not None:
    def verify(w):  # -> logits [B,G+1,V] (zero past w tokens) and the new entries (G+1 tokens)
      def run(cache):
        logits, _, new = _causal_forward(prog, params, cache, tokens[:, :w], False)
        return jnp.pad(logits, ((0, 0), (0, g + 1 - w), (0, 0))), new.pad(g + 1)
      return run

    logits, new = jax.lax.switch(width - min_width,
                                 [verify(w + 1) for w in range(min_width, g + 1)], state.cache)
    cache = kv.write_new(state.cache, new)
    n, nxt = rule(key, draft, logits, state.sp)
    hidden = None
  elif skip_empty is not None:
    def full(cache):
      logits, _, new = _causal_forward(prog, params, cache, tokens, False)
      return (*rule(key, draft, logits, state.sp), new)

    n, nxt, new = jax.lax.cond(jnp.any(active & ~skip_empty), full,
                               lambda c: single(prog, params, state.replace(cache=c), key, g + 1),
                               state.cache)
    cache = kv.write_new(state.cache, new)
    hidden = None
  else:
    logits, hidden, cache = _causal_forward(prog, params, state.cache, tokens)
    n, nxt = rule(key, draft, logits, state.sp)
  cache = kv.advance(cache, jnp.where(active, n + 1, 0))
  return emit(state.replace(cache=cache), emitted(tokens[:, 1:], n, nxt), n + 1), n, hidden


def static_tree(prog: Program, params, state: DecodeState, key, draft, t, **kw):
  """`tree` over one static specjax.tree.Tree t (its parents, depths, depth and ancestor mask);
  kw: tree's rule, epsilon, delta."""
  return tree(prog, params, state, key, draft, jnp.asarray(t.parent), jnp.asarray(t.depth),
              t.max_depth, ancestor=jnp.asarray(t.ancestor), **kw)


def tree(prog: Program, params, state: DecodeState, key, draft, parents, depth, max_depth: int,
         *, ancestor=None, rule: str = "exact", epsilon: float = 0.09, delta: float = 0.3,
         skip_empty=None):
  """Verify, accept, commit and emit a tree: draft [B,N] the nodes' tokens; parents, depth [N+1]
  (one static tree) or [B,N+1] (a tree per row; the root -1 and 0, nodes nobody filled -1 and 0);
  max_depth bounds depth; ancestor [N+1,N+1] or [B,N+1,N+1] (default: from parents).

  rule: acceptance.verify_tree's ("exact" | "greedy" | "typical", with epsilon and delta).
  skip_empty [B] bool (optional): rows that drafted nothing (module docstring).
  Returns (state after emit (its key as given), best [B] the accepted node, n [B] accepted draft
  tokens, keep [B,D+1] the block offsets kept (0 = the pending token, then the path), hidden
  [B,N+1,E] the target's hidden states over the block (None with skip_empty))."""
  b = draft.shape[0]
  active = ~state.done
  tokens = jnp.concatenate([state.last_token[:, None], draft], axis=1)  # [B,N+1]
  anc = trees.ancestors_from_parents(parents, max_depth) if ancestor is None else ancestor

  def whole(cache, write=True):  # with write=False, the new entries in the cache's place
    lengths = cache.lengths
    mask = kv.tree_mask(lengths, anc, cache.max_len, prog.config.sliding_window)
    logits, hidden, cache = prog.forward(params, tokens, lengths[:, None] + depth, cache, mask,
                                         write_cache=write)
    best, n, nxt = acceptance.verify_tree(key, tokens, parents, anc, depth, logits, state.sp, rule,
                                          epsilon, delta)
    return best, n, nxt, cache, hidden

  if skip_empty is None:
    best, n, nxt, cache, hidden = whole(state.cache)
  else:
    def nobody(cache):
      n, nxt, new = single(prog, params, state.replace(cache=cache), key, tokens.shape[1])
      return jnp.zeros((b,), jnp.int32), n, nxt, new

    best, n, nxt, new = jax.lax.cond(jnp.any(active & ~skip_empty),
                                     lambda c: whole(c, False)[:4], nobody, state.cache)
    cache = kv.write_new(state.cache, new)
    hidden = None
  anc_b = jnp.broadcast_to(anc, (b,) + anc.shape[-2:])
  row = jnp.take_along_axis(anc_b, best[:, None, None], axis=1)[:, 0]  # [B,N+1]
  path = trees.path_nodes(row, depth, max_depth)  # [B,D] accepted nodes, depth 1 .. n
  out = emitted(jnp.take_along_axis(tokens, path, axis=1), n, nxt)  # [B,D+1]
  keep = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), path], axis=1)
  cache = kv.commit(cache, keep, jnp.where(active, n + 1, 0))
  return emit(state.replace(cache=cache), out, n + 1), best, n, keep, hidden


# ----------------------------------------------------------------------------- accepted-depth counts


def depth_counts(batch: int, max_depth: int) -> dict:
  """The counts a method that accepts up to max_depth drafts a round keeps, all zero: rounds [B]
  (active steps), accepted [B] (drafts accepted), depth_hist [B,max_depth+1] (rounds that
  accepted d drafts)."""
  z = jnp.zeros((batch,), jnp.int32)
  return {"rounds": z, "accepted": z, "depth_hist": jnp.zeros((batch, max_depth + 1), jnp.int32)}


def count(m: dict, active, n) -> dict:
  """m (holding `depth_counts`) after a round that accepted n [B] drafts in the active [B] rows."""
  a = active.astype(jnp.int32)
  return dict(m, rounds=m["rounds"] + a, accepted=m["accepted"] + a * n,
              depth_hist=m["depth_hist"].at[jnp.arange(n.shape[0]), n].add(a))


def depth_stats(m) -> dict:
  """Accepted tokens per step and, per depth d, P(depth d accepted | depth d - 1 accepted)."""
  hist = np.asarray(m["depth_hist"]).sum(0)  # steps that accepted d draft tokens
  rounds = int(np.asarray(m["rounds"]).sum())
  reached = hist[::-1].cumsum()[::-1]  # steps that accepted >= d
  per_depth = [float(reached[d + 1] / reached[d]) if reached[d] else 0.0
               for d in range(len(hist) - 1)]
  acc = int(np.asarray(m["accepted"]).sum())
  return {"draft_rounds": rounds, "accepted_tokens": acc,
          "accepted_per_step": acc / max(1, rounds), "accepted_depth_hist": hist.tolist(),
          "depth_acceptance": per_depth}
