"""Drafting heads as data: a frozen config plus a params pytree, and their file format.

    save_heads(heads, "my_heads.npz")
    heads = read_npz("my_heads.npz", jnp.float32)       # (sj.load_heads: names, layouts, checks)

File format (.npz): the params as float16 arrays (Medusa: "w" [K,L,E,E] and "b" [K,L,E]; the
feature drafters: their flat tensors, see specjax/drafters/eagle.py, mtp.py, eagle3.py; DFlash:
specjax/drafters/dflash.py), "__vocab__" [Vs] int32 (empty: the full vocabulary) and
"__header__", a JSON header {format, kind, num_heads, num_layers, hidden_size, vocab_size,
target, ...}. Published layouts (directories, .safetensors, .pt) are read by
specjax.drafters.layouts into the same fields and arrays (`read_published`).

The kind a file names picks its config type here and, one layer up (specjax.drafters.kinds), the
nnx module type that runs it: this layer holds no model code.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import distributed, sharding, shipped, validate
from specjax.drafters import layouts
from specjax.drafters.dflash import DFlashConfig, param_shapes
from specjax.errors import InputError, WeightsError

KINDS = ("medusa", "eagle", "mtp", "eagle3", "dflash")
FEATURE_KINDS = ("eagle", "mtp", "eagle3")  # one-decoder-layer modules on the target's features

# Shipped heads in specjax/assets, from the one registry of shipped drafters:
# name -> (target name, asset file).
# Medusa-2 assets hold Medusa heads (for the adapted target) beside the adapters.
NAMED_HEADS = {d.name: (d.target, d.asset) for d in shipped.DRAFTERS.values()
               if d.kind in KINDS + ("medusa2",)}


@dataclasses.dataclass(frozen=True)
class HeadsConfig:
  kind: str  # "medusa" | "eagle" | "mtp" | "eagle3"
  num_heads: int  # K (EAGLE: 1; MTP: modules)
  num_layers: int  # residual blocks per head
  hidden_size: int  # E of the target
  vocab_size: int  # V of the target
  target: str = ""  # the target's name when known (informational)
  vocab_subset: int = 0  # Vs, the size of the scored subset (0: the full vocabulary)
  taps: tuple = ()  # EAGLE with fused features: the target layers whose outputs are fused
  # False: the module's layer puts no norm on its input (published EAGLE-1/2 heads: the fc output
  # enters attention as it is); its params then hold no "layer.attn_norm.*".
  input_norm: bool = True

  def describe(self) -> str:
    sub = f", vocab subset {self.vocab_subset}" if self.vocab_subset else ""
    sub += f", fused taps {list(self.taps)}" if self.taps else ""
    return (f"Heads({self.kind}: K={self.num_heads} x {self.num_layers} block(s), "
            f"E={self.hidden_size}, V={self.vocab_size}{sub}"
            f"{', for ' + self.target if self.target else ''})")


@dataclasses.dataclass(frozen=True, eq=False)
class Heads:
  """config: HeadsConfig (DFlashConfig for DFlash); params: the flat tensors of its kind (Medusa:
  {"w": [K,L,E,E], "b": [K,L,E]}, with "lm" [K,V or Vs,E], each head's own LM head, as published
  Medusa-1 heads have, instead of the target's); vocab: [Vs] int32 or None."""
  config: HeadsConfig
  params: Any
  vocab: Any = None
  meta: dict = dataclasses.field(default_factory=dict)  # training notes from the file header

  def __repr__(self):
    return self.config.describe()


def config_class(kind):
  """The config type of heads of `kind` (DFlash drafters have their own shape)."""
  return {"dflash": DFlashConfig}.get(kind, HeadsConfig)


def make_config(fields: dict):
  """Header or layout fields -> the config of their kind (tuples where JSON gave lists)."""
  cls = config_class(fields.get("kind"))
  names = {f.name for f in dataclasses.fields(cls)}
  return cls(**{k: tuple(v) if k in ("taps", "target_layer_ids") else v
                for k, v in fields.items() if k in names})


def save_heads(heads: Heads, path: str, meta: dict | None = None, extra: dict | None = None) -> str:
  """Writes heads to one .npz (float16 params + JSON header); returns the path. extra: more
  arrays stored beside them under their own names (a Medusa-2 asset's adapters), which must not
  collide with the heads' own."""
  c = heads.config
  header = {"format": 1, **dataclasses.asdict(c), **heads.meta, **(meta or {})}
  os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
  vocab = np.zeros((0,), np.int32) if heads.vocab is None else np.asarray(heads.vocab, np.int32)
  # (to_host: heads sharded over processes are gathered, on every process alike)
  arrays = {k: sharding.to_host(v).astype(np.float16) for k, v in heads.params.items()}
  clash = sorted(set(extra or {}) & (set(arrays) | {"__header__", "__vocab__"}))
  if clash:
    raise InputError(f"save_heads: extra arrays {clash} would overwrite the heads' own")

  def write(tmp):
    with open(tmp, "wb") as f:  # np.savez would append ".npz" to any other suffix
      np.savez(f, __header__=np.frombuffer(json.dumps(header).encode(), np.uint8),
               __vocab__=vocab, **arrays, **(extra or {}))

  return distributed.write_once(path, write, "heads")  # by process 0 alone


HEADS_FILE = "heads (.npz written by sj.save_heads / `specjax train medusa|eagle|mtp --export`)"


def _header(z, path: str) -> dict:
  """A heads file's JSON header from its open archive; a draft model asset or a foreign .npz is
  a WeightsError saying what the file is and what was expected."""
  header = shipped.json_header(z, path, HEADS_FILE)
  if "kind" not in header and "shared" in header:  # shipped.export_draft's header
    raise WeightsError(f"{path} is a draft model asset (export_draft), not {HEADS_FILE}: use it "
                       f"with method draft (sj.DraftModel / load_model with target=)")
  required = [f.name for f in dataclasses.fields(HeadsConfig)
              if f.default is dataclasses.MISSING and f.name not in header]
  if required:
    raise WeightsError(f"{path}: its header has no {', '.join(required)}; expected {HEADS_FILE}")
  if header["kind"] not in KINDS:
    raise WeightsError(f"{path}: heads of kind {header['kind']!r}; expected one of "
                       f"{', '.join(KINDS)}")
  return header


def _medusa_shapes(cfg) -> dict:
  k, l, e = cfg.num_heads, cfg.num_layers, cfg.hidden_size
  return {"w": (k, l, e, e), "b": (k, l, e)}


def _feature_shapes(cfg) -> dict:  # the layer's shapes are checked against a target (check_fits)
  k, e = cfg.num_heads, cfg.hidden_size
  want = {"fc_w": (k, 2 * e, e), "fc_b": (k, e)}
  if cfg.taps:
    want.update(fuse_w=(k, (len(cfg.taps) + 1) * e, e), fuse_b=(k, e))
  return want


def _eagle3_shapes(cfg) -> dict:  # likewise
  e = cfg.hidden_size
  return {"fuse_w": (1, 3 * e, e), "lm": (1, cfg.vocab_subset or cfg.vocab_size, e)}


# The tensors a file of each kind must hold, and their shapes, from its header alone.
_FILE_SHAPES = {"medusa": _medusa_shapes, "eagle": _feature_shapes, "mtp": _feature_shapes,
                "eagle3": _eagle3_shapes, "dflash": param_shapes}


def read_npz(path: str, dtype) -> Heads:
  """A file written by `save_heads` -> Heads in `dtype` (shapes checked against its header)."""
  with validate.npz(path, HEADS_FILE) as z:
    header = _header(z, path)
    vocab = z["__vocab__"]
    params = {k: jnp.asarray(z[k].astype(np.float32), dtype) for k in z.files
              if not k.startswith("__")}
  try:
    cfg = make_config(header)
  except (TypeError, ValueError) as e:
    raise WeightsError(f"{path}: heads header does not describe heads ({e})") from e
  if cfg.kind in ("eagle", "mtp") and not any(n.startswith("layer.") for n in params):
    raise WeightsError(f"{path}: {cfg.kind} heads file has no layer tensors")
  for name, shape in _FILE_SHAPES[cfg.kind](cfg).items():
    if name not in params or tuple(params[name].shape) != shape:
      got = None if name not in params else tuple(params[name].shape)
      raise WeightsError(f"{path}: heads tensor {name!r} has shape {got}, expected {shape}")
  fields = {f.name for f in dataclasses.fields(cfg)}
  meta = {k: v for k, v in header.items() if k not in fields and k != "format"}
  return Heads(cfg, params, vocab.astype(np.int32) if vocab.size else None, meta)


def read_published(path: str, target, dtype) -> Heads:
  """A published layout (specjax.drafters.layouts) -> Heads in `dtype`; with `target`, the
  copies of its tensors a layout carries are checked against it and dropped."""
  fields, params, vocab, meta = layouts.read(path, None if target is None else target.config)
  _check_shared(path, meta.pop("shared_with_target", None), target)
  if target is not None and "embed" in params and _max_diff(
      np.asarray(params["embed"][0]), target.params["embed"][...]) == 0:
    params = {k: v for k, v in params.items() if k != "embed"}  # a copy of the target's: share
  return Heads(make_config(fields), {k: jnp.asarray(v, dtype) for k, v in params.items()}, vocab,
               meta)


def _max_diff(host: np.ndarray, x: jax.Array) -> float:
  """max |host - x| in float32 (inf where the shapes differ), computed where x lives: a target
  sharded over processes is compared on its devices, never copied to a host."""
  if tuple(host.shape) != tuple(x.shape):
    return float("inf")
  return float(jax.jit(lambda a, b: jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                       )(host, x))


def _check_shared(path: str, shared, target) -> None:
  """MTP layers carry copies of the target's LM head (and embedding), which specjax's modules read
  from the target itself: each copy must equal the target's (in the target's dtype)."""
  if not shared:
    return
  t = target.params
  lm = t["lm_head"][...].T if "lm_head" in t else t["embed"][...]
  emb = t["embed"][...]
  for k, (head, table) in enumerate(shared):
    for what, copy, own in (("shared_head.head", head, lm), ("embed_tokens", table, emb)):
      if copy is None:
        continue
      diff = _max_diff(np.asarray(jnp.asarray(copy, own.dtype)), own)
      if diff != 0:
        raise WeightsError(
            f"{path}: MTP module {k}'s {what} differs from the target's (max |diff| {diff:.3g}): "
            f"specjax's MTP modules share the target's LM head and embedding, as DeepSeek-V3's do")
