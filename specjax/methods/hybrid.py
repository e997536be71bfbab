"""Hybrid trees: copied and predicted candidates merged into one tree, verified in one forward.

Copying (prompt lookup, suffix decoding) drafts long, free, exact runs where the answer repeats its
context, and little elsewhere; trained heads (Medusa) draft a few likely tokens everywhere. Rather
than pick one per request, every step puts both kinds of candidates in one static-size tree:

  propose  each drafter lists its candidates as nodes with parents (`merge` module docstring):
             PromptLookup    the chain after the last n-gram's most recent earlier occurrence,
                             score (match / ngram) * DECAY^depth (a full n-gram match: 1, 0.9, ...)
             SuffixDecoding  the chains after its best occurrences in the context and its store,
                             score (match / max_match) * DECAY^depth each
             Medusa          its static tree over the heads' top-k, score each node's path
                             probability under the heads' recorded per-rank accuracies (held-out
                             top-1 / top-5, tree.per_rank_accuracy; a prior without them)
             Eagle           its tree (EAGLE-2's dynamic tree or EAGLE-1's static one) drafted on
                             the target's features, score each node's path probability under the
                             head (dynamic: exp of its cumulative log-probability; static: the
                             prior per-rank accuracies along the path)
           `merge.merge` folds nodes with the same path into one (their scores add: a copied
           token the heads also predict ranks higher), clips each score to its parent's, keeps
           the best num_nodes and masks out the slots nobody filled. With `measured=True` (the
           default) a copying drafter's scores are first scaled by how often, in this call and
           row, its first token was accepted when it offered one ((hits + 1) / (tries + 2)): where
           the text copies its context the copies go first, elsewhere the heads' confident nodes
           outrank them. With measured=False a full n-gram match scores above any heads' node,
           so copies always go first when they exist; the heads fill the rest.
  verify   the shared tree step (`verify.tree`): one target forward over [pending token, N
           nodes] under the tree mask; greedy: the longest path matching the target's argmax;
           sampling: the exact multi-draft rule (SpecInfer / EAGLE) over the whole tree; the
           accepted path is committed and emitted;
  update   the target's hidden state at the accepted node is Medusa's input for the next step;
           EAGLE's feature buffer takes the target's features along the accepted path (however
           many tokens a copy made it), and its head re-reads them in the next step's catch-up.

A hybrid holds at most one predicting drafter (Medusa or EAGLE: each reads the target's hidden
states in its own form), beside any number of copying ones.

Why sampling stays exact with both kinds of candidates: every candidate here is deterministic
given the context. The heads contribute their top-k tokens (an argmax-like choice, no draw), the
copies what followed an earlier occurrence; the tree is fixed before the acceptance coins are
drawn, and the multi-draft rule emits each token with the target's probability p(x) at every node
whatever the candidates are (a rejected child's mass is removed from the residual, the next child
is tried against what is left). A copied chain alone is the case q = one-hot of prompt lookup's
chain rule. A drafter that *sampled* its candidates would need the rule with its q instead: none
of the accepted drafters does.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from specjax import tree as trees
from specjax.decode import DRAFT, DecodeState, Method, Program, phase
from specjax.errors import InputError, check_int
from specjax.methods import merge, sizing, verify
from specjax.methods.eagle import Eagle, absorb
from specjax.methods.medusa import Medusa
from specjax.methods.prompt_lookup import PromptLookup, ngram_search
from specjax.methods.suffix import DECAY, RULES, SuffixDecoding

DRAFTERS = (PromptLookup, SuffixDecoding, Medusa, Eagle)
PREDICTORS = (Medusa, Eagle)  # drafters that read the target's hidden states


def _size(d) -> int:
  """Candidates a drafter lists per step."""
  if isinstance(d, PromptLookup):
    return d.num_tokens
  if isinstance(d, SuffixDecoding):
    return d.occurrences * d.max_depth
  if isinstance(d, Eagle):
    return d.num_nodes
  return d.tree.num_nodes


def _budget(d) -> int:
  """Nodes a drafter would verify on its own (the default num_nodes adds these up)."""
  return d.num_nodes if isinstance(d, SuffixDecoding) else _size(d)


def _depth(d) -> int:
  if isinstance(d, PromptLookup):
    return d.num_tokens
  if isinstance(d, SuffixDecoding):
    return d.max_depth
  if isinstance(d, Eagle):
    return d.depth
  return d.tree.max_depth


def path_probability(d: Medusa | Eagle) -> np.ndarray:
  """[Nm] each static tree node's probability of being right: the product along its path of the
  per-rank accuracies at each depth (Medusa: its heads' recorded ones, a prior where none are
  recorded; EAGLE-1: the prior; 0 past the known ranks)."""
  if isinstance(d, Eagle):
    acc = trees.prior_accuracies(d.depth)
  else:
    k = d.heads.config.num_heads
    acc = trees.per_rank_accuracy(d.heads.meta or {}, k)
    if acc is None:
      acc = trees.prior_accuracies(k)
  return np.array([np.prod([acc[i, r] if r < acc.shape[1] else 0.0 for i, r in enumerate(p)])
                   for p in d.tree.paths], np.float32)


@dataclasses.dataclass(frozen=True)
class Hybrid(verify.TreeSizes, Method):
  """One candidate tree per step from several drafters (module docstring).

  drafters: a list of PromptLookup and SuffixDecoding objects and at most one Medusa or Eagle
  (their own acceptance settings are not used: the hybrid tree has one); num_nodes: the tree
  verified per step (N; left out: the predicting drafter's budget once `prepare` has sized it
  from the cost curve, else the nodes the drafters would verify alone, added up);
  acceptance: "exact" | "greedy"; measured: scale the copying drafters' scores by their measured
  first-token acceptance (module docstring).
  """
  drafters: tuple = ()
  num_nodes: int | None = None
  acceptance: str = "exact"
  measured: bool = True
  left_out: tuple = dataclasses.field(default=(), init=False, compare=False, repr=False)

  name = "hybrid"
  lossless = True

  def __post_init__(self):
    ds = self.drafters
    if isinstance(ds, DRAFTERS) or not isinstance(ds, (list, tuple)):
      raise InputError(f"drafters={ds!r} is invalid: give a list of drafters, e.g. "
                       f"[sj.PromptLookup(), sj.Medusa(heads)]")
    if not ds:
      raise InputError("drafters=[] is empty: give at least one drafter, e.g. "
                       "[sj.PromptLookup(), sj.Medusa(heads)]")
    for i, d in enumerate(ds):
      if not isinstance(d, DRAFTERS):
        raise InputError(f"drafters[{i}]={d!r} cannot feed a hybrid tree: each drafter must be "
                         f"one of {', '.join(c.__name__ for c in DRAFTERS)}")
    predictors = [type(d).__name__ for d in ds if isinstance(d, PREDICTORS)]
    if len(predictors) > 1:
      raise InputError(f"drafters hold {len(predictors)} predicting drafters "
                       f"({', '.join(predictors)}): a hybrid tree takes at most one Medusa or "
                       f"Eagle beside its copying drafters (PromptLookup, SuffixDecoding)")
    object.__setattr__(self, "drafters", tuple(ds))
    if self.acceptance not in RULES:
      raise InputError(f"acceptance={self.acceptance!r} is invalid: must be one of "
                       f"{', '.join(RULES)}")
    if not isinstance(self.measured, (bool, np.bool_)):
      raise InputError(f"measured={self.measured!r} is invalid: must be True or False")
    total = sum(_size(d) for d in ds)
    sizing.left_out(self, {"num_nodes": min(total, sum(_budget(d) for d in ds))})
    check_int("num_nodes", self.num_nodes, 1, total,
              f" (the drafters list {total} candidates per step)")

  @classmethod
  def default(cls, target, heads=None, drafters=None, **options) -> "Hybrid":
    """The registry's hybrid for `target`: drafters as given; else prompt lookup beside EAGLE or
    Medusa `heads` (a Heads object, or a name / file to load), whose tree and the node budget N
    come from the device's cost curve as the method's own default does (methods/defaults.py; the
    copied chain may take up to N of them); without heads, prompt lookup beside suffix
    decoding."""
    if drafters is None and heads is None:
      drafters = [PromptLookup(), SuffixDecoding()]
    elif drafters is None:
      from specjax.heads import load_heads

      if isinstance(heads, (str, os.PathLike)):
        heads = load_heads(heads, target)
      kind = Eagle if heads.config.kind in ("eagle", "eagle3") else Medusa
      drafters = [PromptLookup(), kind(heads)]
    return cls(drafters, **options).prepare(target)

  def prepare(self, target) -> "Hybrid":
    """The sizes left out, as the registry's hybrid chooses them: the predicting drafter's own
    (its `prepare`: the cost curve and its heads' held-out numbers), a copied chain of up to
    min(10, N) tokens with N the predictor's budget, and num_nodes N where the predictor's
    sizes were left out too (given, its whole tree and the copies are kept: the class's rule).
    Copies alone keep their class sizes."""
    pred = next((d for d in self.drafters if isinstance(d, PREDICTORS)), None)
    if pred is None:
      return self
    sized = pred.prepare(target)
    n = _budget(sized)
    drafters = tuple(
        sized if d is pred else dataclasses.replace(d, num_tokens=min(10, n))
        if isinstance(d, PromptLookup) and d.left_out else d for d in self.drafters)
    nodes = self.num_nodes
    if "num_nodes" in self.left_out:
      nodes = n if sizing.open_sizes(pred, pred.name) else None
    if all(a is b for a, b in zip(drafters, self.drafters)) and nodes in (None, self.num_nodes):
      return self
    return dataclasses.replace(self, drafters=drafters, num_nodes=nodes)

  @property
  def max_depth(self) -> int:
    return max(_depth(d) for d in self.drafters)

  @property
  def _heads(self) -> bool:
    return any(isinstance(d, PREDICTORS) for d in self.drafters)

  @property
  def _eagle(self) -> int | None:
    """The index of the EAGLE drafter, if any."""
    return next((i for i, d in enumerate(self.drafters) if isinstance(d, Eagle)), None)

  @property
  def taps(self) -> tuple:
    """The target layers an EAGLE drafter with fused features reads (decode.Method.taps)."""
    i = self._eagle
    return () if i is None else self.drafters[i].taps

  @property
  def raw_taps(self) -> bool:
    i = self._eagle
    return i is not None and self.drafters[i].raw_taps

  def validate(self, model) -> None:
    for d in self.drafters:
      d.validate(model)

  def arrays(self, model):
    return tuple(d.arrays(model) for d in self.drafters)

  def init(self, prog, arrays, state, hidden):
    b = state.seq.shape[0]
    zd = jnp.zeros((b, len(self.drafters)), jnp.int32)
    # (tries / hits: rounds a drafter offered a first token / had it accepted)
    out = dict(verify.depth_counts(b, self.max_depth), by=zd, tries=zd, hits=zd)
    if any(isinstance(d, Medusa) for d in self.drafters):  # it reads the last hidden state
      out["hidden"] = jnp.take_along_axis(hidden, (state.prompt_len - 1)[:, None, None],
                                          axis=1)[:, 0]
    i = self._eagle
    if i is not None:  # its head cache and feature buffer, for rounds of up to max_emit tokens
      out["eagle"] = self.drafters[i].head_state(prog, arrays[i], state, hidden, self.max_emit)
    return out

  def candidates(self, d, prog, params, arrays, state: DecodeState):
    """One drafter's candidates: (tokens [B,M], parents [M] or [B,M], valid [B,M], score [B,M],
    the drafter's new state (EAGLE's head cache) or None)."""
    if isinstance(d, SuffixDecoding):
      return (*d.candidates(arrays, state), None)
    if isinstance(d, PromptLookup):
      draft, n_draft, match = ngram_search(state.seq, state.seq_len, d.ngram, d.num_tokens)
      j = jnp.arange(d.num_tokens)
      score = (match[:, None] / d.ngram) * DECAY ** j[None, :]
      return (jnp.maximum(draft, 0), j - 1, j[None, :] < n_draft[:, None],
              score.astype(jnp.float32), None)
    if isinstance(d, Eagle):
      tok, parents, _, logp, hcache = d.draft(prog, params, arrays, state.seq,
                                              state.method["eagle"], state.cache.lengths)
      score = jnp.broadcast_to(jnp.asarray(path_probability(d)), tok.shape) if logp is None \
          else jnp.exp(logp)
      par = jnp.broadcast_to(parents[..., 1:] - 1, tok.shape)  # (node 0, the root: -1)
      return tok, par, jnp.ones(tok.shape, bool), score, hcache
    t = d.tree
    cands = d.propose(prog, params, arrays, state.method["hidden"])  # [B,K,R]
    tok = t.take(cands)  # [B,Nm]
    score = jnp.broadcast_to(jnp.asarray(path_probability(d)), tok.shape)
    return tok, jnp.asarray(t.parent[1:] - 1), jnp.ones(tok.shape, bool), score, None

  def propose(self, prog, params, arrays, state: DecodeState):
    """Every drafter's candidates, merged: ((draft [B,N], parents [B,N+1], depth [B,N+1],
    filled [B,N], tags [B,N] which drafters proposed each node (bit i: drafters[i])), EAGLE's
    head cache after drafting or None, offered [B,drafters]: which drafters proposed anything)."""
    parts = [self.candidates(d, prog, params, a, state) for d, a in zip(self.drafters, arrays)]
    off = 0
    tok, par, valid, score, tags = [], [], [], [], []
    hcache = next((p[4] for p in parts if p[4] is not None), None)
    m = state.method
    rate = (m["hits"] + 1.0) / (m["tries"] + 2.0)  # [B,drafters]
    for i, (t, p, v, s, _) in enumerate(parts):
      p = jnp.broadcast_to(p, t.shape)
      if self.measured and not isinstance(self.drafters[i], PREDICTORS):
        s = s * rate[:, i:i + 1]
      tok.append(t.astype(jnp.int32))
      par.append(jnp.where(p >= 0, p + off, -1))
      valid.append(v)
      score.append(s.astype(jnp.float32))
      tags.append(jnp.full(t.shape, 1 << i, jnp.int32))
      off += t.shape[1]
    cat = lambda xs: jnp.concatenate(xs, axis=1)  # noqa: E731
    offered = jnp.stack([jnp.any(v, axis=1) for v in valid], axis=1)  # [B,drafters]
    return merge.merge(cat(tok), cat(par), cat(valid), cat(score), self.num_nodes,
                       self.max_depth, cat(tags), len(self.drafters)), hcache, offered

  def step(self, prog: Program, params, arrays, state: DecodeState) -> DecodeState:
    b = state.seq.shape[0]
    m = state.method
    active = ~state.done
    key, sub = jax.random.split(state.key)
    with phase(DRAFT):
      (draft, parents, depth, filled, tags), hcache, offered = self.propose(prog, params,
                                                                            arrays, state)
    skip = None if self._heads else ~jnp.any(filled, axis=1)
    state, best, n, keep, hidden = verify.tree(prog, params, state, sub, draft, parents, depth,
                                               self.max_depth, rule=self.acceptance,
                                               skip_empty=skip)
    a = active.astype(jnp.int32)
    on_path = jnp.arange(1, keep.shape[1])[None, :] <= n[:, None]  # [B,D]
    path_tags = jnp.take_along_axis(jnp.concatenate([jnp.zeros((b, 1), jnp.int32), tags], axis=1),
                                    keep[:, 1:], axis=1)
    bits = (path_tags[:, :, None] >> jnp.arange(len(self.drafters))[None, None, :]) & 1
    tried = a[:, None] * offered  # [B,drafters]
    hit = tried * bits[:, 0, :] * (n >= 1)[:, None]  # the first accepted node was its proposal
    by = m["by"] + a[:, None] * jnp.sum(bits * on_path[:, :, None], axis=1)
    upd = verify.count(dict(m, by=by, tries=m["tries"] + tried, hits=m["hits"] + hit), active, n)
    if "hidden" in m:  # Medusa
      h = jnp.take_along_axis(hidden, best[:, None, None], axis=1)[:, 0]
      upd["hidden"] = jnp.where(active[:, None], h, m["hidden"])
    i = self._eagle
    if i is not None:  # the target's features along the accepted path enter EAGLE's buffer
      c = jnp.where(active, n + 1, 0)
      mod = self.drafters[i].module(prog, arrays[i])
      upd["eagle"] = dict(hcache=hcache, feats=absorb(mod, m["eagle"]["feats"], hidden, keep, c))
    return state.replace(key=key, method=upd)

  def stats(self, state) -> dict:
    m = state.method
    rounds = int(np.asarray(m["rounds"]).sum())
    accepted = int(np.asarray(m["accepted"]).sum())
    by = np.asarray(m["by"]).sum(0)
    tries, hits = np.asarray(m["tries"]).sum(0), np.asarray(m["hits"]).sum(0)
    for d in self.drafters:  # a suffix drafter's store learns this call's outputs
      if isinstance(d, SuffixDecoding):
        d.learn(state)
    return {
        "tree_nodes": self.num_nodes,
        "draft_rounds": rounds,
        "accepted_tokens": accepted,
        "accepted_per_step": accepted / max(1, rounds),
        "accepted_depth_hist": np.asarray(m["depth_hist"]).sum(0).tolist(),
        # accepted tokens each drafter had proposed (a token both proposed counts for both)
        "accepted_by": {f"{i}:{d.name}": int(by[i]) for i, d in enumerate(self.drafters)},
        # per drafter: how often its first token was accepted when it offered one
        "first_token_acceptance": {f"{i}:{d.name}": float(hits[i] / tries[i]) if tries[i] else None
                                   for i, d in enumerate(self.drafters)},
    }

