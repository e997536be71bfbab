"""Shipped assets: the drafters specjax ships in specjax/assets, and the draft asset format that
the loader and the trainers share.

    DRAFTERS[name] -> Drafter(name, kind, target, asset)     e.g. "smollm2-135m-draft"
    build(name, target)                                        -> the drafter around its target

`weights.load_model(name)` builds a shipped drafter around its loaded target; the trainers in
specjax/training write the assets. Neither side imports the other: both import this module, which
depends only on model.py.

Asset format of kind "draft" (format 1), one .npz:
    __header__   uint8 bytes of a JSON dict: target, num_layers, format, shared (tensor names
                 borrowed from the target), plus training metadata (steps, held_out_top1, ...)
    __vocab__    [Vs] int32: the draft's vocabulary subset (empty: the full vocabulary)
    <name>       float16: each of the draft's own tensors, named by its flat path
                 ("layers_0_attn_wqkv", "final_norm_scale", ...)
The target's embeddings and LM head are not stored: the draft borrows them at load time.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from specjax import distributed, sharding, validate
from specjax.errors import InputError, ModelNotFoundError, WeightsError
from specjax.model import Model, path_key

KINDS = ("draft", "pard", "medusa", "eagle", "mtp", "medusa2", "dflash")
DRAFT_KINDS = ("draft", "pard")  # draft models, in the draft asset format (a parallel one too)
ASSETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")


@dataclasses.dataclass(frozen=True)
class Drafter:
  """A shipped drafter: `kind` (one of KINDS), the `target` model name it drafts for, and its
  `asset` file name in specjax/assets."""
  name: str
  kind: str
  target: str
  asset: str

  @property
  def path(self) -> str:
    return os.path.join(ASSETS_DIR, self.asset)


DRAFTERS: dict[str, Drafter] = {d.name: d for d in (
    Drafter("smollm2-135m-draft", "draft", "smollm2-135m", "smollm2-135m-draft.npz"),
    # PARD: a draft model taught to fill mask tokens (methods/pard.py), in the same format.
    Drafter("smollm2-135m-pard", "pard", "smollm2-135m", "smollm2-135m-pard.npz"),
    # Heads (Medusa / EAGLE / MTP / DFlash) are loaded by specjax.heads.load_heads; a missing
    # asset says how to train it.
    Drafter("smollm2-135m-medusa", "medusa", "smollm2-135m", "smollm2-135m-medusa.npz"),
    Drafter("smollm2-135m-eagle", "eagle", "smollm2-135m", "smollm2-135m-eagle.npz"),
    Drafter("smollm2-135m-mtp", "mtp", "smollm2-135m", "smollm2-135m-mtp.npz"),
    # DFlash: a block-diffusion drafter (specjax/drafters/dflash.py), loaded as heads too.
    Drafter("smollm2-135m-dflash", "dflash", "smollm2-135m", "smollm2-135m-dflash.npz"),
    # Medusa-2: LoRA adapters for the target and Medusa heads for the adapted model, one asset:
    # sj.load_model(name) is the adapted target (specjax.lora), sj.load_heads(name) its heads.
    Drafter("smollm2-135m-medusa2", "medusa2", "smollm2-135m", "smollm2-135m-medusa2.npz"),
)}


def adapted_name(target: str) -> str:
  """The name of the model Medusa-2 adapters make of the model named `target`."""
  return f"{target}+medusa2"


def names(kind: str) -> list[str]:
  """Registered drafter names of one kind."""
  return sorted(n for n, d in DRAFTERS.items() if d.kind == kind)


def get(name: str) -> Drafter:
  """The registered drafter `name`; ModelNotFoundError naming the registered ones otherwise."""
  if name not in DRAFTERS:
    raise ModelNotFoundError(f"unknown drafter {name!r}; registered: {', '.join(sorted(DRAFTERS))}")
  return DRAFTERS[name]


def build(name: str, target: Model):
  """The registered drafter `name` rebuilt from its asset around `target` (its loaded target)."""
  entry = get(name)
  if not os.path.isfile(entry.path):
    raise ModelNotFoundError(f"drafter {name!r}: {entry.path} is missing; rebuild it with "
                             f"`specjax train {entry.kind}` (see experiments/draft_model/README.md)")
  if entry.kind not in READERS:
    raise ModelNotFoundError(f"drafter {name!r}: no asset reader for kind {entry.kind!r} "
                             f"(readers: {', '.join(READERS)})")
  return READERS[entry.kind](entry.path, target, name=name)


# ----------------------------------------------------------------------------- kind "draft"


def _flat_name(key: tuple) -> str:
  return "_".join(map(str, key))


def own_params(draft: Model) -> dict:
  """name -> array for the draft's own (trainable, stored) tensors; shared ones and packed copies
  for the kernel (derived at load, specjax/packing.py) excluded."""
  from specjax.packing import is_packed_path

  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(draft.params):
    key = path_key(path)
    if key not in draft.shared and not is_packed_path(path):
      out[_flat_name(key)] = leaf
  return out


def with_params(draft: Model, own: dict, params=None):
  """The draft's param State (or `params`, one of the same structure) with its own tensors
  replaced by `own` (works under jit)."""
  def pick(path, leaf):
    name = _flat_name(path_key(path))
    return own[name] if name in own else leaf
  return jax.tree_util.tree_map_with_path(pick, draft.params if params is None else params)


def draft_from_target(target: Model, num_layers: int = 2, vocab: np.ndarray | None = None,
                      own: dict | None = None, name: str = "draft") -> Model:
  """A `num_layers`-layer draft sharing the target's embeddings / LM head (and tokenizer).

  Its own tensors start as copies of the target's first layers and final norm, or come from `own`
  (flat name -> array). vocab [Vs] int32: the draft's vocabulary subset (None: all of it).
  """
  cfg = target.config
  if not 1 <= num_layers <= cfg.num_layers:
    raise InputError(f"num_layers={num_layers} must be in [1, {cfg.num_layers}]")
  from flax import nnx
  from specjax.model import Decoder

  dcfg = dataclasses.replace(cfg, num_layers=num_layers)
  abstract = nnx.eval_shape(lambda: Decoder(dcfg, dtype=target.dtype, rngs=nnx.Rngs(0)))
  graphdef, abs_state = nnx.split(abstract)
  src = {path_key(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(target.params)}
  shared = tuple(k for k in (("embed",), ("lm_head",), ("pos_embed",)) if k in src)

  def fill(path, leaf):
    key = path_key(path)
    if own is not None and key not in shared:
      arr = own[_flat_name(key)]
      if tuple(arr.shape) != tuple(leaf.shape):
        raise InputError(f"draft tensor {_flat_name(key)} has shape {arr.shape}, expected {leaf.shape}")
      return jnp.asarray(arr, target.dtype)
    return src[key] if key in shared else jnp.array(src[key])  # copies: training must not alias
  params = jax.tree_util.tree_map_with_path(fill, abs_state)
  m = Model(dcfg, graphdef, params, target.tokenizer, name=name, dtype=target.dtype, shared=shared)
  m.vocab_subset = None if vocab is None else np.asarray(vocab, np.int32)
  return m


def export_draft(draft: Model, path: str, *, target_name: str, meta: dict | None = None) -> str:
  """Writes the draft's own tensors (float16), its subset ids and a header to one .npz."""
  own = {k: sharding.to_host(v).astype(np.float16) for k, v in own_params(draft).items()}
  header = {"target": target_name, "num_layers": draft.config.num_layers, "format": 1,
            "shared": ["_".join(k) for k in draft.shared], **(meta or {})}
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  vocab = draft.vocab_subset if draft.vocab_subset is not None else np.zeros((0,), np.int32)
  return distributed.write_once(path, lambda tmp: np.savez(  # by process 0 alone
      tmp, __header__=np.frombuffer(json.dumps(header).encode(), np.uint8),
      __vocab__=np.asarray(vocab, np.int32), **own), "draft asset")


