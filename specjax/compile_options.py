"""XLA compiler options for the programs whose rows must be batch-invariant: decoding, training
steps over a target, the cost curve's probe and the batch-invariance probe.

On CPU they are compiled with XLA's elemental emitters (`xla_cpu_use_fusion_emitters=False`),
whatever the weights' size. XLA's newer CPU fusion emitters do not give an element the same bits
in every shape: measured on 2026-11-29 (jaxlib 0.10.2), a Gemma-like model's rows of a T-token
call differed from its one-token forwards with them and were identical without them, and so did
Gemma 3 270M's in bf16 (up to 0.8 in the logits, one batch row per probed case: specjax
bench's lossless runs gave 55 of 88 identical). Batch invariance is what makes speculation
exact here, so decoding never uses them. What they would buy: faster compiles (SmolLM2's
autoregressive program 5.6 s against 9.6 s) and, in one probe, a bf16 forward ~7% faster; the
W4A8 forward ran alike. tests/test_invariance.py checks a Gemma-like model under these options
in a child process at XLA's default settings (the suite itself runs with the fusion emitters
off and at optimization level 0, see tests/conftest.py, where neither fault shows).
"""

from __future__ import annotations

import jax

def options() -> dict | None:
  """Options for `Lowered.compile` / `jax.jit(compiler_options=...)`: on CPU, the elemental
  emitters (see the module docstring); None off CPU."""
  if jax.default_backend() != "cpu":
    return None
  return {"xla_cpu_use_fusion_emitters": False}
