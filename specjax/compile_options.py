"""XLA compiler options chosen by the size of the weights a program reads.

XLA's CPU fusion emitters generate faster code for large operands but take ~40% longer to compile
a method's program (measured on the test suite's tiny models: 30 -> 18 s of compiles for four
methods' programs). For weights under SMALL_WEIGHTS_BYTES a program's run takes milliseconds and
its compile is nearly all of a call's time, so such programs are compiled with XLA's elemental
emitters instead. SmolLM2-135M (96 MB of GGUF blocks, 538 MB in float32) is far above the bound,
and for it the elemental emitters would not pay: its autoregressive program compiled in 9.6 s
with them against 5.6 s without (EAGLE's: 13.3 against 8.3 s), and 48 tokens decoded about as
fast (one run each).

Both emitters generate IEEE float32 arithmetic, and the choice depends on the weights alone (the
target's for a decoding program, so every method's program and the autoregressive baseline's get
the same options and agree bit for bit; tests/methods/test_lossless.py runs under it).

The choice is stated either way (fusion emitters on at or above the bound), so a process-wide
`XLA_FLAGS=--xla_cpu_use_fusion_emitters=false` changes only the programs compiled without these
options (jax's eager operations, a user's own jits). The test suite runs that way (conftest;
`pytest -n 2`: tests/methods/test_lossless.py and test_tree.py 246 -> 220 s, test_model.py,
test_weights_blocks.py and test_medusa.py 163 -> 143 s), and the real models' decoding and
training programs keep the fusion emitters.
"""

from __future__ import annotations

import jax

SMALL_WEIGHTS_BYTES = 4 << 20


def for_weights(*trees) -> dict | None:
  """Options for `Lowered.compile` / `jax.jit(compiler_options=...)` for a program reading the
  arrays in `trees`, on CPU: the elemental emitters (fast to compile) when they total under
  SMALL_WEIGHTS_BYTES, the fusion emitters (fast code) otherwise; None off CPU."""
  if jax.default_backend() != "cpu":
    return None
  nbytes = sum(getattr(x, "nbytes", 0) for x in jax.tree_util.tree_leaves(trees))
  return {"xla_cpu_use_fusion_emitters": nbytes >= SMALL_WEIGHTS_BYTES}
