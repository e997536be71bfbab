"""Draft-model speculative decoding (Leviathan et al. 2023) and layer-skip self-speculation.

One step, all rows at once, all shapes static:

  propose   the draft extends each row by up to gamma tokens, one forward per token, inside a
            lax.while_loop that stops once every row has drafted its own budget g[b] <= gamma
            (adaptive gamma, or a row whose draft confidence fell under `threshold`);
  verify    the target scores [x0, d_1 .. d_gamma] (x0 = the pending token) in one call;
  accept    greedy or exact rejection sampling (acceptance.py); positions past g[b] carry q = 0,
            so they are rejected and the next token is drawn from p itself (the chain is shorter);
  update    the target cache keeps x0, d_1 .. d_n; the draft cache is re-synchronised lazily: the
            next round's first draft forward re-feeds the last two committed tokens, which covers
            the case where all gamma drafts were accepted and the draft never saw d_gamma.

Two drafters share this step:

  DraftModel(draft, gamma)          a separate small model with its own static KV cache; it may
                                    propose over a vocabulary subset (FR-Spec style: q is zero
                                    outside it, verification uses the target's full p, still exact)
  SelfSpeculative(exit_layer=k)     the target's first k layers + final norm + LM head, writing
                                    straight into the target's own cache (verification rewrites
                                    those slots with the full forward, so nothing is kept apart)

Statistics (`stats`): drafted and accepted tokens, alpha (the per-token acceptance rate, estimated
as accepted / (accepted + rejections)), and `leviathan_speedup(alpha, gamma, c)` for a measured c.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import acceptance
from specjax import cache as kv
from specjax import sampling
from specjax.calibrate import measure_cost_ratio  # noqa: F401 (the timing lives there; old name)
from specjax.decode import DRAFT, DecodeState, Method, Program, phase
from specjax.errors import InputError, check_int
from specjax.methods import sizing, verify
from specjax.methods.features import check_vocab, over_vocab
from specjax.model import subset_logits
from specjax.packing import subset_head


def leviathan_speedup(alpha: float, gamma: float, c: float, verify: float = 1.0) -> float:
  """Expected walltime improvement (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + verify)).

  Leviathan et al. take verification to cost one target step (verify = 1), which holds where
  the target is bandwidth-bound at gamma + 1 tokens; pass the measured c(gamma + 1) where it is
  not (a CPU: docs/performance.md)."""
  alpha = min(max(float(alpha), 0.0), 1.0)
  tau = gamma + 1.0 if alpha >= 1.0 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
  return tau / (gamma * c + verify)


class _Speculative(verify.ChainSizes, Method):
  """The step of a drafter that samples a chain: propose here (with the draft's distributions q),
  then the shared chain step (`verify.chain`) with the exact rule over q. Subclasses (frozen
  dataclasses) supply the drafter and these static options:

    gamma       the static maximum (and starting) number of drafted tokens per step
    adaptive    per row: grow g by one after a fully accepted round, shrink it after a rejection
    min_gamma   the adaptive lower bound
    threshold   stop a row's drafting when its draft's max probability (temperature 1) falls
                under this (after at least one token); 0 = off
  """

  name = "speculative"
  lossless = True
  refeed = 1  # tokens the first draft forward of a round feeds (2: re-sync a separate cache)

  def __post_init__(self):
    check_int("gamma", self.gamma, 1, 64)
    check_int("min_gamma", self.min_gamma, 1, self.gamma, f" (<= gamma={self.gamma})")
    if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or not (
        0.0 <= self.threshold < 1.0):
      raise InputError(f"threshold={self.threshold!r} is invalid: must be a number in [0, 1)")

  @property
  def variable_width(self) -> bool:
    """Whether rounds can draft fewer than gamma tokens (then verification width follows)."""
    return (self.adaptive or self.threshold > 0) and self.gamma > 1

  # --- drafter hooks -------------------------------------------------------------------------

  def _draft_cache(self, state: DecodeState) -> kv.KVCache:
    raise NotImplementedError

  def _with_draft_cache(self, state: DecodeState, dcache: kv.KVCache) -> DecodeState:
    raise NotImplementedError

  def timing_cache(self, target, batch: int, cache_len: int) -> kv.KVCache:
    """An empty cache of the kind `_draft_forward` reads (calibrate.measure_cost_ratio times one
    draft step over it): the target's own (a self-draft's layers run on it)."""
    return target.init_cache(batch, cache_len)

  def _draft_forward(self, prog, params, arrays, dcache, tokens, start):
    """tokens [B,T] at positions start[b] + [0, T) -> (draft logits [B,Vs] after the last, dcache)."""
    raise NotImplementedError

  # --- the step ------------------------------------------------------------------------------

  def _init_stats(self, b):
    z = jnp.zeros((b,), jnp.int32)
    return {"g": jnp.full((b,), self.gamma, jnp.int32), "drafted": z, "accepted": z,
            "rejected": z, "rounds": z, "verified": z}

  def step(self, prog: Program, params, arrays, state: DecodeState) -> DecodeState:
    m = state.method  # (before proposing: a separate draft's new cache goes into a copy)
    active = ~state.done
    key, k_draft, k_acc = jax.random.split(state.key, 3)
    with phase(DRAFT):
      state, toks, q_sub, g = self._propose(prog, params, arrays, state, k_draft)
    # Drafting may have written the target's own cache: it holds all but the pending token again.
    state = state.replace(key=key, cache=kv.rollback(state.cache, state.seq_len - 1))
    # A round that can stop early verifies only as wide as its longest draft (one compiled
    # forward per width; positions past g[b] hold token 0 and q = 0, so they are rejected).
    widest = jnp.clip(jnp.max(jnp.where(active, g, 0)), 1, self.gamma) \
        if self.variable_width else None

    def rule(key, draft, logits, sp):
      n, nxt = self._accept_drafts(key, sp, draft, q_sub, logits, arrays.get("vocab"))
      return jnp.minimum(n, g), nxt

    state, n, _ = verify.chain(prog, params, state, k_acc, toks, rule=rule, width=widest)
    return self._count(state, m, active, g, n, self.gamma if widest is None else widest)

  def _propose(self, prog, params, arrays, state: DecodeState, key):
    """propose: each row drafts up to its budget (gamma, or its adaptive g) one token per draft
    forward, stopping early under `threshold`. Returns (state holding the advanced draft cache,
    toks [B,G] int32 (-1 past g), q [B,G,Vs] the draft's probabilities (0 past g), g [B])."""
    b = state.seq.shape[0]
    gmax = self.gamma
    ids = arrays.get("vocab")  # [Vs] int32 token ids the draft proposes over, or None (all V)
    budget = jnp.where(self.adaptive, state.method["g"], gmax)  # [B] tokens each row may draft

    def draw(i, logits, carry):
      """Samples d_{i+1} from the draft logits [B,Vs] into the carry."""
      toks, q, drafting, g = carry
      sub_q = sampling.probs(logits, state.sp)  # [B,Vs] (one-hot for greedy rows)
      idx = sampling.sample_probs(jax.random.fold_in(key, i), sub_q)  # [B]
      tok = idx if ids is None else ids[idx]
      if self.threshold > 0:
        conf = jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1)
        drafting = drafting & ((i == 0) | (conf >= self.threshold))
      drafting = drafting & (i < budget)
      toks = toks.at[:, i].set(jnp.where(drafting, tok, -1))
      q = q.at[:, i].set(jnp.where(drafting[:, None], sub_q, 0.0))
      return toks, q, drafting, g + drafting.astype(jnp.int32)

    seq_len = state.seq_len
    dcache = self._draft_cache(state)
    r = self.refeed
    first = jnp.take_along_axis(state.seq, seq_len[:, None] - r + jnp.arange(r)[None, :], axis=1)
    logits, dcache = self._draft_forward(prog, params, arrays, dcache, first, seq_len - r)
    vs = logits.shape[-1]
    carry = (jnp.full((b, gmax), -1, jnp.int32), jnp.zeros((b, gmax, vs), jnp.float32), ~state.done,
             jnp.zeros((b,), jnp.int32))
    carry = draw(0, logits, carry)

    def cond(c):
      i, _, (_, _, drafting, _) = c
      return (i < gmax) & jnp.any(drafting)

    def body(c):
      i, dcache, carry = c
      prev = carry[0][:, i - 1]
      logits, dcache = self._draft_forward(prog, params, arrays, dcache,
                                           jnp.maximum(prev, 0)[:, None], seq_len - 1 + i)
      return i + 1, dcache, draw(i, logits, carry)

    _, dcache, (toks, q_sub, _, g) = jax.lax.while_loop(cond, body, (jnp.int32(1), dcache, carry))
    return self._with_draft_cache(state, dcache), toks, q_sub, g

  def _accept_drafts(self, key, sp, toks, q_sub, tlogits, ids):
    """The chain rule: (n [B] drafts accepted, nxt [B] the target's token after them); greedy token
    matching when every row is greedy, else `_accept` with the draft's q over the whole
    vocabulary (zero outside a subset `ids`)."""
    return jax.lax.cond(
        jnp.all(sp.temperature == 0),
        lambda: acceptance.greedy_chain(toks, tlogits),
        lambda: self._accept(key, toks, over_vocab(q_sub, ids, tlogits.shape[-1]), tlogits, sp))

  def _count(self, state: DecodeState, m, active, g, n, widest) -> DecodeState:
    """update, the statistics and the adaptive budget: g grows by one after a fully accepted
    round and shrinks by one after a rejection, within [min_gamma, gamma]."""
    full = n >= g
    rejected = active & ~full
    grown = jnp.where(full, m["g"] + 1, m["g"] - 1)
    a = active.astype(jnp.int32)
    upd = dict(g=jnp.where(active, jnp.clip(grown, self.min_gamma, self.gamma), m["g"]),
               drafted=m["drafted"] + a * g, accepted=m["accepted"] + a * n,
               rejected=m["rejected"] + rejected.astype(jnp.int32), rounds=m["rounds"] + a,
               verified=m["verified"] + a * (widest + 1))
    return state.replace(method=dict(state.method, **upd))  # (state.method has the new cache)

  def _accept(self, key, draft, q, target_logits, sp):
    """The acceptance rule (exact rejection sampling; a test subclass breaks it on purpose)."""
    return acceptance.rejection_chain(key, draft, q, target_logits, sp)

  def stats(self, state) -> dict:
    m = state.method
    drafted, accepted = int(np.sum(m["drafted"])), int(np.sum(m["accepted"]))
    rejected, rounds = int(np.sum(m["rejected"])), int(np.sum(m["rounds"]))
    verified = int(np.sum(m["verified"]))
    alpha = accepted / max(1, accepted + rejected)
    return {
        "gamma": self.gamma,
        "adaptive": self.adaptive,
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "draft_rounds": rounds,
        "accepted_per_step": accepted / max(1, rounds),
        "drafted_per_step": drafted / max(1, rounds),
        "verified_per_step": verified / max(1, rounds),  # positions the target scored per call
        "alpha": alpha,
    }


