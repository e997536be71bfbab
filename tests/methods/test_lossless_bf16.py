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

import jax.numpy as jnp
import pytest

import specjax as sj
from specjax import exactness, packing

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
