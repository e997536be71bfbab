"""A method for the driver's tests: autoregressive decoding that also keeps per-row state."""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

import specjax as sj
from specjax import decode


@flax.struct.dataclass
class _TallyState:
  steps: jax.Array  # [B] int32: not declared, so per-row by rule
  table: jax.Array = decode.replicated()  # [4] int32 that every row reads


@dataclasses.dataclass(frozen=True)
class Tally(sj.Autoregressive):
  """Autoregressive decoding that also counts each row's active steps, reading a table all rows
  share: shared=True declares the table replicated; False keeps it in a plain dict, which
  breaks the per-row rule of a method's state."""
  shared: bool = True

  def init(self, prog, arrays, state, hidden):
    z, table = jnp.zeros_like(state.seq_len), jnp.arange(4, dtype=jnp.int32)
    return _TallyState(z, table) if self.shared else {"steps": z, "table": table}

  def step(self, prog, params, arrays, state):
    m = state.method
    out = super().step(prog, params, arrays, state)
    return out.replace(method=m.replace(steps=m.steps + (~state.done) * m.table[1]))

  def stats(self, state):
    return {"tally": np.asarray(state.method.steps).tolist()}