def check_same_tokenizer(target_tok, draft_tok, samples: int = 64) -> None:
  """InputError unless the two tokenizers agree: the same size and the same strings for a spread
  sample of token ids (a draft from another family can share a vocabulary size by chance)."""
  if len(target_tok) != len(draft_tok):
    raise InputError(f"draft tokenizer ({len(draft_tok)} tokens) differs from the target's "
                     f"({len(target_tok)} tokens): a draft must share the target's tokenizer")
  ids = sorted({int(i) for i in np.linspace(0, len(target_tok) - 1, samples)})
  a = target_tok.convert_ids_to_tokens(ids)
  b = draft_tok.convert_ids_to_tokens(ids)
  for i, x, y in zip(ids, a, b):
    if x != y:
      raise InputError(f"draft tokenizer differs from the target's: token {i} is {y!r} for the "
                       f"draft and {x!r} for the target (same size, other vocabulary): a draft "
                       f"must share the target's tokenizer")


@dataclasses.dataclass(frozen=True)
class DraftModel(_Speculative):
  """A separate draft model (same tokenizer) with its own static KV cache.

  vocab: token ids [Vs] the draft proposes over (default: the draft model's `vocab_subset`
  attribute if it has one, e.g. the shipped "smollm2-135m-draft", else the whole vocabulary).
  The draft's logits over the subset are its final-normed hidden state times the matching rows of
  its (tied or untied) LM head, so the full [E,V] head is never multiplied.
  """
  draft: Any = dataclasses.field(default=None, compare=False, repr=False)
  gamma: int | None = None  # None: from the cost curve (methods/sizing.py), else 5
  adaptive: bool = False
  min_gamma: int = 1
  threshold: float = 0.0
  vocab: Any = dataclasses.field(default=None, compare=False, repr=False)
  key: tuple = dataclasses.field(default=(), init=False, repr=False)
  left_out: tuple = dataclasses.field(default=(), init=False, compare=False, repr=False)

  name = "draft"
  refeed = 2
  extra_room = 0  # draft cache slots past the sequence's (a parallel draft's window needs gamma)

  def __post_init__(self):
    sizing.left_out(self, {"gamma": 5})
    super().__post_init__()
    from specjax.model import Model

    if not isinstance(self.draft, Model):
      raise InputError(f"draft={self.draft!r} is invalid: must be a specjax Model "
                       f"(e.g. sj.load_model('smollm2-135m-draft'))")
    vocab = self.vocab if self.vocab is not None else getattr(self.draft, "vocab_subset", None)
    vocab = check_vocab(vocab, self.draft.config.vocab_size)
    object.__setattr__(self, "vocab", vocab)
    c = self.draft.config
    object.__setattr__(self, "key", (self.draft.graphdef, c, None if vocab is None else vocab.size,
                                     str(self.draft.dtype)))

  def prepare(self, model) -> "DraftModel":
    """gamma, if left out, from the cost curve and the draft's held-out agreement (sizing)."""
    return sizing.prepare(self, "draft", model, self.draft)

  def validate(self, model) -> None:
    t, d = model.config, self.draft.config
    if t.vocab_size != d.vocab_size:
      raise InputError(f"draft vocabulary size {d.vocab_size} differs from the target's "
                       f"{t.vocab_size}: a draft must share the target's tokenizer")
    if model.tokenizer is not None and self.draft.tokenizer is not None:
      check_same_tokenizer(model.tokenizer, self.draft.tokenizer)

  def arrays(self, model):
    out = {"draft": self.draft.params}
    if self.vocab is not None:
      out.update(subset_head(self.draft, self.vocab))  # vocab [Vs], head [Vs,E]
    return out

  def init(self, prog, arrays, state, hidden):
    """Prefills the draft on the prompt; it keeps prompt[:-1] (the next round re-feeds 2)."""
    from flax import nnx

    d = self.draft.config
    b, s = state.seq.shape
    s += self.extra_room
    dcache = kv.init(d.num_layers, b, s, d.num_kv_heads, d.head_dim, self.draft.dtype)
    p = hidden.shape[1]
    prompt = state.seq[:, :p]
    mask = kv.causal_mask(dcache.lengths, p, s, d.sliding_window) & (
        jnp.arange(s) < state.prompt_len[:, None])[:, None, :]
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    model = nnx.merge(self.draft.graphdef, arrays["draft"])
    _, _, dcache = model(prompt, positions, dcache, mask, logits_at=jnp.zeros((b, 1), jnp.int32))
    dcache = kv.rollback(dcache, state.prompt_len - 1)
    return dict(self._init_stats(b), cache=dcache)

  def timing_cache(self, target, batch: int, cache_len: int) -> kv.KVCache:
    d = self.draft.config
    return kv.init(d.num_layers, batch, cache_len + self.extra_room, d.num_kv_heads, d.head_dim,
                   self.draft.dtype)

  def _draft_cache(self, state):
    return state.method["cache"]

  def _with_draft_cache(self, state, dcache):
    return state.replace(method=dict(state.method, cache=dcache))

  def _draft_forward(self, prog, params, arrays, dcache, tokens, start):
    from flax import nnx

    d = self.draft.config
    b, t = tokens.shape
    dcache = kv.rollback(dcache, start)
    mask = kv.causal_mask(start, t, dcache.max_len, d.sliding_window)
    pos = start[:, None] + jnp.arange(t)[None, :]
    model = nnx.merge(self.draft.graphdef, arrays["draft"])
    logits, hidden, dcache = model(tokens, pos, dcache, mask,
                                   logits_at=jnp.full((b, 1), t - 1, jnp.int32))
    if "head" in arrays:  # the full-vocabulary logits above are dead code and compiled away
      return subset_logits(hidden[:, -1], arrays), dcache
    return logits[:, 0], dcache


