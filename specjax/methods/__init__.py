"""Decoding methods, one file each, and the one registry of them: name -> factory.

Every method follows the contract `specjax.decode.Method` (propose -> verify -> accept -> update
on the shared driver). Everything that lists methods reads REGISTRY: `sj.METHODS` and
`sj.generate(..., method="eagle")`, the CLI's --method / --methods, the experiments, and the
lossless suite (which fails if a registered method has no greedy or no sampling case). A new
method is one file here plus one `register(...)` line below (docs/adding_a_method.md).

Names are canonical as the CLI and the result tables spell them (lower case, hyphens), and a
method's `name` (what its statistics report) is its entry's. Lookups also accept an entry's
aliases, the class name, and underscores for hyphens (older spellings such as "prompt_lookup",
"draft_model" and "self_speculative" still resolve).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from specjax import shipped as assets
from specjax.errors import InputError
from specjax.methods.autoregressive import Autoregressive
from specjax.methods.dflash import DFlash
from specjax.methods.draft import DraftModel, SelfSpeculative
from specjax.methods.eagle import Eagle
from specjax.methods.hybrid import Hybrid
from specjax.methods.lookahead import Lookahead
from specjax.methods.medusa import Medusa
from specjax.methods.mtp import MTP
from specjax.methods.pard import ParallelDraft
from specjax.methods.prompt_lookup import PromptLookup
from specjax.methods.quantized import QuantizedDraft
from specjax.methods.suffix import SuffixDecoding, SuffixStore


@dataclasses.dataclass(frozen=True)
class Entry:
  """One registered method.

  factory(target, **options) -> the method for `target` (a specjax Model) with its defaults:
  the class built with `options` and prepared for target (`prepare`: a size knob left out is
  chosen from the device's cost curve, methods/sizing.py and methods/defaults.py, exactly as
  when the class is built by hand and meets its target in sj.generate); options override them (the class's own arguments, plus `draft=` / `heads=` where a drafter is
  needed: an object, or a shipped name / file to load). requires(target) -> None where the
  method can run on target without further options, else the reason (e.g. no shipped heads)."""
  name: str
  cls: type
  factory: Callable[..., Any]
  description: str
  trained: bool = False  # needs a trained drafter (a draft model or heads)
  requires: Callable[[Any], str | None] = lambda target: None
  aliases: tuple[str, ...] = ()

  def build(self, target, **options):
    return self.factory(target, **options)

  def unavailable(self, target) -> str | None:
    """Why this method cannot run on `target` with its defaults; None if it can."""
    return self.requires(target)

  def available(self, target) -> bool:
    return self.unavailable(target) is None


REGISTRY: dict[str, Entry] = {}
_LOOKUP: dict[str, str] = {}  # normalised name, alias or class name -> canonical name


def _norm(name: str) -> str:
  return name.strip().lower().replace("_", "-")


def register(entry: Entry) -> Entry:
  """Adds `entry` (its name, aliases and class name become lookups); returns it."""
  keys = [_norm(k) for k in (entry.name, *entry.aliases, entry.cls.__name__)]
  taken = [k for k in keys if _LOOKUP.get(k, entry.name) != entry.name]
  if taken:
    raise ValueError(f"method {entry.name!r}: {', '.join(taken)} already name another method")
  REGISTRY[entry.name] = entry
  _LOOKUP.update(dict.fromkeys(keys, entry.name))
  return entry


def names() -> list[str]:
  """Canonical names, in registration order (autoregressive first)."""
  return list(REGISTRY)


def canonical(name: str) -> str | None:
  """The canonical name for a name, alias or class name; None if unknown."""
  return _LOOKUP.get(_norm(name)) if isinstance(name, str) else None


def get(name: str) -> Entry:
  """The entry for a name or alias; InputError naming the registered methods otherwise."""
  c = canonical(name)
  if c is None:
    raise InputError(f"method={name!r} is not a decoding method: registered names are "
                     f"{', '.join(REGISTRY)}")
  return REGISTRY[c]


def build(name: str, target, **options):
  """The method `name` for `target`, with its defaults and `options`."""
  return get(name).build(target, **options)


def available(target) -> list[str]:
  """The registered methods that can run on `target` with their defaults."""
  return [n for n, e in REGISTRY.items() if e.available(target)]


def resolve(method, target):
  """What sj.generate's `method=` means: None -> autoregressive, a name -> its default method
  for target, anything else is returned as is (the driver checks it against the contract)."""
  if method is None:
    return Autoregressive()
  if isinstance(method, str):
    return build(method, target)
  return method


# ----------------------------------------------------------------------------- drafters


def shipped(kind: str, target) -> str | None:
  """The shipped drafter of `kind` ("draft", "medusa", ...) for target, if its asset is here (a
  Medusa-2 asset's heads are the Medusa heads of the model its adapters make)."""
  name = getattr(target, "name", None)
  for d in assets.DRAFTERS.values():
    mine = d.target == name if d.kind == kind else \
        kind == "medusa" and d.kind == "medusa2" and assets.adapted_name(d.target) == name
    if mine and os.path.isfile(d.path):
      return d.name
  return None


def _needs_shipped(kind: str, option: str):
  def requires(target) -> str | None:
    if shipped(kind, target):
      return None
    return (f"no shipped {kind} for model {getattr(target, 'name', target)!r} (pass {option}= "
            f"or --{option}; shipped: {', '.join(assets.names(kind)) or 'none'})")
  return requires


def _draft_model(draft, target, kind: str = "draft"):
  """draft= -> a draft Model: None -> the shipped draft of target (of `kind`: "draft", or "pard"
  for a parallel one); a name or path -> loaded (a shipped draft of this very target is built
  around it: no second copy); a Model as is."""
  from specjax import weights

  if draft is None:
    draft = shipped(kind, target)
    if draft is None:
      raise InputError(_needs_shipped(kind, "draft")(target))
  if not isinstance(draft, (str, os.PathLike)):
    return draft
  entry = assets.DRAFTERS.get(os.fspath(draft))
  if (entry is not None and entry.kind in assets.DRAFT_KINDS
      and entry.target == getattr(target, "name", None)):
    return weights.load_model(draft, target=target)
  return weights.load_model(draft)


def _heads(kind: str, heads, target):
  """heads= -> Heads: None -> the shipped heads of target; a name or file -> loaded for it."""
  from specjax import heads as hd

  if heads is None:
    heads = shipped(kind, target)
    if heads is None:
      raise InputError(_needs_shipped(kind, "heads")(target))
  if isinstance(heads, (str, os.PathLike)):
    return hd.load_heads(heads, target)
  return heads


def _with_heads(cls, kind: str):
  """A heads method's factory: the class on the heads, prepared for target."""
  def factory(target, heads=None, **options):
    return cls(_heads(kind, heads, target), **options).prepare(target)
  return factory


def _draft(target, draft=None, **options):
  return DraftModel(_draft_model(draft, target), **options).prepare(target)


def _pard(target, draft=None, **options):
  return ParallelDraft(_draft_model(draft, target, "pard"), **options).prepare(target)


def _prepared(cls):
  """A drafter-free method's factory: the class with `options`, prepared for target."""
  return lambda target, **options: cls(**options).prepare(target)


def _hybrid_heads(target):
  """The hybrid's predicting drafter: the target's shipped EAGLE heads, else its Medusa heads
  (None: the hybrid copies only)."""
  return shipped("eagle", target) or shipped("medusa", target)


def _layer_skip(target, exit_layer=None, **options):
  k = exit_layer or max(1, target.config.num_layers // 4)
  return SelfSpeculative(exit_layer=k, **options).prepare(target)


# ----------------------------------------------------------------------------- the registry

# Training-free methods first, then those with a drafter (the order tables list them in).
register(Entry("autoregressive", Autoregressive, lambda target, **o: Autoregressive(**o),
               "one target call per token: the baseline"))
register(Entry("prompt-lookup", PromptLookup, _prepared(PromptLookup),
               "copies what followed an earlier occurrence of the last n-gram", aliases=("pld",)))
register(Entry("suffix", SuffixDecoding, lambda target, **o: SuffixDecoding(**o),
               "a tree of what followed earlier occurrences of the suffix, in the context and "
               "earlier outputs (SuffixDecoding, Oliaro et al. 2024)", aliases=("suffix-decoding",)))
register(Entry("lookahead", Lookahead, _prepared(Lookahead),
               "Jacobi iterations make n-grams that become drafts (Fu et al. 2024)"))
register(Entry("draft", DraftModel, _draft,
               "a small draft model proposes gamma tokens (Leviathan et al. 2023)", trained=True,
               requires=_needs_shipped("draft", "draft"), aliases=("draft-model", "sps")))
register(Entry("pard", ParallelDraft, _pard,
               "a draft taught to fill mask tokens drafts the whole chain in one forward (PARD, "
               "An et al. 2025)", trained=True, requires=_needs_shipped("pard", "draft"),
               aliases=("parallel-draft",)))
register(Entry("layer-skip", SelfSpeculative, _layer_skip,
               "the target's first layers draft for the whole target (self-speculation)",
               requires=lambda t: None if t.config.num_layers >= 2 else
               "layer-skip needs a target of at least 2 layers",
               aliases=("self-spec", "self-speculative", "selfspeculative")))
register(Entry("quantized", QuantizedDraft, _prepared(QuantizedDraft),
               "the target drafts for itself with 4-bit weights and int8 activations (QSpec)",
               aliases=("qspec", "quantized-draft", "quantized-self-draft")))
register(Entry("medusa", Medusa, _with_heads(Medusa, "medusa"),
               "extra heads on the target's last hidden state, a static tree (Cai et al. 2024)",
               trained=True, requires=_needs_shipped("medusa", "heads")))
register(Entry("eagle", Eagle, _with_heads(Eagle, "eagle"),
               "a one-layer head drafts on the target's features, a dynamic tree (EAGLE-2; "
               "tree=paths gives EAGLE-1)", trained=True, requires=_needs_shipped("eagle", "heads"),
               aliases=("eagle2", "eagle-2")))
register(Entry("hybrid", Hybrid, lambda target, heads=None, **o: Hybrid.default(
               target, _hybrid_heads(target) if heads is None else heads, **o),
               "copied (prompt lookup / suffix) and predicted (EAGLE, else Medusa) candidates in "
               "one tree", aliases=("hybrid-tree",)))
register(Entry("mtp", MTP, _with_heads(MTP, "mtp"),
               "multi-token-prediction modules draft a chain (DeepSeek-V3)", trained=True,
               requires=_needs_shipped("mtp", "heads")))
register(Entry("dflash", DFlash, _with_heads(DFlash, "dflash"),
               "a block-diffusion drafter drafts a whole block in one forward (DFlash)",
               trained=True, requires=_needs_shipped("dflash", "heads")))

__all__ = ["Autoregressive", "DFlash", "DraftModel", "Eagle", "Entry", "Hybrid", "Lookahead", "MTP",
           "Medusa", "ParallelDraft", "PromptLookup", "QuantizedDraft", "REGISTRY", "SelfSpeculative",
           "SuffixDecoding", "SuffixStore", "available", "build", "canonical", "get", "names",
           "register", "resolve", "shipped"]
