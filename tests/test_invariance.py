"""Batch invariance, the property that makes speculation exact: row r of a T-token forward (a
chain or a tree block, batch B, empty or part-filled cache) has the bits of the one-token forward
at that position over the same cache, on every kernel path, and every path gives the same bits
(specjax/invariance.py). A planted product or norm whose summation order depends on the number
of rows must fail the check, or the check proves nothing."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax import kernels, packing
from specjax.invariance import BatchInvariance, chain, compare
from specjax.kernels import attention, blocks, qdot

from tests.helpers.gguf_files import write_gguf
from tests.helpers.kernels import isa_paths
from tests.helpers.models import tiny_model

LIBS = (kernels, attention, blocks, qdot)
PATHS = isa_paths(kernels)
# Trees as verification feeds them (parents in topological order): a binary tree, a deep spine
# with side branches, a star.
TREES = ((-1, 0, 0, 1, 1, 2, 2), (-1, 0, 1, 2, 3, 0, 1, 5, 2), (-1, 0, 0, 0, 0, 0))


def _on_every_path(fn, every: bool = True):
  """{path: fn()} under every kernel path this CPU runs (the three libraries switched together),
  or only the one in use (every=False); the path in use before is restored."""
  assert PATHS, "the CPU kernels are unavailable here"
  before = [lib.isa() for lib in LIBS]
  out = {}
  try:
    for name in PATHS if every else [LIBS[0].isa()]:
      for lib in LIBS:
        lib.set_isa(name)
      out[name] = fn()
  finally:
    for lib, name in zip(LIBS, before):
      lib.set_isa(name)
  return out


def _assert_case(probe, case, empty=False, every=True):
  """Each path's block equals the one-token reference (so the paths equal each other too)."""
  want = probe.reference(case)
  for name, got in _on_every_path(lambda: probe.block(case, empty), every).items():
    report = compare(got, want)
    assert report.ok, (name, case.parents, case.tokens.shape, str(report))


def _assert_invariant(probe, parents, *, context, batch=1, empty=False, every=True):
  _assert_case(probe, probe.case(parents, context=context, batch=batch), empty, every)


def _assert_chains(probe, lengths, *, context, batch=1, every=True):
  """Chains of these lengths, all prefixes of one chain: one reference for all of them."""
  case = probe.case(chain(max(lengths)), context=context, batch=batch)
  want = probe.reference(case)
  for t in lengths:
    for name, got in _on_every_path(lambda: probe.block(case.prefix(t)), every).items():
      report = compare(got, want[:, :t])
      assert report.ok, (name, t, str(report))


def _gemma_like():
  """Soft-caps (scores and logits), q/k norms, post norms, GeGLU and alternating sliding
  windows: every kind of op the families add."""
  return tiny_model(seed=3, arch="gemma", norm="rms", activation="gelu_tanh", qk_norm=True,
                    post_norms=True, attn_softcap=20.0, final_softcap=15.0,
                    layer_windows=(6, 0), tie_word_embeddings=True, embed_scale=32 ** 0.5)


@pytest.fixture(scope="module")
def llama_probe():
  return BatchInvariance(packing.pack(tiny_model()), cache_len=160)


def test_chains_of_every_length(llama_probe):
  _assert_chains(llama_probe, range(1, 65), context=40)


def test_trees_batches_and_caches(llama_probe):
  for parents in TREES:
    _assert_invariant(llama_probe, parents, context=25, batch=4)
  _assert_invariant(llama_probe, chain(16), context=3, batch=4)
  _assert_invariant(llama_probe, chain(9), context=0, batch=4)  # an empty cache
  _assert_invariant(llama_probe, chain(9), context=0, batch=2, empty=True)  # a prefill


def test_embed_scale_beside_post_norms_without_caps():
  """Gemma 3's combination (an embedding scale, post norms, no soft-caps) under XLA's default
  settings (in a child process: this suite compiles with the fusion emitters off and at level
  0, where the fault does not show). With XLA's CPU fusion emitters, the embedding's scaling was
  fused into the first residual add after a post norm as one multiply-add in some shapes and not
  in others, so every row of a T-token call differed from its one-token forward in the last bits
  (real Gemma 3 270M: by ~1e-4 in the logits). The probe, like decoding, compiles with the
  elemental emitters (specjax/compile_options.py); this fails with the fusion emitters."""
  import os
  import subprocess
  import sys

  code = ("from specjax import packing\n"
          "from specjax.invariance import BatchInvariance\n"
          "from tests.helpers.models import tiny_model\n"
          "m = tiny_model(seed=3, arch='gemma', norm='rms', activation='gelu_tanh', qk_norm=True,"
          " post_norms=True, layer_windows=(6, 0), tie_word_embeddings=True,"
          " embed_scale=32 ** 0.5)\n"
          "r = BatchInvariance(packing.pack(m), cache_len=96).check_chains((1, 2, 8), context=30)\n"
          "print({t: str(x) for t, x in r.items()})\n"
          "print('ok' if all(x.ok for x in r.values()) else 'differs')\n")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                       text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip().endswith("ok"), out.stdout


def test_every_family_op():
  probe = BatchInvariance(packing.pack(_gemma_like()), cache_len=96)
  _assert_chains(probe, (1, 2, 7, 8, 16, 33), context=30)
  _assert_invariant(probe, TREES[1], context=12, batch=4)