@dataclasses.dataclass(frozen=True)
class SelfSpeculative(_Speculative):
  """Layer-skip drafting: the target's first `exit_layer` layers + final norm + LM head.

  No second model and no extra cache: drafting writes layers [0, exit_layer) of the target's own
  cache at the slots the verification forward then rewrites with the full model.
  vocab: token ids [Vs] to propose over (FR-Spec style, as in DraftModel; e.g. the shipped draft's
  `vocab_subset`): the exit head then multiplies Vs rows of the LM head instead of all V.
  """
  exit_layer: int = 0
  gamma: int | None = None  # None: from the cost curve (methods/sizing.py), else 5
  adaptive: bool = False
  min_gamma: int = 1
  threshold: float = 0.0
  vocab: Any = dataclasses.field(default=None, compare=False, repr=False)
  left_out: tuple = dataclasses.field(default=(), init=False, compare=False, repr=False)

  name = "layer-skip"

  def __post_init__(self):
    sizing.left_out(self, {"gamma": 5})
    super().__post_init__()
    check_int("exit_layer", self.exit_layer, 1)
    object.__setattr__(self, "vocab", check_vocab(self.vocab))

  def prepare(self, model) -> "SelfSpeculative":
    """gamma, if left out, from the cost curve and the untrained exit's prior (sizing)."""
    return sizing.prepare(self, "layer-skip", model, self.exit_layer)

  def validate(self, model) -> None:
    n = model.config.num_layers
    if not 1 <= self.exit_layer <= n - 1:
      raise InputError(f"exit_layer={self.exit_layer} is invalid for a {n}-layer target: "
                       f"must be in [1, {n - 1}]")
    if self.vocab is not None:
      check_vocab(self.vocab, model.config.vocab_size)

  def arrays(self, model):
    return {} if self.vocab is None else subset_head(model, self.vocab)

  def init(self, prog, arrays, state, hidden):
    return self._init_stats(state.seq.shape[0])

  def _draft_cache(self, state):
    return state.cache

  def _with_draft_cache(self, state, dcache):
    return state.replace(cache=dcache)

  def _draft_forward(self, prog, params, arrays, dcache, tokens, start):
    b, t = tokens.shape
    dcache = kv.rollback(dcache, start)
    pos = start[:, None] + jnp.arange(t)[None, :]
    logits, hidden, dcache = prog.forward(params, tokens, pos, dcache, prog.causal_mask(start, t),
                                          num_layers=self.exit_layer,
                                          logits_at=jnp.full((b, 1), t - 1, jnp.int32))
    if "head" in arrays:  # as in DraftModel: the full-vocabulary logits are compiled away
      return subset_logits(hidden[:, -1], arrays), dcache
    return logits[:, 0], dcache
