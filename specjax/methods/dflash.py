"""DFlash: a block-diffusion drafter drafts a whole block in one forward; the target verifies it.

Chen, Liang, Liu 2026 (arXiv 2602.06036). The drafter (specjax/drafters/dflash.py, heads of kind
"dflash") reads the target's raw states after a few of its layers, projected into one context
feature per committed position, whose keys and values it keeps in its own static KV cache. One
step, all rows at once, all shapes static:

  draft     the block [x_L, m, .., m] (x_L the pending token, m the mask token, block_size
            tokens at positions L .. L + bs - 1) runs through the drafter once, attending to the
            context cache (positions < L) and to the whole block; the target's LM head on the
            drafter's output at offsets 1 .. bs - 1 gives q_1 .. q_{bs-1}, the distributions of
            x_{L+1} .. x_{L+bs-1}. Each d_j is drawn from q_j (argmax at temperature 0).
  verify    the shared chain step (`verify.chain`): the target scores [x_L, d_1 .. d_{bs-1}]
            causally; greedy token matching at temperature 0, else exact rejection sampling
            with the drafter's q_j. Exact: each q_j depends on the context alone (the block's
            other tokens are masks), so d_j ~ q_j is a draw fixed before the target's coins.
  update    the target's tapped states over the block are the context features of positions
            L .. L + bs - 1; their K/V are written into the drafter's cache at those slots and
            its length follows the target's (L + n + 1): entries past it are rewritten next round.

A tree instead of a chain (`tree=`): each q_j depends on the context alone, so offset j's
top-R tokens are candidates whichever token precedes them. A static candidate tree
(specjax/tree.py, Medusa's format: a node at depth d takes rank r of q_d) is verified in one
target forward by the shared tree step (`verify.tree`): greedy matching at temperature 0, else
the multi-draft rule for fixed candidates ("exact", as Medusa's), lossless at any temperature.
The context of the accepted path's positions is written as in the chain.

Statistics: the accepted-depth histogram and per block offset the acceptance rate given the
offset before it was accepted (the per-position acceptance curve DFlash reports).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax import acceptance, sampling
from specjax import cache as kv
from specjax.decode import DRAFT, DecodeState, Method, Program, phase
from specjax.drafters.dflash import drafter, packed_copies
from specjax.errors import InputError, check_int
from specjax.heads import check_fits
from specjax.methods import sizing, verify
from specjax.methods.features import (check_heads, check_vocab, embed, over_vocab,
                                      target_logits, to_tokens)
from specjax.packing import drafter_qtype, on_kernel, subset_head
from specjax.sampling import top_k_ids
from specjax.tree import as_tree


@dataclasses.dataclass(frozen=True)
class DFlash(Method):
  """DFlash decoding with `heads` (sj.init_heads(target, "dflash", mask_token_id=...) or
  sj.load_heads(...)). block_size: tokens per block, the pending one included, at most the block
  the heads were trained for (left out: chosen from the cost curve when the method meets its
  target, see methods/sizing.py; the trained block where the heads record no acceptance).
  tree: None (a chain of block_size - 1 drafts) or a candidate tree (a specjax.tree.Tree or
  Medusa-format paths [(0,), (1,), (0, 0), ...]; depth d reads offset d's ranked tokens), verified
  in one forward; its depth must fit in the block (block_size left out: the tree's depth + 1).
  Left out together with block_size, the cost curve picks a chain or a tree, whichever the heads'
  held-out acceptance predicts faster. vocab: token ids [Vs] the drafter proposes over (FR-Spec
  style: the target's LM-head rows of those ids score the block, so a draft costs Vs rows instead
  of all V; q is zero outside them and verification uses the target's full p, so decoding stays
  exact); left out: the heads' own subset if their file records one, else the whole vocabulary."""
  heads: Any = dataclasses.field(default=None, compare=False, repr=False)
  block_size: int | None = None
  tree: Any = None
  vocab: Any = dataclasses.field(default=None, compare=False, repr=False)
  key: tuple = dataclasses.field(default=(), init=False, repr=False)
  left_out: tuple = dataclasses.field(default=(), init=False, compare=False, repr=False)

  name = "dflash"
  lossless = True
  raw_taps = True  # the drafter reads the raw residual stream after its target layers

  def __post_init__(self):
    check_heads(self.heads, "dflash", "DFlash")
    c = self.heads.config
    tree = as_tree(self.tree)
    object.__setattr__(self, "tree", tree)
    deep = None if tree is None else max(tree.paths, key=len)
    if tree is not None and tree.max_depth >= c.block_size:
      raise InputError(f"tree path {deep} has depth {len(deep)}, but these heads draft at most "
                       f"{c.block_size - 1} offsets (trained for blocks of {c.block_size}): each "
                       f"depth reads one offset")
    sizing.left_out(self, {"block_size": c.block_size if tree is None else tree.max_depth + 1,
                           "tree": None})
    check_int("block_size", self.block_size, 2, c.block_size,
              f" (these heads were trained for blocks of {c.block_size})")
    if tree is not None and tree.max_depth >= self.block_size:
      raise InputError(f"tree path {deep} has depth {len(deep)}, but a block of "
                       f"block_size={self.block_size} drafts {self.block_size - 1} offsets: each "
                       f"depth reads one offset")
    vocab = check_vocab(self.vocab if self.vocab is not None else self.heads.vocab, c.vocab_size)
    object.__setattr__(self, "vocab", vocab)
    if tree is not None:
      check_int("tree ranks (max rank + 1)", tree.ranks_needed(), 1,
                c.vocab_size if vocab is None else vocab.size, " (the drafted vocabulary's size)")
    object.__setattr__(self, "key", (c, None if vocab is None else vocab.tobytes()))

  def prepare(self, model) -> "DFlash":
    """block_size, if left out, from the cost curve and the heads' held-out top-1 per block
    offset (sizing); without those numbers, the block the heads were trained for."""
    return sizing.prepare(self, "dflash", model, self.heads)

  @property
  def taps(self) -> tuple:
    return self.heads.config.taps

  @property
  def extra_slots(self) -> int:
    return self.block_size if self.tree is None else max(self.block_size, self.tree.num_nodes + 1)

  @property
  def max_emit(self) -> int:
    return self.block_size if self.tree is None else self.tree.max_depth + 1

  def validate(self, model) -> None:
    check_fits(self.heads, model)

  def arrays(self, model):
    out = {"p": dict(self.heads.params), "embed": model.params["embed"][...]}
    # The drafter's products on the kernel, as the target's (EAGLE's modules alike).
    if on_kernel(model) and jnp.dtype(out["p"]["fc"].dtype) == jnp.float32:
      out["p"], out["packed"] = packed_copies(out["p"], drafter_qtype(model))
    if self.vocab is not None:
      out.update(subset_head(model, self.vocab))  # vocab [Vs], head [Vs,E]
    return out

  def _context(self, arrays, ctx: kv.KVCache, hidden, positions, start):
    """ctx with the context K/V of hidden [B,T,(n+1)E] (the taps, then the final feature) at
    positions [B,T] written at slots start [B]."""
    c = self.heads.config
    feats = hidden[..., :len(c.target_layer_ids) * c.hidden_size]
    new = drafter(c, arrays["p"]).context_kv(feats, positions, arrays.get("packed"))
    return ctx.replace(layers=tuple(kv.write_layer(layer, k, v, start)
                                    for layer, (k, v) in zip(ctx.layers, new)))

  def init(self, prog, arrays, state, hidden):
    """The drafter's cache over the prompt: the context of positions [0, prompt length)."""
    c = self.heads.config
    b, p = hidden.shape[:2]
    ctx = kv.init(c.num_layers, b, prog.max_len + self.block_size, c.kv_heads, c.head_dim,
                  arrays["p"]["fc"].dtype)
    pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    ctx = self._context(arrays, ctx, hidden, pos, jnp.zeros((b,), jnp.int32))
    depth = self.block_size - 1 if self.tree is None else self.tree.max_depth
    return {"ctx": ctx.replace(lengths=state.cache.lengths), **verify.depth_counts(b, depth)}

  def block_logits(self, prog: Program, params, arrays, state: DecodeState):
    """One drafter forward over the block. Returns (logits [B,G,V] of offsets 1 .. G, or [B,G,Vs]
    over a vocabulary subset; positions [B,G+1] of the block), G = block_size - 1."""
    c = self.heads.config
    ctx = state.method["ctx"]
    b, bs = state.seq.shape[0], self.block_size
    lengths = ctx.lengths
    toks = jnp.concatenate([state.last_token[:, None],
                            jnp.full((b, bs - 1), c.mask_token_id, jnp.int32)], axis=1)
    pos = lengths[:, None] + jnp.arange(bs, dtype=jnp.int32)[None, :]  # [B,bs]
    see_ctx = jnp.arange(ctx.max_len)[None, None, :] < lengths[:, None, None]  # [B,1,S]
    mask = jnp.concatenate([jnp.broadcast_to(see_ctx, (b, bs, ctx.max_len)),
                            jnp.ones((b, bs, bs), bool)], axis=-1)
    layers = [(layer["k"], layer["v"]) for layer in ctx.layers]
    h = drafter(c, arrays["p"])(embed(arrays["embed"], toks), pos, layers, mask,
                                arrays.get("packed"))
    return target_logits(prog, params, arrays, h[:, 1:]), pos  # [B,G,V or Vs]

  def step(self, prog: Program, params, arrays, state: DecodeState) -> DecodeState:
    m = state.method
    active = ~state.done
    key, k_draft, k_acc = jax.random.split(state.key, 3)
    start = m["ctx"].lengths
    with phase(DRAFT):
      logits, pos = self.block_logits(prog, params, arrays, state)
    state = state.replace(key=key)
    if self.tree is None:
      q = sampling.probs(logits, state.sp)  # [B,G,V or Vs]
      draft = to_tokens(arrays, sampling.sample(k_draft, logits, state.sp, p=q))

      def rule(k, d, tlogits, sp):  # exact rejection sampling with the drafter's own q
        full = over_vocab(q, arrays.get("vocab"), tlogits.shape[-1])
        return acceptance.verify_chain(k, d, full, tlogits, sp)

      state, n, hidden = verify.chain(prog, params, state, k_acc, draft, rule=rule)
    else:
      t = self.tree
      cands = to_tokens(arrays, top_k_ids(logits[:, :t.max_depth], t.ranks_needed()))  # [B,D,R]
      state, _, n, keep, hidden = verify.static_tree(prog, params, state, k_acc, t.take(cands), t,
                                                     rule="exact")
      hidden = jnp.take_along_axis(hidden, keep[:, :, None], axis=1)  # the accepted path's
      pos = pos[:, :t.max_depth + 1]
    ctx = self._context(arrays, m["ctx"], hidden, pos, start).replace(lengths=state.cache.lengths)
    return state.replace(method=verify.count(dict(m, ctx=ctx), active, n))

  def stats(self, state) -> dict:
    out = dict(verify.depth_stats(state.method), block_size=self.block_size)
    if self.tree is not None:
      out.update(tree_nodes=self.tree.num_nodes, tree_depth=self.tree.max_depth)
    return out