def test_bfloat16_weights_and_activations():
  """A bf16 model on the kernels: float32 activations rounded to bf16 into products in
  vdpbf16ps's arithmetic (the instruction or its fp32-FMA form: the same bits), the new K/V
  entries rounded to the bf16 cache, attention read into float32 on the attention kernel."""
  model = sj.Model.random(tiny_model().config, seed=0, scale=0.3, dtype=jnp.bfloat16)
  probe = BatchInvariance(packing.pack(model), cache_len=96)
  _assert_chains(probe, (1, 8, 64), context=30)
  _assert_invariant(probe, TREES[1], context=12, batch=4)


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_gguf_blocks_float_and_int8_activations(tmp_path, activations):
  """Products over a GGUF's own blocks: float32 activations (the blocks kernel) and int8 ones
  (the W4A8 target: the integer-dot kernel for Q4_0 / Q4_1, XLA's integer dot for the Q8_0
  head, a fixed-order epilogue)."""
  path = write_gguf(tmp_path / "t.gguf", types={"attn_output.weight": "Q4_0"})
  model = sj.load_model(path, tokenizer=False, weights="blocks", activations=activations)
  probe = BatchInvariance(model, cache_len=96)
  _assert_chains(probe, (1, 2, 5, 8, 13, 16, 31, 32, 64), context=20)
  _assert_invariant(probe, TREES[0], context=9, batch=4)


def test_gguf_k_quants_int8_activations(tmp_path):
  """The W4A8 target over Gemma 3's block types: Q5_0 (as Q8_0) beside Q8_0 in one fused QKV
  product, Q4_K (as Q4_1 blocks), Q6_K (two Q8_0 halves summed), a Q8_0 head."""
  types = {"attn_q.weight": "Q5_0", "attn_k.weight": "Q5_0", "attn_v.weight": "Q8_0",
           "attn_output.weight": "Q4_K", "ffn_gate.weight": "Q5_0", "ffn_up.weight": "Q5_0",
           "ffn_down.weight": "Q6_K"}
  path = write_gguf(tmp_path / "k.gguf", types=types, e=256, h=4, k=2, d=64, f=512)
  model = sj.load_model(path, tokenizer=False, weights="blocks", activations="int8")
  probe = BatchInvariance(model, cache_len=96)
  _assert_chains(probe, (1, 3, 16, 64), context=20)
  _assert_invariant(probe, TREES[0], context=9, batch=4)


def _planted_dense(monkeypatch):
  """A product that splits K in two halves once a call has more than one row: the kind of
  shape-dependent order a GEMM library chooses."""
  real = kernels.dense

  def dense(x, w, packed=None, *, transposed=False):
    y = real(x, w, packed, transposed=transposed)
    if int(np.prod(x.shape[:-1])) == 1:
      return y
    k = x.shape[-1] // 2
    w2 = w.T if transposed else w
    w2 = w2.reshape(x.shape[-1], -1)
    flat = x.reshape(-1, x.shape[-1])
    split = flat[:, :k] @ w2[:k] + flat[:, k:] @ w2[k:]
    return split.reshape(y.shape).astype(y.dtype)

  monkeypatch.setattr("specjax.model.dense", dense)


def test_planted_orders_fail(monkeypatch):
  # rows as wide as SmolLM2's (E = 576), where XLA's row reduction changes its order with the
  # number of rows
  model = packing.pack(tiny_model(seed=1, hidden_size=576, num_heads=9, num_kv_heads=3,
                                  head_dim=64, intermediate_size=128))
  assert BatchInvariance(model, cache_len=64).check(chain(12), context=20).ok
  with monkeypatch.context() as m:
    _planted_dense(m)
    report = BatchInvariance(model, cache_len=64).check(chain(12), context=20)
  assert not report.ok and report.max_abs > 0
  # XLA's own row reduction changes its order from 8 rows on: the norms' old form fails too
  with monkeypatch.context() as m:
    m.setattr("specjax.model.fixed_mean",
              lambda x, keepdims=False: jnp.mean(x, axis=-1, keepdims=keepdims))
    report = BatchInvariance(model, cache_len=64).check(chain(12), context=20)
  assert not report.ok


def test_bad_blocks_are_named():
  probe = BatchInvariance(tiny_model(), cache_len=16)
  with pytest.raises(ValueError, match="parents"):
    probe.check((0, 1))
  with pytest.raises(ValueError, match="parents"):
    probe.check((-1, 2, 0))
  with pytest.raises(ValueError, match="context=0"):
    probe.check(chain(2), context=4, empty=True)


@pytest.mark.slow
def test_smollm2_float32_and_w4a8(smollm2):
  """The real model's widths and depth, float32 (the default load: a chain at one token and at
  the 64-row limit) and the W4A8 target (16 tokens, a tree at batch 4), a 200-token context.
  (Every width and tree on the tiny models above; float32 activations over the blocks: the tiny
  GGUF.) On the path in use only: that every path gives the same bits is a property of the
  kernels, checked at every width on the tiny models; the scalar path at SmolLM2's size cost CI
  minutes."""
  probe = BatchInvariance(smollm2, cache_len=288)
  _assert_chains(probe, (1, 64), context=200, every=False)
  model = sj.load_model("smollm2-135m", weights="blocks", activations="int8")
  probe = BatchInvariance(model, cache_len=288)
  _assert_chains(probe, (1, 16), context=200, every=False)
  _assert_invariant(probe, TREES[1], context=200, batch=4, every=False)