DRAFT_ASSET = "a draft model asset (.npz written by export_draft / `specjax train draft --export`)"


def asset_path(path_or_name) -> str:
  """A draft asset's file: a path as given, or a shipped draft's name ("smollm2-135m-draft") as
  its asset in specjax/assets. A shipped heads name is an InputError saying how to load heads."""
  if not isinstance(path_or_name, (str, os.PathLike)) or not os.fspath(path_or_name):
    raise InputError(f"draft asset {path_or_name!r} is invalid: give a .npz path or a shipped "
                     f"draft's name ({', '.join(names('draft'))})")
  name = os.fspath(path_or_name)
  if name in DRAFTERS:
    entry = DRAFTERS[name]
    if entry.kind not in DRAFT_KINDS:
      raise InputError(f"{name!r} names shipped {entry.kind} heads, not a draft model: load them "
                       f"with sj.load_heads({name!r}, target)")
    return entry.path
  return name


def json_header(z, path: str, expected: str) -> dict:
  """The JSON object in an open .npz asset's __header__ (a draft asset's, a heads file's); a
  WeightsError naming what was `expected` where there is none."""
  try:
    header = json.loads(bytes(z["__header__"]).decode())
  except (UnicodeDecodeError, ValueError) as e:
    raise WeightsError(f"{path}: its __header__ is not JSON ({e}); expected {expected}") from e
  if not isinstance(header, dict):
    raise WeightsError(f"{path}: its __header__ is not a JSON object; expected {expected}")
  return header


