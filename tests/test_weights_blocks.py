"""load_model(..., weights="blocks"): decode's dense products read a GGUF's quantized blocks as
stored. Tiny GGUF files are written here with the gguf package (no download); the embedded
SmolLM2 (Q4_1 layers, a Q8_0 embedding) checks the real file."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGUFReader

import specjax as sj
from specjax import kernels
from specjax.errors import InputError
from specjax.kernels import KernelFallbackWarning, blocks
from specjax.packing import PREFIX

from tests.helpers.gguf_files import logits, write_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
  return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def pair(tiny_gguf):
  return (sj.load_model(tiny_gguf, tokenizer=False),
          sj.load_model(tiny_gguf, tokenizer=False, weights="blocks"))


def packed_copies(model):
  return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(model.params)
          if PREFIX in jax.tree_util.keystr(p)}


def test_every_product_reads_blocks(pair):
  _, b = pair
  copies = packed_copies(b)
  assert len(copies) == 4 * 2 + 1  # four products per layer, and the head
  assert all(x.dtype == jnp.uint8 for x in copies.values())
  assert b.weights == "blocks"


def test_a_blocks_model_prints_its_arithmetic(pair):
  f, b = pair
  assert repr(f).endswith(", float32)") and repr(b).endswith(", GGUF blocks x float32 activations)")


def test_packed_blocks_are_the_files_bytes(tiny_gguf, pair):
  """attn_output (no reordering) and the tied head hold exactly the GGUF tensor's bytes."""
  _, b = pair
  tensors = {t.name: t for t in GGUFReader(tiny_gguf).tensors}
  module = b.module()
  wo = module.layers[1].attn.packed_wo[...]
  raw = np.asarray(tensors["blk.1.attn_output.weight"].data, np.uint8)
  got = np.asarray(blocks.unpack_blocks(wo, 64, 64, "Q4_1")).reshape(raw.shape)
  np.testing.assert_array_equal(got, raw)
  head = np.asarray(blocks.unpack_blocks(module.packed_head[...], 128, 64, "Q8_0"))
  np.testing.assert_array_equal(head.reshape(-1), np.asarray(tensors["token_embd.weight"].data).reshape(-1))


@pytest.mark.parametrize("t", [1, 5, 64, 70])  # 70 rows: beyond the kernel, XLA on the float32 copy
def test_logits_match_float32(pair, t):
  a, b = pair
  toks = jnp.asarray(np.random.default_rng(t).integers(0, 128, (1, t)))
  la, lb = logits(a, toks), logits(b, toks)
  assert np.abs(la - lb).max() <= 1e-5 * np.abs(la).max()


METHODS = {
    "autoregressive": lambda target: sj.Autoregressive(),
    "prompt-lookup": lambda target: sj.PromptLookup(ngram=2, num_tokens=4),
    "layer-skip": lambda target: sj.SelfSpeculative(exit_layer=1, gamma=3),
    "draft": lambda target: sj.DraftModel(draft=target, gamma=3),  # the blocks model drafts too
}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_greedy_identical_to_float32_batch4(pair, method):
  a, b = pair
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, 128, int(n)).tolist() for n in (3, 9, 14, 6)]
  prompts = [p + p for p in prompts]
  ref = sj.generate(a, prompts, sj.Autoregressive(), max_new_tokens=16).tokens
  assert sj.generate(b, prompts, METHODS[method](b), max_new_tokens=16).tokens == ref


def test_q5_0_runs_as_the_q8_0_blocks_of_its_weights(tmp_path):
  """Q5_0 blocks (Gemma 3's q/k/gate/up) are read as Q8_0 blocks of the same weights (w = d (q -
  16)), so a fused q/k/v of Q5_0 and Q8_0 parts is one Q8_0 product on the kernel: no product
  stays float32, and the logits are the float32 model's up to summation order."""
  import warnings

  path = write_gguf(tmp_path / "q5.gguf", {"attn_q.weight": "Q5_0", "attn_k.weight": "Q5_0",
                                           "attn_v.weight": "Q8_0", "ffn_gate.weight": "Q5_0",
                                           "ffn_up.weight": "Q5_0"})
  with warnings.catch_warnings():
    warnings.simplefilter("error", KernelFallbackWarning)
    b = sj.load_model(path, tokenizer=False, weights="blocks")
  a = sj.load_model(path, tokenizer=False)
  kinds = {k.split("'")[-2]: x.dtype for k, x in packed_copies(b).items()
           if k.startswith("['layers'][1]")}
  assert set(kinds.values()) == {jnp.dtype(jnp.uint8)}, kinds
  toks = jnp.asarray([[5, 9, 77, 3]])
  la, lb = logits(a, toks), logits(b, toks)
  assert np.abs(la - lb).max() <= 1e-5 * np.abs(la).max()


