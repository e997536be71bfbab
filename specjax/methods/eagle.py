"""EAGLE-1 / EAGLE-2: a one-layer head drafts on the target's features; a tree is verified at once.

Li et al. 2024 (EAGLE: feature-level drafting; EAGLE-2: dynamic draft trees). The head
(specjax/drafters/eagle.py, kind "eagle") reads, at position i, the embedding of token x_{i+1} and
the target's feature f_i (its final-normed last hidden state) and predicts f_{i+1}; the target's own
LM head turns a feature into logits. Drafting feeds the head its own predicted features. One step,
all rows at once, all shapes static:

  catch up  the head re-reads the last W = depth + 1 positions [L - W, L) with the true tokens and
            the target's true features (kept in a rolling buffer): this rewrites whatever the
            previous round drafted there, so the head cache holds exactly what teacher forcing
            gives for every committed position. Its output at L - 1 predicts f_L (the pending
            token x_L's feature), and the LM head on it scores the first draft depth.
  draft     EAGLE-1 (`tree=` a static tree, specjax/tree.py): every tree node with children runs
            the head once (one batched forward per depth); its children are its head's top ranks.
            EAGLE-2 (`tree="dynamic"`): depth 1 is the top_k tokens after the root; then at each
            depth the top_k frontier nodes run the head (one forward of top_k tokens, a tree mask
            over the head's cache: each sees the committed cache, its ancestors and itself), each
            proposes its top_k children scored by cumulative log-probability, and the best top_k
            of those top_k^2 children form the next frontier. Finally every drafted node (top_k +
            (depth - 1) * top_k^2 of them) is reranked by score and the best num_nodes kept, and
            renumbered depth by depth (siblings by score: the order verification tries them).
  verify    the shared tree step (`verify.tree`): the target scores [x_L, nodes] under the tree
            mask with the tree's per-row parents, acceptance.verify_tree applies the rule ("exact"
            multi-draft, "greedy" token matching, or lossy "typical"), and x_L and the accepted
            path's K/V are committed.
  update    the target's hidden states at x_L and the accepted nodes are the true features
            f_L .. f_{L+n}: they enter the buffer, and the next round's catch-up re-runs the head
            over them.

Why the dynamic tree keeps sampling exact: the tree is a function of the head's logits only (its
top-k and cumulative log-probabilities, no random draws), i.e. of the context; the multi-draft rule
is exact for any set of candidates fixed before its coins are drawn (it emits x with probability
p(x) at every node whatever the candidates are), so the output is distributed as the target's.

Parents always survive the rerank: a child's score is its parent's plus a log-probability <= 0, so
it never beats its parent, and ties are broken by drafting order, where a parent always precedes
its children (stable sort). The candidate bound: num_nodes <= top_k + (depth - 1) * top_k^2.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax import cache as kv
from specjax import tree as trees
from specjax.tree import capacity
from specjax.decode import DRAFT, DecodeState, Method, Program, phase
from specjax.drafters.kinds import check_fits, module_type
from specjax.errors import InputError, check_int
from specjax.methods import sizing, verify
from specjax.methods.features import (catch_up, check_heads, embed, feature_buffer, head_arrays,
                                      lm_logits, modules, prompt_pass, shift_in, to_tokens)
from specjax.sampling import top_k_ids

RULES = ("exact", "greedy", "typical")
TREE_NAMES = ("dynamic",)


def check_common(method, rules=RULES) -> None:
  if method.acceptance not in rules:
    raise InputError(f"acceptance={method.acceptance!r} is invalid: must be one of "
                     f"{', '.join(rules)}")


@dataclasses.dataclass(frozen=True)
class Eagle(verify.HeadsTree, verify.TreeSizes, Method):
  """EAGLE decoding with `heads` (sj.init_heads(target, "eagle") / sj.load_heads(...)), EAGLE-1/2
  heads or EAGLE-3 heads (kind "eagle3": fc over three target layers, their own LM head over a
  draft vocabulary; specjax/drafters/eagle3.py), one code path.

  tree: "dynamic" (EAGLE-2: depth, top_k, num_nodes as in the module docstring) or a static tree
  (EAGLE-1: a specjax.tree.Tree or Medusa-format paths [(0,), (1,), (0, 0), ...]; depth, top_k and
  num_nodes then come from the tree). acceptance: "exact" | "greedy" | "typical".
  """
  # tree and the sizes, None: from the cost curve (methods/sizing.py), else EAGLE's paper sizes
  # ("dynamic", depth 5, top_k 8, 32 nodes). The sizes are keyword-only.
  depth: int | None = dataclasses.field(default=None, kw_only=True)
  top_k: int | None = dataclasses.field(default=None, kw_only=True)
  num_nodes: int | None = dataclasses.field(default=None, kw_only=True)

  name = "eagle"

  def __post_init__(self):
    sizing.left_out(self, {"tree": "dynamic", "depth": 5, "top_k": 8, "num_nodes": 32})
    check_heads(self.heads, ("eagle", "eagle3"), "EAGLE")
    c = self.heads.config
    check_common(self)
    vocab = c.vocab_subset or c.vocab_size
    tree = self.tree
    if isinstance(tree, str):
      if tree not in TREE_NAMES:
        raise InputError(f"tree={tree!r} is invalid: give 'dynamic' (EAGLE-2) or a static tree "
                         f"(a list of paths such as [(0,), (1,), (0, 0)])")
      check_int("depth", self.depth, 1, 64)
      check_int("top_k", self.top_k, 1, vocab, " (the head's vocabulary size)")
      cap = capacity(self.depth, self.top_k)
      check_int("num_nodes", self.num_nodes, self.top_k, cap,
                f" (top_k={self.top_k} <= num_nodes <= top_k + (depth - 1) * top_k^2 = {cap}, "
                f"the nodes a depth-{self.depth} expansion drafts)")
    else:
      tree = trees.as_tree(tree)
      check_int("tree ranks (max rank + 1)", tree.ranks_needed(), 1, vocab,
                " (the head's vocabulary size)")
      object.__setattr__(self, "tree", tree)
      object.__setattr__(self, "depth", tree.max_depth)
      object.__setattr__(self, "top_k", tree.ranks_needed())
      object.__setattr__(self, "num_nodes", tree.num_nodes)
    object.__setattr__(self, "key", (c, None if self.heads.vocab is None
                                     else self.heads.vocab.tobytes()))

  # ------------------------------------------------------------------ protocol

  def prepare(self, model) -> "Eagle":
    """The tree's sizes, if all left out, from the cost curve and the head's held-out top-1 per
    depth (sizing)."""
    return sizing.prepare(self, "eagle", model, self.heads)

  @property
  def dynamic(self) -> bool:
    return isinstance(self.tree, str)

  @property
  def taps(self) -> tuple:
    """The target layers a fused-feature head reads (the program's forwards return them)."""
    return self.heads.config.taps

  @property
  def raw_taps(self) -> bool:
    """EAGLE-3 heads read the raw residual stream at their taps (fused heads: normalised)."""
    return module_type(self.heads.config).raw_taps

  @property
  def lossless(self) -> bool:
    return self.acceptance != "typical"

  @property
  def max_depth(self) -> int:
    return self.depth

  @property
  def window(self) -> int:
    """W: the catch-up window (one round commits at most depth + 1 tokens)."""
    return self.depth + 1

  def _internal(self) -> np.ndarray:
    """Static tree: the nodes with children (they run the head), in index order."""
    t = self.tree
    has_child = np.zeros(t.num_nodes + 1, bool)
    has_child[t.parent[1:]] = True
    return np.flatnonzero(has_child[1:]) + 1

  def _frontier_slots(self) -> int:
    """Head-cache slots the drafted nodes use past the committed length."""
    return (self.depth - 1) * self.top_k if self.dynamic else len(self._internal())

  def validate(self, model) -> None:
    check_fits(self.heads, model)

  def arrays(self, model):
    return head_arrays(self.heads, model)

  def module(self, prog, arrays):
    """The head, of its kind's module type, over the device arrays (inside the program)."""
    return modules(self.heads.config, prog, arrays)[0]

  def init(self, prog, arrays, state, hidden):
    """Fills the head cache over the prompt and keeps the last W prompt features."""
    return dict(self.head_state(prog, arrays, state, hidden, self.window),
                **verify.depth_counts(state.seq.shape[0], self.depth))

  def head_state(self, prog, arrays, state, hidden, window: int) -> dict:
    """The head's state after prefill, for rounds that commit at most `window` tokens (its own
    depth + 1; more inside a hybrid tree): the head cache run over the prompt, with room for the
    window and the drafted frontier, and the last `window` prompt features."""
    b = state.seq.shape[0]
    c = prog.config
    s_h = prog.max_len + window + self._frontier_slots()
    cache = kv.init(1, b, s_h, c.num_kv_heads, c.head_dim, hidden.dtype)
    mod = self.module(prog, arrays)
    hidden = mod.fuse(hidden)  # taps + final -> the fused feature
    cache = prompt_pass(prog, [mod], arrays, state.seq, hidden, cache)
    return {"hcache": cache, "feats": feature_buffer(hidden, state.prompt_len, window)}

  # ------------------------------------------------------------------ drafting

  def _node_forward(self, mod, arrays, cache, tok, feat, pos, start, rows_anc, lengths):
    """The head `mod` over new nodes: tok [B,T]; feat [B,T,E] (each node's parent's predicted
    feature); pos [B,T]; start [B] their first slot; rows_anc [B or 1,T,F] each node's ancestors
    (itself included) among the F drafted slots that begin at `lengths`. Returns (out [B,T,E],
    cache)."""
    s = jnp.arange(cache.max_len)[None, None, :]
    off = s - lengths[:, None, None]
    f = rows_anc.shape[-1]
    rows_anc = jnp.broadcast_to(rows_anc, (tok.shape[0],) + rows_anc.shape[1:])
    from_tree = jnp.take_along_axis(
        rows_anc, jnp.broadcast_to(jnp.clip(off, 0, f - 1), tok.shape + (cache.max_len,)), axis=2)
    mask = (off < 0) | ((off < f) & from_tree)  # committed cache, then ancestors and self
    h, layer = mod(embed(arrays["embed"], tok), feat, pos, cache.layers[0], start, mask)
    return h, cache.replace(layers=(layer,))

  def draft_dynamic(self, prog, params, arrays, mod, cache, root: jax.Array,
                    lengths: jax.Array):
    """EAGLE-2's expansion with the head `mod` (see `expand_tree`). root [B,E]: the head's predicted
    feature at the pending token. Returns (tokens [B,N] head-vocabulary indices, parents [B,N+1],
    depth [B,N+1], scores [B,N], the head cache)."""
    k = self.top_k
    b, e = root.shape
    f = max((self.depth - 1) * k, 1)

    def expand(carry, ids, parent_slot, d):
      cache, anc, h_prev = carry
      if d == 1:  # the depth-1 nodes' parent is the root
        feat = jnp.broadcast_to(root[:, None, :], (b, k, e))
      else:
        local = parent_slot - (d - 2) * k
        feat = jnp.take_along_axis(h_prev, local[..., None], axis=1)
        anc = jnp.take_along_axis(anc, local[..., None], axis=1)
      slots = (d - 1) * k + jnp.arange(k)
      anc = anc | (jnp.arange(f)[None, None, :] == slots[None, :, None])
      h, cache = self._node_forward(mod, arrays, cache, to_tokens(arrays, ids), feat,
                                    jnp.broadcast_to(lengths[:, None] + d - 1, (b, k)),
                                    lengths + (d - 1) * k, anc, lengths)
      logp = jax.nn.log_softmax(lm_logits(prog, params, arrays, mod, h), axis=-1)  # [B,k,Vh]
      return (cache, anc, h), logp

    logp0 = jax.nn.log_softmax(lm_logits(prog, params, arrays, mod, root), axis=-1)  # [B,Vh]
    carry = (cache, jnp.zeros((b, k, f), bool), jnp.zeros((b, k, e), root.dtype))
    *out, carry = expand_tree(logp0, expand, carry, self.depth, k, self.num_nodes)
    return (*out, carry[0])

  def draft_static(self, prog, params, arrays, mod, cache, root: jax.Array, lengths: jax.Array):
    """EAGLE-1: the static tree's nodes, drafted by the head `mod`. root [B,E] -> (node tokens [B,N]
    (head-vocabulary indices), the head cache)."""
    t = self.tree
    r = t.ranks_needed()
    internal = self._internal()
    slot = {int(nd): i for i, nd in enumerate(internal)}
    anc_s = t.ancestor[np.ix_(internal, internal)] if len(internal) else np.zeros((0, 0), bool)
    # node -> its children [B,R]
    cands = {0: top_k_ids(lm_logits(prog, params, arrays, mod, root), r)}
    feat = {0: root}
    tok = {}
    for d in range(1, t.max_depth + 1):
      level = [i for i in range(1, t.num_nodes + 1) if t.depth[i] == d]
      for i in level:
        tok[i] = cands[int(t.parent[i])][:, t.rank[i]]
      run = [i for i in level if i in slot]
      if not run:
        continue
      x = jnp.stack([tok[i] for i in run], axis=1)  # [B,T]
      fp = jnp.stack([feat[int(t.parent[i])] for i in run], axis=1)  # [B,T,E]
      rows = jnp.asarray(anc_s[[slot[i] for i in run]])[None]  # [1,T,F]
      h, cache = self._node_forward(mod, arrays, cache, to_tokens(arrays, x), fp,
                                    jnp.broadcast_to(lengths[:, None] + d - 1, x.shape),
                                    lengths + slot[run[0]], rows, lengths)
      top = top_k_ids(lm_logits(prog, params, arrays, mod, h), r)  # [B,T,R]
      for j, i in enumerate(run):
        cands[i] = top[:, j]
        feat[i] = h[:, j]
    return jnp.stack([tok[i] for i in range(1, t.num_nodes + 1)], axis=1), cache

  def draft(self, prog, params, arrays, seq, m, lengths):
    """One round's drafting: the catch-up over the last committed positions (m: the method
    state, "hcache" and "feats"), then the tree. Returns (tokens [B,N] token ids, parents and depth
    (per row [B,N+1] for the dynamic tree, the static tree's own [N+1]), the nodes' cumulative
    draft log-probabilities [B,N] (None for a static tree), the head cache)."""
    mod = self.module(prog, arrays)
    hcache, root, _ = catch_up(prog, [mod], arrays, seq, m["feats"], lengths, m["hcache"])
    root = root[:, 0]  # [B,E] predicted feature of the pending token
    if self.dynamic:
      draft, parents, depth, scores, hcache = self.draft_dynamic(prog, params, arrays, mod, hcache,
                                                                 root, lengths)
    else:
      draft, hcache = self.draft_static(prog, params, arrays, mod, hcache, root, lengths)
      scores = None
      parents, depth = jnp.asarray(self.tree.parent), jnp.asarray(self.tree.depth)
    return to_tokens(arrays, draft), parents, depth, scores, hcache

  # ------------------------------------------------------------------ one step

  def step(self, prog: Program, params, arrays, state: DecodeState) -> DecodeState:
    m = state.method
    active = ~state.done
    key, k_acc = jax.random.split(state.key)

    with phase(DRAFT):
      draft, parents, depth, _, hcache = self.draft(prog, params, arrays, state.seq, m,
                                                    state.cache.lengths)
    anc = None if self.dynamic else jnp.asarray(self.tree.ancestor)  # dynamic: from parents
    state, _, n, keep, hidden = verify.tree(prog, params, state.replace(key=key), k_acc, draft,
                                            parents, depth, self.depth, ancestor=anc,
                                            rule=self._rule(), epsilon=self.epsilon,
                                            delta=self.delta)

    c = jnp.where(active, n + 1, 0)
    feats = absorb(self.module(prog, arrays), m["feats"], hidden, keep, c)
    return state.replace(method=verify.count(dict(m, hcache=hcache, feats=feats), active, n))

  def _rule(self) -> str:
    """The acceptance rule's name for acceptance.verify_tree (a test subclass breaks it)."""
    return self.acceptance

  def stats(self, state) -> dict:
    return dict(verify.depth_stats(state.method), tree="dynamic" if self.dynamic else "static",
                tree_nodes=self.num_nodes, tree_depth=self.depth, acceptance=self.acceptance)


def absorb(mod, feats, hidden, keep, c):
  """The feature buffer after a round: the target's hidden states [B,N+1,E] at the kept block
  offsets keep [B,D+1] (the pending token, then the accepted path) are the true features
  f_L .. f_{L+n}; the first c [B] of them (fused from the taps by the head `mod`, for such heads)
  enter feats."""
  new = jnp.take_along_axis(hidden, keep[..., None], axis=1)
  return shift_in(feats, mod.fuse(new), c)


def expand_tree(logp0: jax.Array, expand, carry, depth: int, k: int, n: int):
  """EAGLE-2's dynamic tree in fixed shapes (pure: the head enters through `expand`).

  logp0 [B,V]: log-probabilities after the root. Depth 1 is its top k (best first). At each depth
  d = 1 .. depth-1 the k frontier nodes are expanded: `expand(carry, tok [B,k], parent_slot [B,k],
  d) -> (carry, logp [B,k,V])` scores their children (tok: the frontier's tokens; parent_slot:
  the frontier slot, (d - 2) * k + j, of each one's parent in the previous frontier, -1 for the
  root); each proposes its top k children, scored parent score + log p, and the best k of the k^2
  (first drafted on ties) are the next frontier. All M = k + (depth - 1) k^2 drafted nodes are
  then reranked: the best n by score (stable), reordered by depth (stable: siblings by score).
  Returns (tokens [B,n] (indices into V), parents [B,n+1] (root -1, else the parent's 1-based
  node index, 0 = the root), depth [B,n+1], scores [B,n], carry).
  """
  b = logp0.shape[0]
  ids = top_k_ids(logp0, k)  # [B,k]
  score = jnp.minimum(jnp.take_along_axis(logp0, ids, axis=1), 0.0)
  all_tok, all_score, all_parent = [ids], [score], [jnp.full((b, k), -1, jnp.int32)]
  cidx = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))  # frontier's candidate ids
  parent_slot = jnp.full((b, k), -1, jnp.int32)
  for d in range(1, depth):
    carry, logp = expand(carry, ids, parent_slot, d)
    child = top_k_ids(logp, k)  # [B,k,k]
    # log p <= 0 (clamped against rounding), so a child never outscores its parent.
    cs = score[:, :, None] + jnp.minimum(jnp.take_along_axis(logp, child, axis=2), 0.0)
    cs, child = cs.reshape(b, k * k), child.reshape(b, k * k)
    all_tok.append(child)
    all_score.append(cs)
    all_parent.append(jnp.repeat(cidx, k, axis=1))  # each child's parent's candidate id
    if d + 1 < depth:
      pick = top_k_ids(cs, k)  # [B,k] the best k children: the next frontier
      ids = jnp.take_along_axis(child, pick, axis=1)
      score = jnp.take_along_axis(cs, pick, axis=1)
      cidx = capacity(d, k) + pick
      parent_slot = (d - 1) * k + pick // k
  tok = jnp.concatenate(all_tok, axis=1)  # [B,M]
  sc = jnp.concatenate(all_score, axis=1)
  par = jnp.concatenate(all_parent, axis=1)
  dep = jnp.concatenate([jnp.full((b, x.shape[1]), i + 1, jnp.int32)
                         for i, x in enumerate(all_tok)], axis=1)
  # Stable sorts: on equal scores the earlier-drafted node (a parent before its children) first.
  best = jnp.argsort(-sc, axis=1, stable=True)[:, :n]
  best = jnp.take_along_axis(best, jnp.argsort(jnp.take_along_axis(dep, best, axis=1), axis=1,
                                               stable=True), axis=1)  # [B,N]
  pc = jnp.take_along_axis(par, best, axis=1)  # parents' candidate ids
  newpar = jnp.where(pc < 0, 0, 1 + jnp.argmax(best[:, None, :] == pc[:, :, None], axis=-1))
  parents = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), newpar.astype(jnp.int32)], axis=1)
  dnode = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.take_along_axis(dep, best, axis=1)],
                          axis=1)
  return (jnp.take_along_axis(tok, best, axis=1), parents, dnode,
          jnp.take_along_axis(sc, best, axis=1), carry)
