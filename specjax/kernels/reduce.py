"""Sums over the last axis in one fixed order, whatever the other axes' sizes: the reductions of
a forward (norms) that must give row r of a T-token call the bits of a one-token call.

Why. XLA's CPU backend emits a row reduction differently by shape: from 8 rows on it processes
rows together and sums each row in another order, so `jnp.mean(x, -1)` over [1, 8, E] gives row
0 other bits than over [1, 1, E] (and its dot changes order from 2 rows on). A T-token
verification then differs from the one-token steps of autoregressive decoding in the last bits
of every norm, and from there in the logits. Here the sum is a pairwise tree written as
elementwise adds of halves (the axis zero-padded to a power of two; adding +0.0 changes no
partial sum), which every backend evaluates element by element: the order is fixed by the axis
length alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def fixed_sum(x: jax.Array, axis: int = -1) -> jax.Array:
  """x -> x summed over `axis` (removed) as a pairwise tree (halves added elementwise, log2(N)
  levels); the same bits for an element whatever the other axes' sizes are."""
  ax = axis % x.ndim
  n = x.shape[ax]
  width = 1 << max(0, n - 1).bit_length()
  if width != n:
    pad = [(0, 0)] * x.ndim
    pad[ax] = (0, width - n)
    x = jnp.pad(x, pad)
  while x.shape[ax] > 1:
    half = x.shape[ax] // 2
    x = jax.lax.slice_in_dim(x, 0, half, axis=ax) + jax.lax.slice_in_dim(x, half, 2 * half,
                                                                          axis=ax)
  return jnp.squeeze(x, ax)


def fixed_mean(x: jax.Array, keepdims: bool = False) -> jax.Array:
  """The mean over the last axis from `fixed_sum` (times 1/N, rounded once)."""
  m = fixed_sum(x) * jnp.asarray(1.0 / x.shape[-1], x.dtype)
  return m[..., None] if keepdims else m