def test_mixed_block_types_stay_float32_with_a_warning(tmp_path):
  """q/k/v of different types cannot share one fused product; an F32 tensor has no blocks."""
  path = write_gguf(tmp_path / "mixed.gguf", {"attn_k.weight": "Q8_0", "ffn_down.weight": "F32",
                                              "attn_output.weight": "Q4_0"})
  with pytest.warns(KernelFallbackWarning, match="stay float32"):
    b = sj.load_model(path, tokenizer=False, weights="blocks")
  a = sj.load_model(path, tokenizer=False)
  kinds = {k.split("'")[-2]: x.dtype for k, x in packed_copies(b).items()
           if k.startswith("['layers'][0]")}
  assert kinds["packed_wqkv"] == jnp.float32 and kinds["packed_w_out"] == jnp.float32
  assert kinds["packed_wo"] == jnp.uint8 and kinds["packed_w_in"] == jnp.uint8
  toks = jnp.asarray([[5, 9, 77, 3]])
  la, lb = logits(a, toks), logits(b, toks)
  assert np.abs(la - lb).max() <= 1e-5 * np.abs(la).max()


def test_switched_off_kernel_falls_back_to_float32_products(pair, monkeypatch):
  a, b = pair
  monkeypatch.setenv(kernels.ENV, "0")
  toks = jnp.asarray([[1, 2, 3]])
  assert np.abs(logits(a, toks) - logits(b, toks)).max() <= 1e-5 * np.abs(logits(a, toks)).max()


def test_bad_weights_arguments_raise_before_loading(tiny_gguf, tmp_path):
  with pytest.raises(InputError, match="weights='int4' is invalid: must be one of"):
    sj.load_model(tiny_gguf, weights="int4")
  with pytest.raises(InputError, match="cannot be combined with kernels=False"):
    sj.load_model(tiny_gguf, weights="blocks", kernels=False)
  from tests.helpers.tinyhf import save_tiny_hf

  hf = save_tiny_hf(str(tmp_path / "hf"))
  with pytest.raises(InputError, match="needs a GGUF checkpoint"):
    sj.load_model(hf, weights="blocks", tokenizer=False)


@pytest.mark.slow
def test_smollm2_blocks_logits_and_tokens(smollm2):
  with warnings.catch_warnings():
    warnings.simplefilter("error", KernelFallbackWarning)  # every product has its blocks
    b = sj.load_model("smollm2-135m", weights="blocks")
    assert all(x.dtype == jnp.uint8 for x in packed_copies(b).values())
  ids = smollm2.tokenizer.encode("The history of the printing press begins")
  toks = jnp.asarray([ids])
  la, lb = logits(smollm2, toks[:, :1]), logits(b, toks[:, :1])
  assert np.abs(la - lb).max() <= 1e-5 * np.abs(la).max()
  la, lb = logits(smollm2, toks), logits(b, toks)
  assert np.abs(la - lb).max() <= 1e-5 * np.abs(la).max()
  prompts = ["Tell me about the moon.", "Write a python function that reverses a list."]
  ref = sj.generate(smollm2, prompts, max_new_tokens=32, chat=True).tokens
  assert sj.generate(b, prompts, max_new_tokens=32, chat=True).tokens == ref


def test_gguf_index_written_reused_and_invalidated(tmp_path, monkeypatch):
  """A GGUF with a real-sized vocabulary is parsed once: the index in the user's cache gives later
  loads the same fields and tensor bytes without gguf's reader, a changed file gets a new index,
  a damaged index is re-parsed, and a small vocabulary is not indexed at all."""
  import gguf

  from specjax import gguf_file

  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  n = gguf_file.GGUF_INDEX_MIN_TOKENS
  path = write_gguf(tmp_path / "voc.gguf", v=n, tokens=True)
  fields, tensors = gguf_file.gguf_index(path)
  (index,) = (tmp_path / "cache" / "gguf").iterdir()
  assert fields["tokenizer.ggml.tokens"] == range(n)

  def no_reader(*a, **k):
    raise AssertionError("the index should have answered")

  with monkeypatch.context() as m:
    m.setattr(gguf, "GGUFReader", no_reader)
    fields2, tensors2 = gguf_file.gguf_index(path)
    cached = sj.load_model(path, tokenizer=False)
  assert fields2 == fields and list(tensors2) == list(tensors)
  for name, t in tensors.items():
    u = tensors2[name]
    assert (u.tensor_type, u.shape, u.data.dtype, u.data.shape) == (
        t.tensor_type, t.shape, t.data.dtype, t.data.shape), name
    np.testing.assert_array_equal(np.asarray(u.data), np.asarray(t.data), err_msg=name)
  index.unlink()
  parsed = sj.load_model(path, tokenizer=False)
  for a, b in zip(jax.tree_util.tree_leaves(cached.params), jax.tree_util.tree_leaves(parsed.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert cached.config == parsed.config

  index.write_text("{not json")  # damaged: parsed again, and the index rewritten
  assert gguf_file.gguf_index(path)[0] == fields and json_ok(index)
  write_gguf(tmp_path / "voc.gguf", v=n, tokens=True, seed=1)  # the file changes: a new key
  gguf_file.gguf_index(path)
  assert len(list((tmp_path / "cache" / "gguf").iterdir())) == 2

  small = write_gguf(tmp_path / "small.gguf", v=128, tokens=True)
  gguf_file.gguf_index(small)
  assert len(list((tmp_path / "cache" / "gguf").iterdir())) == 2


def json_ok(path) -> bool:
  import json

  try:
    json.loads(path.read_text())
    return True
  except ValueError:
    return False
