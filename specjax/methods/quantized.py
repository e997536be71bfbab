"""Quantized self-drafting (QSpec, ML-SpecQD style): the target drafts for itself in cheaper arithmetic.

The draft is the target network itself with every dense product (each layer's QKV, output and MLP
projections, and the LM head; tied heads from the embedding transposed) in low precision: weights
cast once per model to 4-bit (Q4_1) or 8-bit (Q8_0) blocks of 32, activations quantized per row to
int8 blocks on every call (specjax/kernels/quant.py; on a CPU with the integer-dot kernel, 4-bit
products of up to 64 rows run there). The embedding lookup, norms, RoPE and attention stay in the
target's float arithmetic. Verification is the unchanged target, so the method is exact: greedy
output is identical to autoregressive decoding and sampling follows the target's distribution
(the shared chain step, methods/draft.py's `_Speculative`).

How the draft runs the target's forward: a copy of the target's module (merged at trace time)
whose `packed_<weight>` variables hold the quantized weights; `kernels.dense` multiplies by a
quantized weight when it is given one (model._packed reads it), so model.py has no second path.

  cache="shared"  the draft writes its approximate K/V into the target's own cache at the slots
                  verification then rewrites (as layer-skip does): drafts attend to the target's
                  exact K/V of every committed token. No extra memory, no extra prefill.
  cache="own"     a separate cache the draft prefills on the prompt and keeps (as a draft model
                  does, re-feeding two tokens a round): the draft sees only its own K/V.

Multi-level (ML-SpecQD's idea): with `lookup=k` the quantized draft is itself drafted by prompt
lookup. Each draft forward scores [the last drafted token, k tokens copied from the text so far
(prompt, output and the drafts of this round)] and keeps the longest prefix the quantized model
agrees with, plus its own next token (the shared chain rule, exact at temperature > 0: the copied
tokens are a deterministic proposal, so every drafted token is distributed as the quantized
model's own q, which the target's verification then reads). Where the text repeats itself a
forward yields several drafts; where it does not, the forward runs one token as before.

Statistics: those of every chain method, plus per draft position i: `acceptance_by_position`
(how often d_i was accepted when d_1..d_{i-1} were and d_i was drafted: the position's alpha)
and `accepted_by_position` (rounds in which d_i was accepted, over all rounds); their counts
summed over rows are `reached_at` and `accepted_at`.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax

from specjax import acceptance, sampling
from specjax import cache as kv
from specjax import packing
from specjax.decode import DecodeState
from specjax.errors import InputError, check_int
from specjax.kernels import quant
from specjax.methods import sizing
from specjax.methods.draft import _Speculative
from specjax.methods.features import check_vocab
from specjax.methods.prompt_lookup import ngram_search
from specjax.model import forward_sequence, head_rows

CACHES = ("shared", "own")


class Quantized(nnx.Variable):
  """A quantized copy of a dense weight (kernels/quant.QWeight) in a draft's module; never saved."""


_CAST: dict = {}  # (id(model.params), bits) -> (weakref to params, weights): cast once per model


def quantized_weights(model, bits: int) -> tuple:
  """Every dense weight of `model` as a QWeight [K, N], in `packing.dense_sites` order (each layer's
  LAYER_SITES, then the head), cast once per model and bit width."""
  key = (id(model.params), bits)
  hit = _CAST.get(key)
  if hit is not None and hit[0]() is model.params:
    return hit[1]
  module = model.module()
  out = tuple(quant.quantize_weight(w.T if transposed else w, bits)
              for _, _, w, transposed in packing.dense_sites(module))
  try:
    ref = weakref.ref(model.params, lambda _r: _CAST.pop(key, None))
  except TypeError:  # params that cannot be weakly referenced: cast every time
    return out
  _CAST[key] = (ref, out)
  return out


def draft_module(graphdef, params, weights: tuple):
  """The target's module (graphdef, params) with every dense product through `weights`
  (quantized_weights' order): the draft. Called inside jit; costs nothing at run time."""
  module = nnx.merge(graphdef, params)
  sites = list(packing.dense_sites(module))
  if len(sites) != len(weights):
    raise ValueError(f"{len(weights)} quantized weights for a model of {len(sites)} dense products")
  for (owner, name, _, _), qw in zip(sites, weights):
    setattr(owner, name, Quantized(qw))
  return module


