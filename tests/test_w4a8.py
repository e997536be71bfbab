"""load_model(..., weights="blocks", activations="int8"): the W4A8 target. Every dense product
quantizes its activations per block of 32 to int8 and multiplies the GGUF's own Q4_0 / Q4_1 /
Q8_0 blocks with integer dot products (kernels/quant.py). It is a model of its own (not the
float32 model up to rounding), so its speculative methods are checked against its own
autoregressive decoding; its batch invariance is tests/test_invariance.py's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, quants

import specjax as sj
from specjax import cache as kv
from specjax.errors import InputError
from specjax.kernels import quant
from specjax.packing import PREFIX

from tests.helpers.gguf_files import logits, write_gguf


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
  # Q4_0 in the attention output, Q4_1 elsewhere in the layers, the tied head Q8_0
  return write_gguf(tmp_path_factory.mktemp("w4a8") / "tiny.gguf", types={"attn_output.weight": "Q4_0"})


@pytest.fixture(scope="module")
def w4a8(gguf_file):
  return sj.load_model(gguf_file, tokenizer=False, weights="blocks", activations="int8")


# Gemma 3 270M's file's types: Q5_0 q / k / gate / up beside a Q8_0 v (one fused QKV product of
# two types), Q4_K attention outputs, a Q6_K down projection, the tied head Q8_0.
KQUANT_TYPES = {"attn_q.weight": "Q5_0", "attn_k.weight": "Q5_0", "attn_v.weight": "Q8_0",
                "attn_output.weight": "Q4_K", "ffn_gate.weight": "Q5_0",
                "ffn_up.weight": "Q5_0", "ffn_down.weight": "Q6_K"}


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory):
  return write_gguf(tmp_path_factory.mktemp("w4a8k") / "kq.gguf", types=KQUANT_TYPES, e=256,
                    h=4, k=2, d=64, f=512)


@pytest.fixture(scope="module")
def kquant(kquant_file):
  return sj.load_model(kquant_file, tokenizer=False, weights="blocks", activations="int8")


def test_a_w4a8_model_prints_its_arithmetic(w4a8):
  assert repr(w4a8).endswith(", GGUF blocks x int8 activations)")


def _copies(model):
  module = model.module()
  layer = module.layers[1]
  return {"wo": layer.attn.packed_wo.get_value(), "w_in": layer.mlp.packed_w_in.get_value(),
          "head": module.packed_head.get_value()}


def test_every_product_holds_the_files_blocks(gguf_file, w4a8):
  assert w4a8.activations == "int8" and "int8 activations" in repr(w4a8)
  tensors = {t.name: t for t in GGUFReader(gguf_file).tensors}
  copies = _copies(w4a8)
  for name, site, kind in (("blk.1.attn_output.weight", "wo", "Q4_0"),
                           ("token_embd.weight", "head", "Q8_0")):
    t = tensors[name]
    want = quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(t.shape[::-1])  # [N, K]
    qw = copies[site]
    assert isinstance(qw, quant.QWeight) and qw.bits == (8 if kind == "Q8_0" else 4)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(qw)).T, want)
  assert copies["w_in"].packed is not None  # 4-bit products run on the integer-dot kernel
  leaves = jax.tree_util.tree_leaves_with_path(w4a8.params)
  assert sum(PREFIX in jax.tree_util.keystr(p) for p, _ in leaves) > 9  # QWeights' arrays


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K"])
def test_every_int8_type_holds_the_files_weights(kquant_file, gguf_file, kind):
  """from_gguf re-expresses each type's blocks as blocks of 32 (Q5_0 as Q8_0, Q4_K as Q4_1 with
  float32 scales, Q6_K as two Q8_0 halves): the weights gguf dequantizes, bit for bit."""
  names = {"Q4_0": (gguf_file, "blk.1.attn_output.weight"),
           "Q4_1": (gguf_file, "blk.0.ffn_up.weight"),
           "Q8_0": (kquant_file, "blk.0.attn_v.weight"),
           "Q5_0": (kquant_file, "blk.1.attn_q.weight"),
           "Q4_K": (kquant_file, "blk.0.attn_output.weight"),
           "Q6_K": (kquant_file, "blk.1.ffn_down.weight")}
  path, name = names[kind]
  t = {t.name: t for t in GGUFReader(path).tensors}[name]
  assert t.tensor_type.name == kind
  rows = np.asarray(t.data, np.uint8).reshape(int(t.shape[-1]), -1)
  want = quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(t.shape[::-1])  # [N, K]
  qw = quant.from_gguf(rows, *want.shape, kind)
  assert isinstance(qw, quant.QSum if kind == "Q6_K" else quant.QWeight)
  np.testing.assert_array_equal(np.asarray(quant.dequantize(qw)).T, want)
  if kind == "Q5_0":  # as a Q8_0 tensor's rows, the same weights
    q8, as_kind = quant.recode(rows, kind)
    assert as_kind == "Q8_0"
    got = quants.dequantize(q8, GGMLQuantizationType.Q8_0).reshape(want.shape)
    np.testing.assert_array_equal(got, want)


def test_k_quant_products_follow_the_documented_arithmetic(kquant):
  """Every product of the K-quant file (a Q5_0 + Q8_0 fused QKV, Q4_K, Q6_K's two halves) is the
  documented integer arithmetic, at 1 and 9 rows."""
  module = kquant.module()
  layer = module.layers[0]
  copies = {"wqkv": layer.attn.packed_wqkv.get_value(), "wo": layer.attn.packed_wo.get_value(),
            "w_in": layer.mlp.packed_w_in.get_value(), "w_out": layer.mlp.packed_w_out.get_value()}
  assert isinstance(copies["w_out"], quant.QSum) and copies["wqkv"].bits == 8
  assert copies["wo"].bits == 4 and copies["wo"].packed is not None
  for rows in (1, 9):
    for site, qw in copies.items():
      x = np.random.default_rng(rows).standard_normal((rows, qw.k)).astype(np.float32)
      got = np.asarray(quant.qdense(jnp.asarray(x), qw) if isinstance(qw, quant.QWeight)
                       else qw.product(jnp.asarray(x)))
      parts = qw.parts if isinstance(qw, quant.QSum) else (qw,)
      want = sum(_numpy_w4a8(x, p) for p in parts)
      assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), site


def _numpy_w4a8(x, qw):
  """The documented arithmetic in float64 (int8 activations per block of 32, integer sums)."""
  q, d = np.asarray(qw.q, np.int64), np.asarray(qw.d, np.float64)
  m = None if qw.m is None else np.asarray(qw.m, np.float64)
  xb = x.reshape(x.shape[0], -1, 32).astype(np.float32)
  amax = np.abs(xb).max(-1)
  inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
  xq = np.clip(np.rint(xb * inv[..., None]), -127, 127).astype(np.int64)
  dx = (amax / np.float32(127)).astype(np.float64)
  isum = np.einsum("mbi,bin->mbn", xq, q)
  y = (d[None] * dx[..., None]) * isum
  if m is not None:
    y = y + m[None] * (dx * xq.sum(-1))[..., None]
  return y.sum(1)


@pytest.mark.parametrize("rows", [1, 5, 64, 70])  # 70: past the kernel, XLA's integer dot
def test_products_follow_the_documented_arithmetic(w4a8, rows):
  x = np.random.default_rng(rows).standard_normal((rows, 64)).astype(np.float32)
  for qw in _copies(w4a8).values():
    got = np.asarray(quant.qdense(jnp.asarray(x), qw))
    want = _numpy_w4a8(x, qw)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("target", ["w4a8", "kquant"])
def test_close_to_the_float_activations(request, target):
  """int8 activations move the logits a little: the same weights, coarser inputs (the Q4 file,
  and the file of Gemma 3's types)."""
  path = request.getfixturevalue("gguf_file" if target == "w4a8" else "kquant_file")
  b = sj.load_model(path, tokenizer=False, weights="blocks")
  toks = jnp.asarray(np.random.default_rng(0).integers(0, 128, (1, 24)))
  la, lb = logits(b, toks), logits(request.getfixturevalue(target), toks)
  assert np.abs(la - lb).max() <= 0.15 * np.abs(la).max()
  assert (la.argmax(-1) == lb.argmax(-1)).mean() >= 0.8


def test_a_layers_norms_run_inside_its_products(gguf_file, w4a8, monkeypatch):
  """Each layer's two RMSNorms run inside the integer-dot kernel's call of the product after
  them (model.normed_dense): one operation each in the compiled forward, and the same function
  as the norm in XLA before the product (up to float rounding: XLA's rsqrt is approximate)."""
  from specjax import model as model_lib
  from specjax.kernels import qdot
  if not qdot.available():
    pytest.skip("the integer-dot kernel is unavailable here (see its warning)")
  toks = jnp.asarray(np.random.default_rng(3).integers(0, 128, (1, 12)))
  c = w4a8.init_cache(1, 128)
  pos = jnp.arange(12)[None]
  text = jax.jit(w4a8.apply).lower(w4a8.params, toks, pos, c,
                                   kv.causal_mask(c.lengths, 12, 128, 0)).compile().as_text()
  assert text.count(f'custom_call_target="{qdot.TARGET_NORM}"') == 2 * w4a8.config.num_layers
  fused = logits(w4a8, toks)
  monkeypatch.setattr(model_lib, "normed_dense", lambda norm, x, w, packed: model_lib.dense(
      x if norm is None else norm(x), w, packed))
  apart = logits(w4a8, toks)
  np.testing.assert_allclose(fused, apart, rtol=0, atol=2e-3 * np.abs(apart).max())
  assert (fused.argmax(-1) == apart.argmax(-1)).all()


METHODS = {
    "prompt-lookup": lambda target: sj.PromptLookup(ngram=2, num_tokens=4),
    "layer-skip": lambda target: sj.SelfSpeculative(exit_layer=1, gamma=3),
    "draft": lambda target: sj.DraftModel(draft=target, gamma=3),
    "lookahead": lambda target: sj.Lookahead(window=3, ngram=2, guess=3),
    "medusa": lambda target: sj.Medusa(sj.init_heads(target, "medusa", num_heads=2, seed=1)),
    "eagle": lambda target: sj.Eagle(sj.init_heads(target, "eagle", seed=1), depth=3, top_k=3,
                                     num_nodes=6),
}


# Every method on the Q4 file; three on the file of Gemma 3's types.
CASES = ([("w4a8", m) for m in sorted(METHODS)]
         + [("kquant", m) for m in ("prompt-lookup", "eagle", "draft")])


@pytest.mark.parametrize("target,method", CASES)
def test_greedy_identical_to_its_own_autoregressive_batch4(request, target, method):
  model = request.getfixturevalue(target)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, 128, int(n)).tolist() for n in (3, 9, 14, 6)]
  prompts = [p + p for p in prompts]
  ref = sj.generate(model, prompts, sj.Autoregressive(), max_new_tokens=16).tokens
  assert sj.generate(model, prompts, METHODS[method](model), max_new_tokens=16).tokens == ref


