"""Streaming load on 8 simulated CPU devices: each tensor is read at the target dtype and placed
with its sharding, the host never holding a float32 copy of the model.

- make_array_from_callback is asked only for the shards this process's devices hold, and no
  callback of a sharded parameter returns the whole tensor;
- host memory while loading a bfloat16 model (safetensors, ~7 MB) onto model=8: numpy's peak
  beyond what was live before (tracemalloc) stays under the bfloat16 model's size, where the
  float32 copy of the whole model (read_checkpoint, what load_model built before) is twice that
  size on its own;
- float32 on a mesh equals, bit for bit, an independent numpy conversion of the same file, for
  Phi-3 (fused qkv_proj / gate_up_proj) and a GGUF (quantized and float tensors, un-permuted q/k);
  bfloat16 equals that conversion cast;
- a NaN in a sharded tensor is named with its index in the file; a bad tensor fails before
  anything is read.

Needs 8 devices: tests/test_sharding.py's child process runs this file too (the parent deselects
it, conftest). Run it directly with
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/test_weights_stream.py
"""

from __future__ import annotations

import gc
import json
import tracemalloc

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import specjax as sj
from specjax import sharding, weights
from specjax.model import path_key

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.eight_devices
BF16 = np.dtype(ml_dtypes.bfloat16)

# Phi-3 and GGUF: every dimension the rules split divides model=4.
SPLIT = dict(vocab_size=128, num_attention_heads=8, num_key_value_heads=4)
# ~3.4M parameters: 6.8 MB in bfloat16. Every dimension the rules split divides 8.
LLAMA = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
             tie_word_embeddings=False)


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("bf16"))
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
  model.to(torch.bfloat16).save_pretrained(path)
  return path


