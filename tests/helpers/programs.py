"""What a compiled decode program holds: copies of its KV cache inside the decode loop."""

from __future__ import annotations

import re

from specjax import breakdown


def cache_copies_in_loop(method, config, batch: int) -> int:
  """Copies of a whole cache (f32[batch, kv heads, S, head_dim], S the program's capacity: the
  target's cache, or a draft's of the same shape) in the last program `generate` compiled for
  `method`, outside its entry computation: in the decode loop and its branches, where a copy is
  paid on every step. (A copy inside a fused computation is a step of a fused kernel's
  arithmetic, not a buffer's copy.)"""
  prog, compiled = breakdown.compiled_program(method)
  hlo = compiled.as_text()
  shape = re.escape(f"f32[{batch},{config.num_kv_heads},{prog.max_len},{config.head_dim}]")
  n, skip = 0, False  # skip: in the entry computation or a fusion's
  for line in hlo.splitlines():
    if not line.startswith(" ") and line.rstrip().endswith("{"):
      skip = line.startswith("ENTRY") or line.startswith("%fused")
    elif not skip and re.search(rf"= {shape}\{{[0-9,]+\}} copy\(", line):
      n += 1
  return n
