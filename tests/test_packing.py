"""packing.to_blocks: a float32 model on GGUF blocks of its own (a draft model beside a target on
`weights="blocks"`), its weights rounded by gguf's reference quantizer, its few-row products on
the blocks kernel computing what XLA computes on the rounded weights; speculative decoding with
it as the draft stays exact."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax import packing
from specjax.errors import InputError

from tests.helpers.gguf_files import logits
from tests.helpers.models import random_prompts, tiny_model


def small(seed=2, **kw):
  base = dict(intermediate_size=64, vocab_size=64)
  base.update(kw)
  return packing.maybe_pack(tiny_model(seed=seed, **base), None)


def leaves(model):
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(model.params)}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_weights_rounded_and_products_on_the_blocks_kernel(qtype, tied):
  m = small(tie_word_embeddings=tied)
  before = leaves(m)
  b = packing.to_blocks(m, qtype)
  copies = {k: v for k, v in leaves(b).items() if packing.PREFIX in k}
  assert len(copies) == 4 * 2 + 1 and all(v.dtype == np.uint8 for v in copies.values())
  assert b.weights == "blocks" and b.blocks_qtype == qtype
  assert repr(b).endswith(", GGUF blocks x float32 activations)")
  # A parameter holds its blocks' numbers: gguf's dequantize of gguf's quantize of the original.
  e = m.config.hidden_size
  wo = np.asarray(m.params["layers"][0]["attn"]["wo"][...]).reshape(-1, e)  # [K, N]
  _, values = packing.quantize_rows(wo.T, qtype)
  got = np.asarray(b.params["layers"][0]["attn"]["wo"][...]).reshape(-1, e)
  np.testing.assert_array_equal(got, values.T)
  assert not np.array_equal(got, wo)
  head = "embed" if tied else "lm_head"
  assert not np.array_equal(np.asarray(b.params[head][...]), np.asarray(m.params[head][...]))
  # The blocks kernel (1 and 5 rows) and XLA (70 rows; the model without its copies) agree up
  # to summation order (attention included), far closer than the original weights' logits.
  plain = packing.unpack(b)
  for t in (1, 5, 70):
    toks = jnp.asarray(np.random.default_rng(t).integers(0, 64, (1, t)))
    la, lb = logits(plain, toks), logits(b, toks)
    scale = np.abs(la).max()
    assert np.abs(la - lb).max() <= 1e-4 * scale, t
    assert np.abs(logits(m, toks) - lb).max() > 1e-3 * scale, t
  # The model it was made from is untouched.
  after = leaves(m)
  assert after.keys() == before.keys()
  assert all(np.array_equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_a_blocks_draft_is_lossless_with_a_vocabulary_subset(qtype):
  target = small(seed=0)
  draft = packing.to_blocks(small(seed=5, num_layers=1), qtype, head=False)
  assert packing.PREFIX + "head" not in str(jax.tree_util.tree_structure(draft.params))
  ids = np.arange(0, 64, 2)  # 32 rows: the subset head is quantized and packed as blocks
  sub = packing.subset_head(draft, ids)
  assert sub[packing.PREFIX + "head"].dtype == jnp.uint8
  rows = np.asarray(draft.params["lm_head"][...]).T[ids]
  np.testing.assert_array_equal(np.asarray(sub["head"]), packing.quantize_rows(rows, qtype)[1])
  prompts = [p + p for p in random_prompts(4, 64, seed=1, lo=3, hi=12)]
  ref = sj.generate(target, prompts, max_new_tokens=20).tokens
  for vocab in (None, ids):
    out = sj.generate(target, prompts, sj.DraftModel(draft, gamma=3, vocab=vocab),
                      max_new_tokens=20)
    assert out.tokens == ref


def test_bad_input_is_named():
  m = small()
  with pytest.raises(InputError, match="qtype='Q5_K' is invalid: must be one of Q8_0, Q4_0, Q4_1"):
    packing.to_blocks(m, "Q5_K")
  with pytest.raises(InputError, match=r"layers\.0\.mlp\.w_out has K=48, not a multiple of 32"):
    packing.to_blocks(small(intermediate_size=48), "Q8_0")
  bf16 = sj.Model.random(m.config, seed=0, dtype=jnp.bfloat16)
  with pytest.raises(InputError, match="a float32 model on one CPU device; got dtype=bfloat16"):
    packing.to_blocks(bf16, "Q8_0")