def flat_of(params) -> dict:
  """A model's params gathered to numpy: {key: array}."""
  return {path_key(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


class Spy:
  """Records every make_array_from_callback: (shape, sharding, indices asked, shapes returned)."""

  def __init__(self, monkeypatch):
    self.calls = []
    orig = jax.make_array_from_callback

    def spy(shape, sh, cb, *a, **kw):
      asked, got = [], []

      def wrapped(index):
        out = cb(index)
        asked.append(index)
        got.append(np.shape(out))
        return out

      self.calls.append((tuple(shape), sh, asked, got))
      return orig(shape, sh, wrapped, *a, **kw)

    monkeypatch.setattr(jax, "make_array_from_callback", spy)


def _key(index) -> tuple:
  return tuple((s.start, s.stop, s.step) for s in index)


def test_callbacks_read_only_their_shards(bf16_dir, monkeypatch):
  spy = Spy(monkeypatch)
  model = sj.load_model(bf16_dir, dtype=jnp.bfloat16, tokenizer=False, mesh="data=2,model=4")
  assert len(spy.calls) == len(jax.tree_util.tree_leaves(model.params))
  sharded = 0
  for shape, sh, asked, got in spy.calls:
    want = {_key(i) for i in sh.addressable_devices_indices_map(shape).values()}
    assert {_key(i) for i in asked} == want, shape
    if not sh.is_fully_replicated:
      sharded += 1
      assert all(g != shape for g in got), f"a callback returned a whole {shape} tensor"
      assert {g for g in got} == {sh.shard_shape(shape)}
  assert sharded == 2 + 4 * LLAMA["num_hidden_layers"]  # embed, head, 4 matrices per layer
  assert {x.dtype for x in jax.tree_util.tree_leaves(model.params)} == {jnp.dtype(jnp.bfloat16)}


def _numpy_peak(fn) -> tuple[int, object]:
  """(bytes numpy / Python held at the worst moment of fn() beyond what was held before, fn's
  result)."""
  gc.collect()
  tracemalloc.start()
  try:
    before = tracemalloc.get_traced_memory()[0]
    out = fn()
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  return peak - before, out


def test_host_memory_while_loading_bf16_on_8_devices(bf16_dir):
  """The bound: host memory's peak while loading, minus what the devices hold at the end, at
  most the bfloat16 model's size. Host memory = numpy's (traced here: every slice read, whether
  jax copies it into a device buffer or keeps it as one) + the buffers XLA allocates for the
  devices (not traced; at most what they hold at the end). So peak - device bytes <= `peak`."""
  size = sum(np.prod(v.shape) for v in weights.open_checkpoint(bf16_dir)[1].values()) * 2
  peak, model = _numpy_peak(lambda: sj.load_model(bf16_dir, dtype=jnp.bfloat16, tokenizer=False,
                                                  mesh="model=8"))
  held = sum(sharding.device_bytes(model.params).values())
  largest = max(x.size for x in jax.tree_util.tree_leaves(model.params)) * 2
  old, _ = _numpy_peak(lambda: weights.read_checkpoint(bf16_dir))  # the float32 copy alone
  mib = 1 << 20
  print(f"\nbf16 model {size / mib:.2f} MiB, devices hold {held / mib:.2f} MiB; numpy peak while "
        f"loading {peak / mib:.2f} MiB; the float32 copy of the model alone: {old / mib:.2f} MiB")
  assert held >= size  # (norms are replicated on every device)
  assert peak <= size
  # About one parameter at a time: the slices of the one being placed (and of the one before,
  # while its transfer finishes), or one built whole.
  assert peak <= 2 * largest + mib
  assert old >= 2 * size  # what load_model held before converting a single tensor


def _phi3(path):
  from tests.helpers.families import build_hf

  build_hf("phi3", path, **SPLIT)
  from safetensors.numpy import load_file

  return json.load(open(f"{path}/config.json")), load_file(f"{path}/model.safetensors")


def _fuse_qkv(q, k, v, kv_heads, d):
  """q [H*D, E], k / v [K*D, E] -> wqkv [E, K, G+2, D] (per kv head: its G queries, k, v)."""
  e = q.shape[1]
  return np.concatenate([q.reshape(kv_heads, -1, d, e), k.reshape(kv_heads, 1, d, e),
                         v.reshape(kv_heads, 1, d, e)], 1).transpose(3, 0, 1, 2)


def _reference_phi3(hf, st):
  """Phi-3's tensors in specjax's layout (model.py), numpy on the file's float32 tensors."""
  h, k, e = hf["num_attention_heads"], hf["num_key_value_heads"], hf["hidden_size"]
  d, f = e // h, hf["intermediate_size"]
  out = {("embed",): st["model.embed_tokens.weight"], ("lm_head",): st["lm_head.weight"].T,
         ("final_norm", "scale"): st["model.norm.weight"]}
  for i in range(hf["num_hidden_layers"]):
    p, L = f"model.layers.{i}.", ("layers", i)
    qkv = st[p + "self_attn.qkv_proj.weight"]
    q, kk, v = qkv[:h * d], qkv[h * d:(h + k) * d], qkv[(h + k) * d:]
    out[L + ("attn", "wqkv")] = _fuse_qkv(q, kk, v, k, d)
    out[L + ("attn", "wo")] = st[p + "self_attn.o_proj.weight"].T.reshape(h, d, e)
    gate_up = st[p + "mlp.gate_up_proj.weight"]
    out[L + ("mlp", "w_in")] = np.stack([gate_up[:f].T, gate_up[f:].T], 1)
    out[L + ("mlp", "w_out")] = st[p + "mlp.down_proj.weight"].T
    out[L + ("attn_norm", "scale")] = st[p + "input_layernorm.weight"]
    out[L + ("mlp_norm", "scale")] = st[p + "post_attention_layernorm.weight"]
  return out


def _gguf(path):
  from gguf import GGUFReader, quants
  from tests.helpers.gguf_files import write_gguf

  # Quantized (Q4_1, Q8_0) and float (F16 q: a view un-permuted, F32 norms) tensors.
  write_gguf(path, types={"attn_q.weight": "F16", "ffn_up.weight": "Q8_0"}, seed=3, h=8, k=4, d=8)
  return {t.name: quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(
      tuple(reversed([int(s) for s in t.shape]))) for t in GGUFReader(path).tensors}


def _reference_gguf(g, e=64, h=8, k=4, d=8, layers=2):
  """write_gguf's llama in specjax's layout: q / k rows un-permuted (llama.cpp interleaves each
  head's rope halves), numpy on the dequantized tensors."""
  def unpermute(w, n):
    return w.reshape(n, d // 2, 2, e).swapaxes(1, 2).reshape(n * d, e)

  out = {("embed",): g["token_embd.weight"], ("final_norm", "scale"): g["output_norm.weight"]}
  for i in range(layers):
    b, L = f"blk.{i}.", ("layers", i)
    out[L + ("attn", "wqkv")] = _fuse_qkv(unpermute(g[b + "attn_q.weight"], h),
                                          unpermute(g[b + "attn_k.weight"], k),
                                          g[b + "attn_v.weight"], k, d)
    out[L + ("attn", "wo")] = g[b + "attn_output.weight"].T.reshape(h, d, e)
    out[L + ("mlp", "w_in")] = np.stack([g[b + "ffn_gate.weight"].T, g[b + "ffn_up.weight"].T], 1)
    out[L + ("mlp", "w_out")] = g[b + "ffn_down.weight"].T
    out[L + ("attn_norm", "scale")] = g[b + "attn_norm.weight"]
    out[L + ("mlp_norm", "scale")] = g[b + "ffn_norm.weight"]
  return out


@pytest.mark.parametrize("kind", ["phi3", "gguf"])
def test_float32_bit_exact_and_bf16_its_cast(kind, tmp_path):
  if kind == "phi3":
    path = str(tmp_path)
    ref = _reference_phi3(*_phi3(path))
  else:
    path = str(tmp_path / "tiny.gguf")
    ref = _reference_gguf(_gguf(path))
  for dtype in (np.float32, BF16):
    got = flat_of(sj.load_model(path, dtype=dtype, tokenizer=False, mesh="data=2,model=4").params)
    assert set(got) == set(ref)
    for key, want in ref.items():
      want = np.ascontiguousarray(want, dtype)
      assert got[key].dtype == dtype and got[key].shape == want.shape, key
      np.testing.assert_array_equal(got[key].view(np.uint8), want.view(np.uint8), err_msg=str(key))


def test_nan_in_a_sharded_tensor_is_named_where_it_is(bf16_dir, tmp_path, monkeypatch):
  """down_proj [E, F] -> w_out [F, E], split over F: the NaN is found in one device's slice and
  reported with the whole tensor's count and its index in the file."""
  import shutil

  from safetensors.torch import load_file, save_file

  name = "model.layers.1.mlp.down_proj.weight"
  tensors = load_file(f"{bf16_dir}/model.safetensors")
  tensors[name][5, 300] = float("nan")
  shutil.copy(f"{bf16_dir}/config.json", tmp_path)
  save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(sj.WeightsError, match=rf"tensor '{name}' holds 1 non-finite value.* at "
                     rf"index \(5, 300\)"):
    sj.load_model(str(tmp_path), dtype=jnp.bfloat16, tokenizer=False, mesh="model=8")
  # A tensor too many fails before a single one is read.
  tensors["model.layers.0.extra.weight"] = tensors["model.norm.weight"].clone()
  save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  spy = Spy(monkeypatch)
  with pytest.raises(sj.WeightsError, match="unexpected tensor.*model.layers.0.extra.weight"):
    sj.load_model(str(tmp_path), dtype=jnp.bfloat16, tokenizer=False, mesh="model=8")
  assert spy.calls == []
