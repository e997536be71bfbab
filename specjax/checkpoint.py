"""A checkpoint's tensors by name, and the reader of local HF directories (safetensors).

Every reader (this one, and gguf_file.py for GGUF files) fills one `Source`: each tensor's name
and shape, and a `lazy.Tensor` per name on demand: a memory map of the file, nothing read until
load_model places the tensor (weights.py). The family's converter (specjax/arch) asks the source
for every tensor by its HF name and shape; `convert` then checks that none was left over.
"""

from __future__ import annotations

import json
import math
import os
from typing import Callable

import numpy as np

from specjax import arch, lazy
from specjax.config import ModelConfig
from specjax.errors import ModelNotFoundError, WeightsError

# Buffers some checkpoints carry that are recomputed, not loaded.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


class Source:
  """A name -> lazy.Tensor accessor over one checkpoint that records what was consumed. get()
  checks the name and shape; nothing is read until the tensor is placed."""

  def __init__(self, names: dict[str, tuple], get: Callable[[str], lazy.Tensor], where: str):
    self.shapes = names  # name -> shape
    self._get = get
    self.where = where
    self.used: set[str] = set()

  def has(self, name: str) -> bool:
    return name in self.shapes

  def get(self, name: str, shape: tuple) -> lazy.Tensor:
    if name not in self.shapes:
      raise WeightsError(f"{self.where}: missing tensor {name!r} (expected shape {tuple(shape)})")
    if tuple(self.shapes[name]) != tuple(shape):
      raise WeightsError(
          f"{self.where}: tensor {name!r} has shape {tuple(self.shapes[name])}, "
          f"expected {tuple(shape)}"
      )
    self.used.add(name)
    t = self._get(name)
    if tuple(t.shape) != tuple(shape):
      raise WeightsError(f"{self.where}: tensor {name!r} read as {t.shape}, expected {shape}")
    return t

  def check_all_used(self) -> None:
    extra = sorted(
        n for n in self.shapes if n not in self.used and not n.endswith(_IGNORED_SUFFIXES)
    )
    if extra:
      more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
      raise WeightsError(f"{self.where}: unexpected tensor(s) {extra[:5]}{more}")


def convert(cfg: ModelConfig, src: Source) -> dict:
  """Every tensor of the checkpoint -> specjax flat params (lazy.Tensor), by the config's family
  (specjax/arch). Names and shapes are checked here; no weight is read."""
  flat = arch.of(cfg).params_from_hf(cfg, src)
  src.check_all_used()
  return flat


def materialize(flat: dict) -> dict:
  """Flat lazy params -> float32 numpy copies, each read and checked (the whole model in host
  memory: what read_checkpoint returns; load_model streams instead)."""
  return {k: np.array(v, np.float32) for k, v in flat.items()}


# ----------------------------------------------------------------------------- HF directories


def _st_dtypes() -> dict:
  import ml_dtypes

  return {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
          "BF16": np.dtype(ml_dtypes.bfloat16)}


def _safetensors_source(path: str) -> Source:
  """The tensors of a directory's safetensors files as memory-mapped lazy.Tensors."""
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.isfile(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  else:
    files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
  if not files:
    raise ModelNotFoundError(
        f"{path}: no weights found (expected model.safetensors, or shards with "
        f"model.safetensors.index.json)"
    )
  entries: dict[str, tuple] = {}
  for name in files:
    file = os.path.join(path, name)
    if not os.path.isfile(file):
      raise WeightsError(f"{file}: listed in the index but missing")
    header, start = _safetensors_header(file)  # a truncated file fails here, saying so
    mm = np.memmap(file, np.uint8, mode="r") if os.path.getsize(file) > start else None
    for key, info in header.items():
      entries[key] = (file, mm, start, info)
  dtypes = _st_dtypes()

  def get(key):
    file, mm, start, info = entries[key]
    shape, kind, (a, b) = tuple(info["shape"]), info["dtype"], info["data_offsets"]
    if kind not in dtypes:
      raise WeightsError(f"{file}: tensor {key!r} is stored as {kind}; supported: "
                         f"{', '.join(dtypes)}")
    dtype = dtypes[kind]
    if b - a != math.prod(shape) * dtype.itemsize:
      raise WeightsError(f"{file}: tensor {key!r} spans {b - a} bytes; shape {shape} of {kind} "
                         f"needs {math.prod(shape) * dtype.itemsize}: the file is corrupt")
    return lazy.leaf(key, shape, dtype, lambda: mm[start + a:start + b].view(dtype).reshape(shape),
                     mapped=True, where=path)

  return Source({k: tuple(e[3]["shape"]) for k, e in entries.items()}, get, path)


def _mtp_layer_names(path: str, src: Source) -> None:
  """Leaves out of `src` the multi-token-prediction layers a config.json declares after the
  model's own (num_nextn_predict_layers, DeepSeek-V3 style): drafter heads, read by
  sj.load_heads(path, target), not part of the target."""
  with open(os.path.join(path, "config.json")) as f:
    keep_out = arch.common.mtp_layers(json.load(f))
  if keep_out is not None:
    src.shapes = {n: s for n, s in src.shapes.items() if not keep_out(n)}


def _safetensors_header(file: str) -> tuple[dict, int]:
  """A safetensors file's header (name -> dtype, shape, data_offsets; metadata dropped) and the
  offset its data starts at; WeightsError for a truncated or corrupt file."""
  with open(file, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise WeightsError(f"{file}: truncated safetensors file (no header)")
    n = int.from_bytes(head, "little")
    try:
      header = json.loads(f.read(n))
    except Exception as e:
      raise WeightsError(f"{file}: truncated or corrupt safetensors header ({e})") from e
  header.pop("__metadata__", None)
  try:
    end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    for k, v in header.items():
      a, b = (int(x) for x in v["data_offsets"])
      if not (isinstance(v["dtype"], str) and all(isinstance(s, int) and s >= 0 for s in v["shape"])
              and 0 <= a <= b):
        raise ValueError(f"bad entry for {k!r}: {v}")
  except Exception as e:
    raise WeightsError(f"{file}: cannot read safetensors file ({e})") from e
  size = os.path.getsize(file)
  if size < 8 + n + end:
    raise WeightsError(f"{file}: truncated safetensors file ({size} bytes, header needs {8 + n + end})")
  return header, 8 + n


def open_hf_dir(path: str) -> tuple[ModelConfig, dict]:
  cfg = arch.from_hf_dir(path)  # config errors before any weight is read
  src = _safetensors_source(path)
  _mtp_layer_names(path, src)
  missing = arch.of(cfg).check_tensors(cfg, src, path)
  if missing:
    raise WeightsError(missing)
  return cfg, convert(cfg, src)
