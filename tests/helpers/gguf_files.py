"""Tiny random GGUF files written with the gguf package (no download), and a model's logits over
them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType, GGUFWriter, quants

from specjax import cache as kv


def k_quant_rows(shape, kind: str, rng) -> np.ndarray:
  """Random Q4_K or Q6_K blocks for a [N, K] weight (K a multiple of 256): uint8 [N, K/256 *
  bytes], every scale, min and quant byte random, the fp16 super-block scales small and positive
  (weights within about +-0.2). Any bytes are valid blocks of these types."""
  n, k = shape
  size = GGML_QUANT_SIZES[getattr(Q, kind)][1]  # bytes per super-block of 256
  blk = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
  at = (0, 2) if kind == "Q4_K" else (size - 2,)  # d, dmin (Q4_K); d last (Q6_K)
  scale = 2e-4 if kind == "Q4_K" else 5e-5
  for i in at:
    d = (scale * rng.uniform(0.5, 1.0, (n, k // 256))).astype(np.float16)
    blk[..., i:i + 2] = d[..., None].view(np.uint8).reshape(n, k // 256, 2)
  return blk.reshape(n, -1)


def write_gguf(path, types=None, seed=0, e=64, h=4, k=2, d=16, f=96, v=128, layers=2,
               tokens=False):
  """A tiny random llama GGUF; types maps a tensor's name (without "blk.i.") to its block type
  (default: Q4_1 for the layers, Q8_0 for the embedding, which is also the tied head); tokens:
  also a vocabulary list of v made-up token strings."""
  types = types or {}
  rng = np.random.default_rng(seed)
  w = GGUFWriter(str(path), "llama")
  if tokens:
    w.add_token_list([f"tok{i}" for i in range(v)])
  w.add_context_length(256)
  w.add_embedding_length(e)
  w.add_block_count(layers)
  w.add_feed_forward_length(f)
  w.add_head_count(h)
  w.add_head_count_kv(k)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_rope_freq_base(10000.0)
  w.add_vocab_size(v)

  def tensor(name, shape, default):
    kind = types.get(name.split(".", 2)[-1] if name.startswith("blk.") else name, default)
    a = (rng.standard_normal(shape) * 0.2).astype(np.float32)
    if kind == "F32":
      w.add_tensor(name, a)
    elif kind in ("Q4_K", "Q6_K"):  # gguf cannot quantize to these: random blocks, sane scales
      w.add_tensor(name, k_quant_rows(shape, kind, rng), raw_dtype=getattr(Q, kind))
    else:
      w.add_tensor(name, quants.quantize(a, getattr(Q, kind)), raw_dtype=getattr(Q, kind))

  tensor("token_embd.weight", (v, e), "Q8_0")
  for i in range(layers):
    b = f"blk.{i}."
    w.add_tensor(b + "attn_norm.weight", (1 + 0.1 * rng.standard_normal(e)).astype(np.float32))
    w.add_tensor(b + "ffn_norm.weight", (1 + 0.1 * rng.standard_normal(e)).astype(np.float32))
    for name, shape in (("attn_q", (h * d, e)), ("attn_k", (k * d, e)), ("attn_v", (k * d, e)),
                        ("attn_output", (e, h * d)), ("ffn_gate", (f, e)), ("ffn_up", (f, e)),
                        ("ffn_down", (e, f))):
      tensor(b + name + ".weight", shape, "Q4_1")
  w.add_tensor("output_norm.weight", np.ones(e, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)


def logits(model, toks):
  b, t = toks.shape
  c = model.init_cache(b, 128)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  lg, _, _ = jax.jit(model.apply)(model.params, toks, pos, c, kv.causal_mask(c.lengths, t, 128, 0))
  return np.asarray(lg)


def without_vocabulary(path, out) -> str:
  """A copy of the GGUF file at `path`, written to `out`, with the tokenizer's vocabulary arrays
  (tokens, scores, token types, merges) left out and the vocabulary's size stated as
  `<arch>.vocab_size`: every other field and every tensor's bytes as they are.

  For transformers as the parity oracle: its GGUF loader reads a file with gguf.GGUFReader, which
  parses every vocabulary entry in Python, twice per load (config, then weights): Gemma 3's
  262k-token vocabulary cost most of the ~80-110 s its oracle took to load. Neither the config
  nor the weights it builds read those arrays (the tests tokenize with the model's own
  tokenizer). The fields come from specjax's index of the file (`gguf_file.gguf_index`), so
  writing the copy reads no vocabulary either."""
  from specjax import gguf_file

  fields, tensors = gguf_file.gguf_index(str(path))
  arch = fields["general.architecture"]
  w = GGUFWriter(str(out), arch)
  for key, value in fields.items():
    if key in ("general.architecture", "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"):
      continue  # the writer's own
    if isinstance(value, range):  # the vocabulary (the index keeps its length only)
      if f"{arch}.vocab_size" not in fields:
        w.add_uint32(f"{arch}.vocab_size", len(value))
      continue
    if isinstance(value, int) and not isinstance(value, bool) and not -2**31 <= value < 2**31:
      w.add_int64(key, value)  # (gguf types every int as INT32)
    elif value is not None and value != []:
      w.add_key_value(key, value, GGUFValueType.get_type(value))
  for t in tensors.values():
    data = np.asarray(t.data)
    quantized = t.tensor_type not in (Q.F32, Q.F16)
    w.add_tensor(t.name, data, raw_dtype=t.tensor_type if quantized else None)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(out)
