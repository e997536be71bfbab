"""specjax.breakdown: each method's time per round split into draft / verify / other, read from a
profile of the compiled loop (tiny models; the times are real, their sizes are not checked)."""

from __future__ import annotations

import pytest

import specjax as sj
from specjax import breakdown

from tests.helpers.models import random_prompts, tiny_model


@pytest.fixture(scope="module")
def target():
  return tiny_model(seed=0, num_layers=2)


def run(target, method):
  return breakdown.breakdown(target, random_prompts(2, 61, seed=3), method, max_new_tokens=12)


def test_autoregressive_is_all_verify(target):
  r = run(target, sj.Autoregressive())
  assert r["rounds"] == 11  # 12 tokens: the prefill's first, then one per round
  assert r["per_round_ms"]["draft"] == 0 and r["ops_per_round"]["draft"] == 0
  assert r["per_round_ms"]["verify"] > 0 and r["share"]["verify"] > 0.5
  assert r["prefill_ms"] > 0
  assert abs(sum(r["share"].values()) - 1) < 1e-9


@pytest.mark.parametrize("make", [
    lambda t: sj.DraftModel(draft=tiny_model(seed=5, num_layers=1), gamma=3),
    lambda t: sj.SelfSpeculative(exit_layer=1, gamma=3),  # the target's own layers, as drafting
    lambda t: sj.PromptLookup(ngram=1, num_tokens=3),
], ids=["draft", "layer-skip", "prompt-lookup"])
def test_speculative_methods_draft_and_verify(target, make):
  r = run(target, make(target))
  assert r["ops_per_round"]["draft"] > 0 and r["per_round_ms"]["draft"] > 0
  assert r["ops_per_round"]["verify"] > 0 and r["per_round_ms"]["verify"] > 0
  assert r["rounds"] >= 1 and r["mean_accepted"] >= 1


def test_phase_map_reads_loop_bodies_and_branches():
  hlo = """HloModule m

%branch_a (p: f32[]) -> f32[] {
  %p = f32[] parameter(0)
  ROOT %x.1 = f32[] add(%p, %p), metadata={op_name="jit(f)/while/body/cond/sj_verify/add"}
}

%branch_b (p: f32[]) -> f32[] {
  %p = f32[] parameter(0)
  ROOT %x.2 = f32[] multiply(%p, %p), metadata={op_name="jit(f)/while/body/sj_draft/sj_verify/mul"}
}

%body (p: f32[]) -> f32[] {
  %p = f32[] parameter(0)
  %c = f32[] conditional(%i, %p, %p), branch_computations={%branch_a, %branch_b}, metadata={op_name="jit(f)/while/body/cond"}
  ROOT %x.3 = f32[] add(%c, %p), metadata={op_name="jit(f)/while/body/add"}
}

ENTRY %main (p: f32[]) -> f32[] {
  %p = f32[] parameter(0)
  %x.4 = f32[] add(%p, %p), metadata={op_name="jit(f)/sj_verify/add"}
  ROOT %w = f32[] while(%x.4), condition=%cond, body=%body, metadata={op_name="jit(f)/while"}
}
"""
  assert breakdown.phase_map(hlo) == {"x.1": "verify", "x.2": "draft", "x.3": "other",
                                      "x.4": "prefill"}
