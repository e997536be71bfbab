"""GGUF files: their metadata and tensors (indexed once per file in the user's cache), the
tensors as a checkpoint `Source` under HF names (llama.cpp's q/k permutation undone, quantized
tensors dequantized when read), and the dense products' blocks as stored, for the CPU kernels.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from specjax import arch, distributed, lazy
from specjax.checkpoint import Source, convert, materialize
from specjax.config import ModelConfig
from specjax.errors import InputError, ModelNotFoundError, WeightsError


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


def open_gguf(file: str) -> tuple[ModelConfig, dict]:
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

  return cfg, convert(cfg, Source(shapes, get, file))


def load_gguf(file: str) -> tuple[ModelConfig, dict]:
  """A GGUF file -> (config, flat params in specjax layout as float32 numpy)."""
  cfg, flat = open_gguf(file)
  return cfg, materialize(flat)


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


def gguf_blocks(file: str, cfg: ModelConfig, supported, recode=None) -> tuple[dict, dict]:
  """The GGUF's dense weights as stored blocks, in the output order the model multiplies by.

  Returns ({site: (rows uint8 [N, K/block * bytes], type name)}, {site: why it stays float32})
  for the sites ("layers", i, "attn", "wqkv"), (..., "attn", "wo"), (..., "mlp", "w_in"),
  (..., "mlp", "w_out") and ("head",). A fused product (q/k/v, gate/up) keeps its blocks only
  when its parts share a type; a type not in `supported` (kernels.QTYPES), or F32 / F16, stays
  float32. Rows are output rows of the [K, N] matrix (GGUF stores [N, K] row-major, blocks along K).
  recode: None, or (rows, type) -> (rows, type), applied to each part before its type is checked:
  the same weights in another type's blocks (kernels.quant.recode: Q5_0 as Q8_0, so a Q5_0
  product is a Q8_0 one, and Q5_0 and Q8_0 parts fuse).
  """
  _, tensors = gguf_index(file)
  permute = arch.of(cfg).gguf_permuted(cfg)
  sites, skipped = {}, {}

  def add(site, parts, join=lambda *rows: np.concatenate(rows, 0)):
    if recode is not None:
      parts = [recode(rows, kind) for rows, kind in parts]
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