def _header(z, path: str) -> dict:
  """A draft asset's JSON header from its open archive; a heads file or a foreign .npz is a
  WeightsError saying what the file is."""
  header = json_header(z, path, DRAFT_ASSET)
  kind = header.get("kind")
  if kind in KINDS and kind not in DRAFT_KINDS:
    raise WeightsError(f"{path} holds {kind} heads (written by save_heads), not {DRAFT_ASSET}: "
                       f"load it with sj.load_heads({path!r}, target)")
  missing = [k for k in ("num_layers", "target") if k not in header]
  if missing:
    raise WeightsError(f"{path}: its header has no {', '.join(missing)}; expected {DRAFT_ASSET}")
  return header


def read_draft_header(path: str) -> dict:
  """The JSON header of a draft asset (a path or a shipped draft's name): target, num_layers,
  training metadata. A missing, empty, truncated or non-draft file is a WeightsError naming it."""
  path = asset_path(path)
  with validate.npz(path, DRAFT_ASSET) as z:
    return _header(z, path)


def load_draft_asset(path: str, target: Model, name: str = "") -> Model:
  """Rebuilds a draft exported by `export_draft` (a path or a shipped draft's name) around
  `target`'s shared tensors."""
  path = asset_path(path)
  with validate.npz(path, DRAFT_ASSET) as z:
    header = _header(z, path)
    vocab = z["__vocab__"]
    own = {k: z[k].astype(np.float32) for k in z.files if not k.startswith("__")}
  try:
    draft = draft_from_target(target, header["num_layers"], vocab if vocab.size else None, own=own,
                              name=name or os.path.basename(path))
  except (KeyError, InputError) as e:
    raise WeightsError(f"{path}: draft asset does not fit target {target.name!r} ({e})") from e
  draft.asset_header = header
  return draft


def parallel_settings(draft) -> dict:
  """What a parallel draft's asset records (`specjax train pard`): {"block_size",
  "mask_token_id", "anchors"}; {} for a draft without them (a plain draft, one built in code)."""
  header = getattr(draft, "asset_header", None) or {}
  return dict(header.get("parallel") or {})


# kind -> reader(path, target, name=) -> drafter; each drafter kind adds its reader here.
READERS = {"draft": load_draft_asset, "pard": load_draft_asset}