@dataclasses.dataclass(frozen=True)
class QuantizedDraft(_Speculative):
  """The target drafts gamma tokens for itself with 4- or 8-bit weights and int8 activations.

  bits    4 (Q4_1 blocks) or 8 (Q8_0 blocks)
  cache   "shared" (the target's cache) or "own" (a separate draft cache); see the module docstring
  lookup  k > 0: multi-level, the quantized draft is drafted by prompt lookup (k copied tokens per
          draft forward, suffixes of up to `ngram` tokens); 0: one token per draft forward
  vocab   token ids [Vs] the draft proposes over (FR-Spec style, as DraftModel's `vocab`): its
          LM head is then the quantized rows of those tokens alone, so a draft forward reads
          Vs / V of the head's bytes (a tied 49152-token head is a fifth of SmolLM2's); None:
          the whole vocabulary. Exact either way (q is zero outside the subset).
  gamma, adaptive, min_gamma, threshold: as for every chain method (methods/draft.py).
  """
  bits: int = 4
  gamma: int | None = None  # None: from the cost curve (methods/sizing.py), else 4
  adaptive: bool = False
  min_gamma: int = 1
  threshold: float = 0.0
  cache: str = "shared"
  lookup: int = 0
  ngram: int = 3
  vocab: Any = dataclasses.field(default=None, compare=False, repr=False)
  key: Any = dataclasses.field(default=None, init=False, repr=False)
  left_out: tuple = dataclasses.field(default=(), init=False, compare=False, repr=False)

  name = "quantized"

  def __post_init__(self):
    sizing.left_out(self, {"gamma": 4})  # (4: measured best on SmolLM2, experiments/quantized)
    if isinstance(self.bits, bool) or not isinstance(self.bits, (int, np.integer)) or \
        self.bits not in quant.BITS:
      raise InputError(f"bits={self.bits!r} is invalid: must be 4 (Q4_1 blocks) or 8 (Q8_0 blocks)")
    if not isinstance(self.cache, str) or self.cache not in CACHES:
      raise InputError(f"cache={self.cache!r} is invalid: must be 'shared' (the target's cache) "
                       f"or 'own' (a separate draft cache)")
    super().__post_init__()
    check_int("lookup", self.lookup, 0, 64)
    check_int("ngram", self.ngram, 1, 64)
    if self.lookup and (self.cache != "shared" or self.threshold > 0):
      raise InputError(f"lookup={self.lookup} (multi-level drafting) needs cache='shared' and "
                       f"threshold=0; got cache={self.cache!r}, threshold={self.threshold}")
    vocab = check_vocab(self.vocab)
    if vocab is not None and self.lookup:
      raise InputError(f"vocab (a draft vocabulary subset) applies to one-level drafting; got "
                       f"lookup={self.lookup}")
    object.__setattr__(self, "vocab", vocab)
    # Programs differ by the subset's size, not by its ids (they are an argument).
    object.__setattr__(self, "key", None if vocab is None else vocab.size)

  def prepare(self, model) -> "QuantizedDraft":
    """gamma, if left out, from the cost curve and the bit width's prior (sizing)."""
    return sizing.prepare(self, "quantized", model, self.bits)

  def validate(self, model) -> None:
    if self.vocab is not None:
      check_vocab(self.vocab, model.config.vocab_size)

  @property
  def extra_slots(self) -> int:
    return self.gamma + self.lookup + 1  # (a draft forward may run past gamma by lookup tokens)

  @property
  def refeed(self) -> int:
    """Tokens the first draft forward of a round feeds: a separate cache re-syncs on two."""
    return 2 if self.cache == "own" else 1

  def arrays(self, model):
    """The quantized weights; with cache="own" also the target's params (the same buffers), which
    `init` needs to prefill the draft's cache (a method's init sees its arrays, not params)."""
    out = {"quantized": quantized_weights(model, self.bits)}
    if self.vocab is not None:  # the subset's head rows [Vs,E], quantized as [E,Vs]
      ids = jnp.asarray(self.vocab)
      rows = head_rows(model.config, model.params, ids)
      out.update(vocab=ids, head=quant.quantize_weight(rows.T, self.bits))
    return out if self.cache == "shared" else dict(out, params=model.params)

  def init(self, prog, arrays, state, hidden):
    """The statistics; with cache="own", also the draft's cache, prefilled on the prompt by the
    draft itself (it keeps prompt[:-1]: the next round re-feeds two tokens)."""
    b, s = state.seq.shape
    out = self._init_stats(b)
    if self.cache == "shared":
      return out
    cfg = prog.config
    dcache = kv.init(cfg.num_layers, b, s, cfg.num_kv_heads, cfg.head_dim,
                     state.cache.layers[0]["k"].dtype)
    module = draft_module(prog.graphdef, arrays["params"], arrays["quantized"])
    _, _, dcache = forward_sequence(cfg, module, state.seq[:, :hidden.shape[1]], cache=dcache,
                                    lengths=state.prompt_len, empty_cache=True,
                                    logits_at=jnp.zeros((b, 1), jnp.int32))
    return dict(out, cache=kv.rollback(dcache, state.prompt_len - 1))

  # --- drafter hooks -------------------------------------------------------------------------

  def _draft_cache(self, state: DecodeState) -> kv.KVCache:
    return state.cache if self.cache == "shared" else state.method["cache"]

  def _with_draft_cache(self, state: DecodeState, dcache: kv.KVCache) -> DecodeState:
    if self.cache == "shared":
      return state.replace(cache=dcache)
    return state.replace(method=dict(state.method, cache=dcache))

  def _draft_forward(self, prog, params, arrays, dcache, tokens, start):
    b, t = tokens.shape
    dcache = kv.rollback(dcache, start)
    pos = start[:, None] + jnp.arange(t)[None, :]
    module = draft_module(prog.graphdef, params, arrays["quantized"])
    logits, hidden, dcache = module(tokens, pos, dcache, prog.causal_mask(start, t),
                                    logits_at=jnp.full((b, 1), t - 1, jnp.int32))
    if "head" in arrays:  # the subset's head; the whole vocabulary's logits are compiled away
      return arrays["head"].product(hidden[:, -1]), dcache
    return logits[:, 0], dcache

  # --- multi-level drafting --------------------------------------------------------------------

  def _propose(self, prog, params, arrays, state: DecodeState, key):
    """propose (see `_Speculative._propose`), with lookup > 0: each draft forward scores the last
    drafted token and up to `lookup` tokens copied by prompt lookup, and keeps the accepted copies
    and the quantized model's next token (`_inner_round`), until every row has its budget."""
    if not self.lookup:
      return super()._propose(prog, params, arrays, state, key)
    b, gmax = state.seq.shape[0], self.gamma
    budget = jnp.where(self.adaptive, state.method["g"], gmax)  # [B]
    budget = jnp.where(state.done, 0, budget)
    module = draft_module(prog.graphdef, params, arrays["quantized"])
    carry = dict(seq=state.seq, n=jnp.zeros((b,), jnp.int32),
                 toks=jnp.full((b, gmax), -1, jnp.int32),
                 q=jnp.zeros((b, gmax, prog.config.vocab_size), jnp.float32),
                 cache=state.cache, calls=jnp.zeros((b,), jnp.int32))

    def cond(c):
      i, c = c
      return (i < gmax) & jnp.any(c["n"] < budget)

    def body(c):
      i, c = c
      return i + 1, self._inner_round(prog, module, state, c, budget, jax.random.fold_in(key, i))

    _, c = jax.lax.while_loop(cond, body, (jnp.int32(0), carry))
    g = jnp.minimum(c["n"], budget)
    toks = jnp.where(jnp.arange(gmax)[None, :] < g[:, None], c["toks"], -1)
    m = state.method
    state = state.replace(cache=c["cache"], method=dict(m, draft_calls=m["draft_calls"] + c["calls"]))
    return state, toks, c["q"], g

  def _inner_round(self, prog, module, state, c, budget, key):
    """One draft forward of the multi-level draft over [last, k copied tokens] at the row's next
    draft position; appends the accepted copies and the draft's own token (within gamma)."""
    b, k, gmax = state.seq.shape[0], self.lookup, self.gamma
    at = state.seq_len + c["n"]  # [B] tokens of the text plus this round's drafts
    copy, n_copy, _ = ngram_search(c["seq"], at, self.ngram, k)  # [B,k] (-1 = none)
    live = c["n"] < budget
    last = jnp.take_along_axis(c["seq"], (at - 1)[:, None], axis=1)  # [B,1]
    start = at - 1
    cache = kv.rollback(c["cache"], start)

    def run(width):  # the branches read the cache; their new entries are written after
      def forward(cache):
        x = jnp.concatenate([last, jnp.maximum(copy[:, :width - 1], 0)], axis=1)
        pos = start[:, None] + jnp.arange(width)[None, :]
        logits, _, new = module(x, pos, cache, prog.causal_mask(start, width), write_cache=False)
        return jnp.pad(logits, ((0, 0), (0, k + 1 - width), (0, 0))), new.pad(k + 1)
      return forward

    logits, new = jax.lax.cond(jnp.any(live & (n_copy > 0)), run(k + 1), run(1), cache)
    cache = kv.write_new(cache, new)
    acc, nxt = acceptance.verify_chain(key, copy, None, logits, state.sp)  # the draft's own rule
    nxt = nxt.astype(jnp.int32)
    acc = jnp.where(n_copy > 0, acc, 0)
    new = jnp.concatenate([copy, jnp.zeros((b, 1), jnp.int32)], axis=1)
    new = jnp.where(jnp.arange(k + 1)[None, :] == acc[:, None], nxt[:, None], new)  # [B,k+1]
    q_new = sampling.probs(logits, state.sp)  # [B,k+1,V] the draft's q at each new token
    j = jnp.arange(k + 1)[None, :]
    slot = c["n"][:, None] + j  # [B,k+1] where each new token goes
    keep = live[:, None] & (j <= acc[:, None]) & (slot < gmax)
    rows = jnp.arange(b)[:, None]
    tgt = jnp.where(keep, slot, gmax)  # (gmax: dropped)
    toks = c["toks"].at[rows, tgt].set(new, mode="drop")
    q = c["q"].at[rows, tgt].set(q_new, mode="drop")
    seq_slot = jnp.where(keep, state.seq_len[:, None] + slot, c["seq"].shape[1])
    seq = c["seq"].at[rows, seq_slot].set(new, mode="drop")
    n = jnp.where(live, c["n"] + acc + 1, c["n"])
    cache = kv.rollback(cache, jnp.where(live, start + acc + 1, c["cache"].lengths))
    return dict(seq=seq, n=n, toks=toks, q=q, cache=cache, calls=c["calls"] + live)

  # --- statistics ----------------------------------------------------------------------------

  def _init_stats(self, b):
    z = jnp.zeros((b, self.gamma), jnp.int32)
    return dict(super()._init_stats(b), reached_at=z, accepted_at=z,
                draft_calls=jnp.zeros((b,), jnp.int32))

  def _count(self, state, m, active, g, n, widest):
    """Every chain method's counts, plus per draft position: reached (drafted, every earlier
    draft accepted) and accepted."""
    state = super()._count(state, m, active, g, n, widest)
    i = jnp.arange(self.gamma)[None, :]
    a = active[:, None]
    reached = a & (i < g[:, None]) & (i <= n[:, None])
    accepted = a & (i < n[:, None])
    return state.replace(method=dict(state.method, reached_at=m["reached_at"] + reached,
                                     accepted_at=m["accepted_at"] + accepted))

  def stats(self, state) -> dict:
    out = super().stats(state)
    m = state.method
    reached = np.asarray(m["reached_at"]).sum(0)
    accepted = np.asarray(m["accepted_at"]).sum(0)
    rounds = max(1, int(np.sum(m["rounds"])))
    calls = int(np.asarray(m["draft_calls"]).sum())
    if self.lookup:  # (one draft forward a drafted token otherwise)
      drafted = int(np.asarray(m["drafted"]).sum())
      out.update(draft_calls=calls, drafts_per_call=drafted / calls if calls else 0.0)
    out.update(bits=self.bits, cache=self.cache,
               acceptance_by_position=[float(a / r) if r else None
                                       for a, r in zip(accepted, reached)],
               accepted_by_position=[float(a / rounds) for a in accepted],
               reached_at=reached.tolist(), accepted_at=accepted.tolist())  # the counts
    return out
