"""Every product kernel takes activations with their leading dimensions as they are: x [B, T, K]
gives y [B, T, N] with the bits of the same rows passed as [B*T, K], and the compiled program holds
no reshape around the call. (A reshape on each side of every product made XLA's simplifier move
reshapes through SmolLM2's 30-layer residual stream one operation per pass, until its iteration
limit: seconds of every compile; kernels/handler.h.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import kernels
from specjax.kernels import blocks, qdot

from tests.helpers.kernels import random_q41, random_raw

B, T, K, N = 2, 3, 64, 48


def _matmul(rng):
  w = (rng.standard_normal((K, N)) / 8).astype(np.float32)
  p = jnp.asarray(kernels.pack_weight(w))
  return kernels.matmul.available(), lambda x: kernels.dense(x, w, p)


def _blocks(rng):
  raw = random_raw(rng, N, K, "Q8_0")
  p = jnp.asarray(blocks.pack_blocks(raw, N, K, "Q8_0"))
  return blocks.available(), lambda x: blocks.blocks_dense(x, p, N, K, "Q8_0")


def _qdot(rng):
  p = jnp.asarray(qdot.pack(*random_q41(rng, N, K)))
  return qdot.available(), lambda x: qdot.dense(x, p, N, K)


@pytest.mark.parametrize("make", [_matmul, _blocks, _qdot], ids=["matmul", "blocks", "qdot"])
def test_leading_dims_go_into_the_kernel_as_they_are(make):
  rng = np.random.default_rng(7)
  available, product = make(rng)
  if not available:
    pytest.skip("this kernel is unavailable here (its warning says why)")
  x = rng.standard_normal((B, T, K)).astype(np.float32)
  f = jax.jit(product)
  y = np.asarray(f(x))
  assert y.shape == (B, T, N)
  np.testing.assert_array_equal(y.reshape(B * T, N), np.asarray(f(x.reshape(B * T, K))))
  hlo = f.lower(x).compile().as_text()
  assert "custom-call" in hlo, "the product did not run in the kernel"
  assert " reshape(" not in hlo and " bitcast(" not in hlo, hlo
