"""Medusa: extra decoding heads on the target's hidden state, verified as a tree in one call.

Cai et al. 2024 (Medusa-1 heads; Medusa-2's typical acceptance). One step, all rows at once,
all shapes static:

  propose   the heads read h, the target's final-normed hidden state at the last accepted token,
            and each head k gives its top-R tokens for position +k+2 (the pending token x0 is
            +1). The static candidate tree (specjax/tree.py) picks, for each of its N nodes,
            rank r of head depth-1: tokens [B,N+1] = [x0, node_1 .. node_N];
  verify    the shared tree step (`verify.tree`): the target scores the whole block in one
            forward under the tree mask; acceptance.verify_tree: "greedy" (token matching; at
            temperature 0 the longest root-to-node path matching the target's argmax), "exact"
            (SpecInfer / EAGLE's multi-draft rule: lossless at any temperature) or "typical"
            (Medusa-2, lossy); the accepted path's K/V are committed, it and the target's next
            token emitted;
  update    h becomes the hidden state at the accepted node (the target already computed it).

Rows accept different depths; nothing but the cache lengths and the emitted counts differ.

Statistics: accepted tokens per step (tau - 1), the accepted-depth histogram, and per head the
acceptance rate given its parent was accepted (Medusa's per-head accuracy, as measured here).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.decode import DRAFT, DecodeState, Method, Program, phase
from specjax.errors import InputError, check_int
from specjax.heads import Heads, check_fits, drafter, init_heads, load_heads
from specjax.methods import sizing, verify
from specjax.model import subset_logits
from specjax.packing import subset_head
from specjax.sampling import top_k_ids
from specjax.tree import as_tree, default_tree

RULES = ("exact", "greedy", "typical")

__all__ = ["Medusa", "init_heads", "load_heads"]


def _positive(name, value):
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or \
      not (np.isfinite(value) and value > 0):
    raise InputError(f"{name}={value!r} is invalid: typical acceptance needs a number > 0")


@dataclasses.dataclass(frozen=True)
class Medusa(verify.HeadsTree, Method):
  """Medusa decoding with `heads` (sj.init_heads / sj.load_heads) over a static candidate tree.

  tree: a specjax.tree.Tree or Medusa-format paths [(0,), (1,), (0, 0), ...] (default:
  `default_tree(num_heads)`, 15 nodes); acceptance: "exact" | "greedy" | "typical";
  epsilon, delta: typical acceptance's hard and entropy-scaled thresholds; top_k: the most
  candidates per head a tree may read (ranks must be below it).
  """
  top_k: int = 10

  name = "medusa"

  def __post_init__(self):
    sizing.left_out(self, {"tree": None})  # (None: default_tree below)
    if not isinstance(self.heads, Heads):
      raise InputError(f"heads={self.heads!r} is invalid: must be specjax Heads (sj.init_heads("
                       f"target, 'medusa') or sj.load_heads(...))")
    c = self.heads.config
    if c.kind != "medusa":
      raise InputError(f"heads of kind {c.kind!r} cannot run Medusa: need kind 'medusa'")
    if self.acceptance not in RULES:
      raise InputError(f"acceptance={self.acceptance!r} is invalid: must be one of "
                       f"{', '.join(RULES)}")
    if self.acceptance == "typical":
      _positive("epsilon", self.epsilon)
      _positive("delta", self.delta)
    check_int("top_k", self.top_k, 1, c.vocab_subset or c.vocab_size)
    tree = default_tree(c.num_heads) if self.tree is None else as_tree(self.tree)
    if tree.max_depth > c.num_heads:
      deep = next(p for p in tree.paths if len(p) > c.num_heads)
      raise InputError(f"tree path {deep} has depth {len(deep)}, but the heads have only "
                       f"{c.num_heads}: each depth reads one head")
    if tree.max_rank >= self.top_k:
      bad = next(p for p in tree.paths if max(p) >= self.top_k)
      raise InputError(f"tree path {bad} reads rank {max(bad)}, but top_k={self.top_k}: ranks "
                       f"must be below it (raise top_k or prune the tree)")
    object.__setattr__(self, "tree", tree)
    object.__setattr__(self, "key", (c, None if self.heads.vocab is None
                                     else self.heads.vocab.tobytes()))

  def prepare(self, model) -> "Medusa":
    """The tree, if left out, from the cost curve and the heads' held-out accuracies (sizing)."""
    return sizing.prepare(self, "medusa", model, self.heads)

  @property
  def lossless(self) -> bool:
    return self.acceptance != "typical"

  @property
  def extra_slots(self) -> int:
    return self.tree.num_nodes + 1

  @property
  def max_emit(self) -> int:
    return self.tree.max_depth + 1

  def validate(self, model) -> None:
    check_fits(self.heads, model)

  def arrays(self, model):
    out = {"w": self.heads.params["w"], "b": self.heads.params["b"]}
    if "lm" in self.heads.params:  # each head's own LM head [K,V or Vs,E] (published Medusa-1)
      out["lm"] = self.heads.params["lm"]
      if self.heads.vocab is not None:
        out["vocab"] = jnp.asarray(self.heads.vocab)
    elif self.heads.vocab is not None:
      out.update(subset_head(model, self.heads.vocab))  # vocab [Vs], head [Vs,E]
    return out

  def init(self, prog, arrays, state, hidden):
    """Keeps the hidden state at each prompt's last token: the heads' input for the first step."""
    b = state.seq.shape[0]
    h = jnp.take_along_axis(hidden, (state.prompt_len - 1)[:, None, None], axis=1)[:, 0]  # [B,E]
    return {"hidden": h, **verify.depth_counts(b, self.tree.max_depth)}

  def propose(self, prog: Program, params, arrays, hidden: jax.Array) -> jax.Array:
    """hidden [B,E] -> the heads' top-R candidates [B,K,R] (R = the ranks the tree reads)."""
    heads = drafter(self.heads.config, prog.config, arrays)  # MedusaHeads
    z = heads(hidden)  # [B,K,E]
    r = self.tree.ranks_needed()
    if heads.own_vocab:  # head k's own LM head
      ids = top_k_ids(heads.logits(z, None), r)
      return arrays["vocab"][ids] if "vocab" in arrays else ids
    if "head" in arrays:  # score only the subset's rows of the target's LM head
      logits = subset_logits(z, arrays)  # [B,K,Vs]
      return arrays["vocab"][top_k_ids(logits, r)]
    return top_k_ids(nnx.merge(prog.graphdef, params).head(z), r)  # one [B*K,E] x [E,V] matmul

  def step(self, prog: Program, params, arrays, state: DecodeState) -> DecodeState:
    t = self.tree
    m = state.method
    active = ~state.done
    key, k_acc = jax.random.split(state.key)
    with phase(DRAFT):
      cands = self.propose(prog, params, arrays, m["hidden"])  # [B,K,R]
    state, best, n, _, hidden = verify.static_tree(
        prog, params, state.replace(key=key), k_acc, t.take(cands), t, rule=self._rule(),
        epsilon=self.epsilon, delta=self.delta)

    h = jnp.take_along_axis(hidden, best[:, None, None], axis=1)[:, 0]
    h = jnp.where(active[:, None], h, m["hidden"])
    return state.replace(method=verify.count(dict(m, hidden=h), active, n))

  def _rule(self) -> str:
    """The acceptance rule's name for acceptance.verify_tree (a test subclass breaks it)."""
    return self.acceptance

  def stats(self, state) -> dict:
    out = verify.depth_stats(state.method)
    # P(head k's node accepted | its parent accepted): the depth acceptance, named per head
    out["head_acceptance"] = out.pop("depth_acceptance")
    return {"tree_nodes": self.tree.num_nodes, "tree_depth": self.tree.max_depth,
            "acceptance": self.acceptance, **out}
