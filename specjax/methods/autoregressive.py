"""Autoregressive decoding: one target call per token, the baseline every other method reproduces.

The smallest method on the driver: nothing to propose, so each step verifies only the pending
token (its K/V enter the cache), accepts nothing drafted, and emits the target's next token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax import cache as kv
from specjax import sampling
from specjax.decode import DecodeState, Method, Program, emit


@dataclasses.dataclass(frozen=True)
class Autoregressive(Method):
  """One target call per token: the baseline every other method must reproduce."""
  name: str = dataclasses.field(default="autoregressive", init=False)
  lossless: bool = dataclasses.field(default=True, init=False)
  extra_slots: int = dataclasses.field(default=1, init=False)
  max_emit: int = dataclasses.field(default=1, init=False)

  def init(self, prog, arrays, state, hidden):
    return None

  def step(self, prog: Program, params, arrays, state: DecodeState) -> DecodeState:
    cache = state.cache
    tok = state.last_token[:, None]  # [B,1]
    pos = cache.lengths[:, None]
    logits, _, cache = prog.forward(params, tok, pos, cache, prog.causal_mask(cache.lengths, 1))
    cache = kv.advance(cache, (~state.done).astype(jnp.int32))
    key, sub = jax.random.split(state.key)
    nxt = sampling.sample(sub, logits[:, 0], state.sp)
    state = state.replace(cache=cache, key=key)
    return emit(state, nxt[:, None], jnp.ones_like(state.seq_len))
