"""The lossless suite's greedy identity on bfloat16 targets (issue 46, item 3): bf16 weights and
activations into the CPU kernels' products, float32 sums in a fixed order, float32 attention.
Those give every row of a T-token forward the bits of a one-token forward
(tests/test_invariance.py), so identity with bf16 autoregressive decoding is required here, as in
float32 (the tie-aware criterion of specjax/exactness.py is for arithmetic that is not
batch-invariant: XLA's, tests/test_exactness.py).

Every registered method on a tiny bf16 model (random drafters, specjax.exactness's settings),
batch 4 of mixed prompt lengths against each prompt decoded alone; and methods by name on the
embedded SmolLM2 in bf16 (the hybrid, its shipped EAGLE heads). Gemma 3 270M in bf16:
tests/arch/test_gemma3_270m.py.
experiments/bf16 runs every method by name on both real models.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import specjax as sj
from specjax import decode, exactness, packing

from tests.helpers.models import assert_same_greedy, random_prompts, tiny_config

NEW = 16


@pytest.fixture(scope="module")
def target():
  model = packing.pack(sj.Model.random(tiny_config(), seed=0, scale=0.3, dtype=jnp.bfloat16))
  assert packing.on_kernel(model), "the bf16 tiny model must run on the kernels"
  return model


@pytest.fixture(scope="module")
def prompts(target):
  return random_prompts(4, target.config.vocab_size, seed=1, lo=3, hi=16)


@pytest.fixture(scope="module")
def reference(target, prompts):
  return [sj.generate(target, [p], max_new_tokens=NEW).tokens[0] for p in prompts]


@pytest.mark.parametrize("name", [m for m in sj.METHODS if m != "autoregressive"])
def test_bf16_greedy_identical_batch4(name, target, prompts, reference):
  method = exactness.build_method(name, target)
  out = sj.generate(target, prompts, method, max_new_tokens=NEW)
  assert_same_greedy(target, prompts, reference, out.tokens,
                     f"{name} on a bf16 target differs from bf16 autoregressive decoding")


@pytest.mark.parametrize("name", ["autoregressive", "eagle", "dflash"])
def test_bf16_decoding_keeps_no_float32_table(name, target, prompts):
  """XLA computes a bf16 lookup in float32, as a convert of the table fused into the slice; with
  the table a loop invariant it hoisted that convert out of the decoding loop (SmolLM2's [V,E]
  embedding converted every call, ~30 ms). The programs hold no float32 table, made whole or
  carried through the loop."""
  method = exactness.build_method(name, target)
  decode.compile_cache.clear()  # (an equal method may have compiled for another model)
  sj.generate(target, prompts[:1], method, max_new_tokens=4)
  texts = [c.as_text() for c in decode.compile_cache.programs.values()]
  assert texts, "no program compiled"
  c = target.config
  made = rf"= f32\[{c.vocab_size},{c.hidden_size}\]\S* (fusion|copy|get-tuple-element)\("
  for text in texts:
    assert not re.search(made, text), f"{name}: a float32 copy of the embedding table"


def test_bf16_cache_goes_to_the_attention_kernel_as_it_is(target):
  """The attention kernel reads a bf16 cache itself (widening the slots it reads): the model's
  forward passes it the cache as bf16, not a float32 copy of every slot in every layer."""
  from specjax import cache as kv
  cache = kv.rollback(target.init_cache(1, 32), jnp.array([5]))
  toks, pos = jnp.zeros((1, 3), jnp.int32), 5 + jnp.arange(3)[None]
  mask = kv.causal_mask(cache.lengths, 3, 32)
  text = jax.jit(lambda p, c: target.apply(p, toks, pos, c, mask)[0]).lower(
      target.params, cache).as_text()
  calls = re.findall(r"custom_call @specjax_attention_f32\(.*\} : \(([^)]*)\)", text)
  assert calls, "the forward does not attend on the kernel"
  c = target.config
  for operands in calls:
    types = [t.strip() for t in operands.split(",")]
    assert types[1] == types[2] == f"tensor<1x{c.num_kv_heads}x32x{c.head_dim}xbf16>", types


@pytest.mark.slow
def test_smollm2_bf16_hybrid_by_name():
  """SmolLM2 in bf16 (its GGUF dequantized to bf16): the hybrid by name (prompt lookup's copies
  and the shipped EAGLE heads in one tree, the heads in bf16 beside the target) gives bf16
  autoregressive decoding's tokens, batch 2."""
  model = sj.load_model("smollm2-135m", dtype=jnp.bfloat16)
  assert packing.on_kernel(model) and "bfloat16" in repr(model)
  prompts = ["Write a python function that reverses a list.", "Tell me about the moon."]
  ref = sj.generate(model, prompts, max_new_tokens=32, chat=True).tokens
  out = sj.generate(model, prompts, "hybrid", max_new_tokens=32, chat=True)
  assert out.tokens == ref, "hybrid on bf16 SmolLM2 differs from its autoregressive decoding"
  assert out.stats["mean_accepted"] > 1.0, "hybrid: no draft accepted, a weak check"