def test_bad_activations_raise_before_loading(gguf_file, tmp_path, monkeypatch):
  with pytest.raises(InputError, match="activations='int4' is invalid: must be one of"):
    sj.load_model(gguf_file, activations="int4")
  with pytest.raises(InputError, match="needs weights='blocks'"):
    sj.load_model(gguf_file, activations="int8")
  bad = write_gguf(tmp_path / "q5.gguf", types={"ffn_down.weight": "Q5_1"})
  read = []
  monkeypatch.setattr("specjax.model.from_flat", lambda *a, **k: read.append(1))
  with pytest.raises(InputError, match=r"layers\.0\.mlp\.w_out as Q5_1, which has no int8 path"):
    sj.load_model(bad, tokenizer=False, weights="blocks", activations="int8")
  assert not read  # the file's types are checked before any weight is converted
  with pytest.raises(InputError, match="activations='int8' applies to a GGUF model"):
    sj.load_model("smollm2-135m-draft", weights="blocks", activations="int8")


@pytest.mark.slow
def test_smollm2_w4a8_methods_by_name():
  """The embedded model (Q4_1 layers, a Q8_0 head) on int8 activations: the hybrid by name
  (prompt lookup's copies and the shipped EAGLE heads' tree) gives its own autoregressive tokens,
  batch 2. (Every method on a tiny W4A8 file: above.)"""
  model = sj.load_model("smollm2-135m", weights="blocks", activations="int8")
  prompts = ["Write a python function that reverses a list.", "Tell me about the moon."]
  ref = sj.generate(model, prompts, max_new_tokens=32, chat=True).tokens
  assert sj.generate(model, prompts, "hybrid", max_new_tokens=32, chat=True).tokens == ref
