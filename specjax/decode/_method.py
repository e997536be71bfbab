"""The contract between a decoding method and the driver (`Method`), the static `Program` one
generation compiles to, and the phase names a step's operations carry.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import jax

from specjax import cache as kv
from specjax.decode._state import DecodeState, constrain
from specjax.errors import InputError


# Phase names a step's operations carry (jax.named_scope, so they show in the compiled program's
# op names): what specjax.breakdown attributes the loop's time to. The target's forward is always
# VERIFY unless it runs inside DRAFT (layer-skip drafts with the target's first layers).
DRAFT, VERIFY = "sj_draft", "sj_verify"


def phase(name: str):
  """Marks the operations traced inside `with phase(DRAFT):` as that phase of a step."""
  return jax.named_scope(name)


@runtime_checkable
class Method(Protocol):
  """The contract between a decoding method and the driver: all the driver reads, nothing else.

  A method is a frozen, hashable object (it is part of the jit cache key, so two equal methods
  share a compiled program). Subclass this class to inherit the defaults (no taps, nothing to
  validate, no arrays, no statistics of its own); any object with these members is also a method.

  Static attributes, read on the host before compiling:
    name          a short name for statistics and tables (the registry in methods/ knows it)
    lossless      whether outputs follow the target's distribution exactly (greedy: identical to
                  autoregressive decoding); the lossless suite holds every such method to it
    extra_slots   cache slots one step may write past the committed length
    max_emit      the most tokens one step can emit (the size of the acceptance histogram);
                  methods/verify.py's ChainSizes and TreeSizes derive both from a chain's
                  length or a tree's nodes and depth
    taps          target layers whose outputs the target's forwards also return (EAGLE's fused
                  features); () for the rest

  Verbs:
    prepare(model) -> method         optional: the method with the sizes it left out chosen for
                                     this target (methods/sizing.py); the driver calls it first
    validate(model)                  host-side checks, raising InputError before anything compiles
    arrays(model)                    the device arrays it needs (a draft model's params, heads)
    init(prog, arrays, state, prefill_hidden [B,P,E]) -> its own state (inside jit, after prefill)
    step(prog, params, arrays, state) -> state                      one iteration of the loop
    stats(final state) -> dict       its own statistics, beside those every method reports

  Every `step` goes through the same four phases, the seams the methods' code follows:
    propose   draft candidate tokens for each row (a draft model, heads, an n-gram pool, ...);
    verify    score the pending token and the candidates in ONE target forward (`prog.forward`,
              a causal mask for a chain, `cache.tree_mask` for a tree);
    accept    keep the longest prefix the rule accepts (acceptance.py: greedy, exact rejection
              sampling, typical) plus the target's own next token: `emitted(draft, n, nxt)`;
    update    commit the accepted tokens' K/V (`cache.advance` / `cache.commit`), `emit` them,
              and advance the method's own state (draft cache, features, counters).
  """

  name: str
  lossless: bool
  extra_slots: int
  max_emit: int
  taps: tuple = ()

  def validate(self, model) -> None:
    """Raises InputError if this method cannot run on `model` (before anything compiles)."""

  def arrays(self, model) -> Any:
    return {}

  def init(self, prog: Program, arrays, state: DecodeState, prefill_hidden: jax.Array) -> Any:
    raise NotImplementedError

  def step(self, prog: Program, params, arrays, state: DecodeState) -> DecodeState:
    raise NotImplementedError

  def stats(self, state: DecodeState) -> dict:
    return {}


def check_method(method) -> None:
  """InputError unless `method` follows the contract (a class passed uncalled is the usual slip)."""
  if isinstance(method, type):
    raise InputError(f"method={method.__name__} is a class, not a decoding method: call it, "
                     f"e.g. method={method.__name__}()")
  if not isinstance(method, Method):
    members = sorted(set(Method.__annotations__) | {
        a for a in vars(Method) if not a.startswith("_") and callable(getattr(Method, a))})
    missing = [a for a in members if not hasattr(method, a)]
    raise InputError(f"method={method!r} is not a decoding method (it lacks "
                     f"{', '.join(missing)}): pass one such as sj.Autoregressive() or a name "
                     f"from sj.METHODS")


@dataclasses.dataclass(frozen=True)
class Program:
  """Everything static about one compiled generation (the jit cache key)."""
  graphdef: Any  # the target's nnx GraphDef
  config: Any  # the target's ModelConfig
  method: Any  # the (hashable) method object
  max_len: int  # S
  mesh: Any = None  # jax.sharding.Mesh ("data", "model") or None: one device

  def constrain(self, tree, batch: int):
    """Pins a decode state (or a KV cache) inside jit to its declared layout (`constrain`):
    rows over data, kv heads over model."""
    return constrain(self.mesh, tree, batch)

  def forward(self, params, tokens, positions, cache, mask, **kw):
    """The target's forward. A method with `taps` (EAGLE with fused features) gets, as hidden,
    those layers' outputs beside the final feature (model.Decoder)."""
    from flax import nnx

    taps = self.method.taps
    if taps and kw.get("num_layers") is None:
      kw.setdefault("taps", taps)
      if getattr(self.method, "raw_taps", False):  # EAGLE-3: the raw residual stream
        kw.setdefault("raw_taps", True)
    with phase(VERIFY):
      return nnx.merge(self.graphdef, params)(tokens, positions, cache, mask, **kw)

  def head(self, params, hidden):
    """The target's LM head over final-normed hidden [..., E] (the prefill's packed rows)."""
    from flax import nnx

    with phase(VERIFY):
      return nnx.merge(self.graphdef, params).head(hidden)

  def causal_mask(self, lengths, num_new):
    return kv.causal_mask(lengths, num_new, self.max_len, self.config.sliding_window)
