"""The drafter kinds: each kind's nnx module type, its init and its fit check, in one table.

    heads = init_heads(target, "medusa", num_heads=4, seed=0)   # untrained
    heads = load_heads("smollm2-135m-medusa")                  # shipped (specjax/assets)
    heads = load_heads("my_heads.npz", target)                 # checked against the target
    module = drafter(heads.config, target.config, arrays)      # the kind's module over arrays

A file names its kind (specjax.drafters.heads_file); the kind picks the module type here, once,
and the code that drafts calls that module's methods: MedusaHeads (medusa.py), EagleLayer
(eagle.py: EAGLE-1/2, fused features), MtpModule (mtp.py), Eagle3Head (eagle3.py) and
DFlashDrafter (dflash.py).
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np

from specjax import hub, shipped
from specjax.drafters import dflash, layouts
from specjax.drafters.dflash import DFlashDrafter
from specjax.drafters.eagle import EagleLayer, check_taps, feature_shapes, init_modules
from specjax.drafters.eagle3 import Eagle3Head, eagle3_shapes, init_eagle3_heads
from specjax.drafters.heads_file import (KINDS, NAMED_HEADS, Heads, read_npz,
                                         read_published)
from specjax.drafters.medusa import MedusaHeads, init_medusa
from specjax.drafters.mtp import MtpModule
from specjax.errors import InputError, ModelNotFoundError

# kind -> the nnx module type that runs it, built over the kind's device arrays (the flat params
# for Medusa and DFlash; one module's nested arrays, `layer.module_arrays`, for the others).
MODULES = {"medusa": MedusaHeads, "eagle": EagleLayer, "mtp": MtpModule, "eagle3": Eagle3Head,
           "dflash": DFlashDrafter}


def module_type(heads_config):
  """The nnx module type that runs heads of this config."""
  return MODULES[heads_config.kind]


def drafter(heads_config, config, arrays):
  """The module of heads of `heads_config` over `arrays` for a target of ModelConfig `config`
  (inside a traced program: arrays may be tracers)."""
  cls = MODULES[heads_config.kind]
  if cls is DFlashDrafter:  # its constructor draws fresh weights: merged over the arrays instead
    return dflash.drafter(heads_config, arrays)
  return cls(heads_config, config, arrays)


def _refuse(kind, taps, input_norm, dflash_options, taps_ok: bool = False,
            raw_ok: bool = False) -> None:
  """InputError for options heads of `kind` do not take (taps_ok: taps; raw_ok: input_norm
  False)."""
  if dflash_options:
    raise InputError(f"{', '.join(sorted(dflash_options))}: options of DFlash heads, not {kind}")
  if taps and not taps_ok:
    raise InputError(f"taps={taps!r}: fused features are for EAGLE heads, not {kind}")
  if input_norm is not True and (input_norm is not False or not raw_ok):
    raise InputError(f"input_norm={input_norm!r}: True, or False for EAGLE heads (the published "
                     f"EAGLE-1/2 layer), not {kind}")


def _init_dflash(target, num_heads, num_layers, seed, scale, vocab, taps, input_norm, options):
  return Heads(*dflash.init_params(target, num_layers=num_layers, seed=seed, scale=scale or 0.02,
                                   **options))


def _init_medusa(target, num_heads, num_layers, seed, scale, vocab, taps, input_norm, options):
  _refuse("medusa", taps, input_norm, options)
  return init_medusa(target, num_heads=num_heads, num_layers=num_layers, seed=seed, scale=scale,
                     vocab=vocab)


def _init_eagle3(target, num_heads, num_layers, seed, scale, vocab, taps, input_norm, options):
  _refuse("eagle3", taps, input_norm, options, taps_ok=True)
  if taps:
    raise InputError(f"taps={taps!r}: an EAGLE-3 head reads target layers 2, L // 2 and L - 3")
  return init_eagle3_heads(target, seed=seed, scale=scale, vocab=vocab)


def _init_feature(cls, eagle: bool):
  def init(target, num_heads, num_layers, seed, scale, vocab, taps, input_norm, options):
    _refuse(cls.kind, taps, input_norm, options, taps_ok=eagle, raw_ok=eagle)
    return init_modules(cls, target, num_heads=num_heads, num_layers=num_layers, seed=seed,
                        scale=scale, vocab=vocab, taps=taps, input_norm=input_norm)
  return init


# kind -> its init (the options it does not take are refused first)
_INITS = {"medusa": _init_medusa, "eagle": _init_feature(EagleLayer, eagle=True),
          "mtp": _init_feature(MtpModule, eagle=False), "eagle3": _init_eagle3,
          "dflash": _init_dflash}


def init_feature_heads(target, kind: str, **kw) -> Heads:
  """EAGLE (num_heads 1) or MTP (num_heads modules, default 2) heads for `target`
  (eagle.init_modules)."""
  return init_modules(MODULES[kind], target, **kw)


def init_heads(target, kind: str = "medusa", *, num_heads: int | None = None, num_layers: int = 1,
               seed: int = 0, scale: float = 0.0, vocab=None, taps=(),
               input_norm: bool = True, **dflash_options) -> Heads:
  """Fresh heads for `target` (a specjax Model). Medusa (num_heads default 4): scale 0 (Medusa's
  init) makes every head the target's LM head; scale > 0 draws W ~ N(0, scale^2 / E) and
  b ~ N(0, scale^2) (tests). EAGLE (one module) and MTP (num_heads modules, default 2): see
  `init_feature_heads` (EAGLE also takes `taps`, fused features: see specjax/drafters/eagle.py,
  and input_norm=False: the published EAGLE-1/2 architecture, no norm on the layer's input).
  EAGLE-3: `init_eagle3_heads` (vocab: its draft vocabulary). DFlash: num_layers drafter layers
  and `dflash_options` = block_size, mask_token_id, target_layer_ids
  (specjax.drafters.dflash.init_params; scale 0 there means its default 0.02)."""
  if kind not in KINDS:
    raise InputError(f"kind={kind!r} is invalid: heads kinds built so far are {', '.join(KINDS)}")
  return _INITS[kind](target, num_heads, num_layers, seed, scale, vocab, taps, input_norm,
                      dflash_options)


def _fits_width(heads: Heads, target) -> None:
  c, t = heads.config, target.config
  if (c.hidden_size, c.vocab_size) != (t.hidden_size, t.vocab_size):
    raise InputError(
        f"heads {heads!r} were made for a target of width {c.hidden_size} and vocabulary "
        f"{c.vocab_size}, but this target has width {t.hidden_size} and vocabulary "
        f"{t.vocab_size}: load or train heads for this model")


def _fits_medusa(heads: Heads, target) -> dict | None:
  _fits_width(heads, target)
  return None  # (no tensor shaped by the target's layer)


def _fits_feature(heads: Heads, target) -> dict:
  _fits_width(heads, target)
  c, t = heads.config, target.config
  if c.taps and max(c.taps) >= t.num_layers:
    raise InputError(f"heads {heads!r} fuse the outputs of target layers {list(c.taps)}, but this "
                     f"target has {t.num_layers} layers: load or train heads for this model")
  return feature_shapes(module_type(c), c.num_heads, target, c.taps, c.input_norm,
                        "norm_o" in heads.params)


def _fits_dflash(heads: Heads, target) -> None:
  dflash.check_fits(heads.config, heads.params, target, repr(heads))  # (its own width check)


def _fits_eagle3(heads: Heads, target) -> dict:
  _fits_width(heads, target)
  c, t = heads.config, target.config
  want_taps = layouts.eagle3_taps(t.num_layers)
  if tuple(c.taps) != want_taps:
    raise InputError(f"heads {heads!r} read target layers {list(c.taps)}, but EAGLE-3 reads "
                     f"{list(want_taps)} of a target of {t.num_layers} layers: load or train "
                     f"heads for this model")
  return eagle3_shapes(target, c.vocab_subset or c.vocab_size, "embed" in heads.params)


# kind -> (heads, target) -> the tensor shapes the heads must have for the target (None: no check)
_FITS = {"medusa": _fits_medusa, "eagle": _fits_feature, "mtp": _fits_feature,
         "eagle3": _fits_eagle3, "dflash": _fits_dflash}


def check_fits(heads: Heads, target) -> None:
  """Raises InputError unless `heads` were made for a target of this width and vocabulary."""
  want = _FITS[heads.config.kind](heads, target)
  if want is None:
    return
  got = {k: tuple(np.shape(v)) for k, v in heads.params.items()}
  if got != want:
    bad = sorted(set(want) ^ set(got)) or [k for k in want if want[k] != got[k]]
    raise InputError(
        f"heads {heads!r} have layer tensors that do not fit this target's layer type "
        f"(first mismatch: {bad[0]!r}: {got.get(bad[0])} vs {want.get(bad[0])}): load or "
        f"train heads for this model")


def _heads_path(name: str, revision) -> str:
  """Where heads named `name` are: a shipped asset, a local path or a Hub download."""
  what = hub.what_is(name, (*NAMED_HEADS, *shipped.DRAFTERS), hub.HEADS_SUFFIXES)
  hub.check_revision(name, revision, what)
  if name in NAMED_HEADS:
    target_name, file = NAMED_HEADS[name]
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", file)
    if not os.path.isfile(path):
      kind = name.rsplit("-", 1)[-1]
      raise ModelNotFoundError(
          f"heads {name!r}: the asset {path} is not there (not trained and shipped yet). Train "
          f"heads for {target_name!r} with `specjax train {kind} --model {target_name} --corpus "
          f"DIR --export heads.npz` and load them with sj.load_heads('heads.npz', target)")
    return path
  if name in shipped.DRAFTERS:
    d = shipped.DRAFTERS[name]
    raise InputError(f"load_heads: {name!r} is a shipped {d.kind} model, not heads: load it with "
                     f"sj.load_model({name!r}, target=sj.load_model({d.target!r})) and pass it to "
                     f"sj.DraftModel")
  if what == hub.LOCAL:
    return name
  if what == hub.HUB:
    return hub.heads_path(name, revision)
  raise ModelNotFoundError(f"load_heads: {name!r} is neither a shipped heads name "
                           f"({', '.join(NAMED_HEADS)}), a file or directory, nor a Hugging "
                           f"Face Hub name (org/name, or org/name/FILE)")


def load_heads(path_or_name: str, target=None, *, dtype=None, revision: str | None = None) -> Heads:
  """Shipped heads by name (see NAMED_HEADS), a file written by `save_heads`, or published heads
  (a directory, .safetensors, .pt or .bin in the Medusa or EAGLE layouts: specjax.drafters). With
  `target`, checks that they fit it (width and vocabulary) and uses its dtype.

  A Hugging Face Hub name, "org/name" (the repository's config.json and weights) or
  "org/name/FILE" (one .npz / .safetensors / .pt / .bin file, with the config.json beside it),
  is read from the Hugging Face cache, downloaded there first where needed (never with
  HF_HUB_OFFLINE set), at `revision` (default main); a shipped name or an existing local path of
  the same name wins (specjax.hub)."""
  if not isinstance(path_or_name, (str, os.PathLike)):
    raise InputError(f"load_heads: expected a heads name or path, got "
                     f"{type(path_or_name).__name__}")
  path = _heads_path(os.fspath(path_or_name), revision)
  dt = dtype or (getattr(target, "dtype", None) if target is not None else None) or jnp.float32
  if layouts.is_published(path):
    heads = read_published(path, target, dt)
  else:
    heads = read_npz(path, dt)
  if target is not None:
    check_fits(heads, target)
  return heads


__all__ = ["MODULES", "check_fits", "check_taps", "drafter", "init_feature_heads", "init_heads",
           "load_heads", "module_type"]
