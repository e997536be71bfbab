"""The loop: prefill, then `lax.while_loop(method.step)` until every row is done, as one jitted
program per (Program, argument shapes), kept in `compile_cache`.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp

from specjax import compile_options
from specjax import sharding
from specjax.decode._method import Program
from specjax.decode._prefill import prefill


def _run(prog: Program, params, arrays, prompt, prompt_len, max_new, sp, key, eos):
  method = prog.method
  state, hidden = prefill(prog, params, prompt, prompt_len, max_new, sp, key, eos, method.max_emit)
  state = state.replace(method=method.init(prog, arrays, state, hidden))
  b = prompt.shape[0]
  state = prog.constrain(state, b)
  limit = prog.max_len  # every active step emits >= 1 token, so this bound is never the reason

  def cond(s):
    return jnp.any(~s.done) & (s.steps < limit)

  def body(s):
    s = method.step(prog, params, arrays, s)
    return prog.constrain(s.replace(steps=s.steps + 1), b)

  state = jax.lax.while_loop(cond, body, state)
  # The cache is large and nobody needs it back; the rest is replicated so every host can read it.
  return sharding.replicate_outputs(prog.mesh, state.replace(cache=None))


_run_jit = jax.jit(_run, static_argnums=0)


class _CompileCache:
  """Compiled programs by (Program, argument shapes). `count` tells tests when we compiled.

  Bounded: every compiled XLA CPU program keeps its JIT code in a few hundred memory mappings
  (measured ~270 for a tiny model's program), and Linux refuses new mappings past
  vm.max_map_count (65530 by default), which crashes the next compile. A process that compiles
  many programs (a long notebook, a test suite, a sweep over methods and shapes) would get
  there, so once `max_programs` are held, this cache and jax's own caches are cleared (the next
  call of each program recompiles).
  """

  def __init__(self, max_programs: int = 96):
    self.programs: dict = {}
    self.count = 0
    self.max_programs = max_programs

  def clear(self) -> None:
    """Drops every compiled program (ours and jax's caches), freeing their code."""
    self.programs.clear()
    jax.clear_caches()

  def get(self, prog: Program, args) -> tuple[Any, float]:
    shapes = tuple((x.shape, x.dtype, getattr(x, "sharding", None))
                   for x in jax.tree_util.tree_leaves(args))
    treedef = jax.tree_util.tree_structure(args)
    key = (prog, shapes, treedef)
    if key in self.programs:
      return self.programs[key], 0.0
    if len(self.programs) >= self.max_programs:
      self.clear()
    t0 = time.perf_counter()
    compiled = _run_jit.lower(prog, *args).compile(compile_options.options())
    self.count += 1
    self.programs[key] = compiled
    return compiled, time.perf_counter() - t0


compile_cache = _CompileCache()
