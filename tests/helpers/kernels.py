"""Every instruction-set path of a kernel module, a fixture that forces one of them, and random
packed weights for the blocks and Q4_1 kernels."""

from __future__ import annotations

import numpy as np
import pytest

from specjax.kernels import blocks


def isa_paths(lib) -> list[str]:
  """Every instruction-set path this CPU can run for one kernel module (specjax.kernels,
  kernels.attention, .blocks, .qdot); none where that kernel is unavailable."""
  if not lib.available():
    return []
  best = lib.ISAS[lib.isa()]
  return [name for name, v in lib.ISAS.items() if v <= best]


def isa_fixture(lib):
  """A fixture that forces `lib`'s instruction-set path to its parameter for one test and
  restores it after (parametrize it indirectly over isa_paths(lib))."""
  @pytest.fixture
  def isa_path(request):
    before = lib.isa()
    assert lib.set_isa(request.param) == request.param
    yield request.param
    lib.set_isa(before)
  return isa_path


def random_raw(rng, n: int, k: int, qtype: str) -> np.ndarray:
  """A GGUF tensor's bytes [N, K/block * block bytes]: random bytes, fp16 fields in
  +-[0.001, 0.1]."""
  _, block, tb, fields = blocks.QTYPES[qtype]
  nblk = k // block
  raw = rng.integers(0, 256, (n, nblk, tb), dtype=np.uint8)
  o = 0
  for size, count in fields:
    if size == 2:
      v = rng.uniform(0.001, 0.1, (n, nblk, count)) * rng.choice([-1, 1], (n, nblk, count))
      raw[..., o:o + 2 * count] = v.astype(np.float16).view(np.uint8).reshape(n, nblk, -1)
    o += size * count
  return raw.reshape(n, nblk * tb)


def random_q41(rng, n: int, k: int):
  """q uint8 [K/32, 32, N] in 0..15, d and m float32 [K/32, N] of both signs."""
  nblk = k // 32
  q = rng.integers(0, 16, (nblk, 32, n), dtype=np.uint8)
  d = (rng.uniform(0.001, 0.02, (nblk, n)) * rng.choice([-1, 1], (nblk, n))).astype(np.float32)
  m = rng.uniform(-0.1, 0.1, (nblk, n)).astype(np.float32)
  return q, d, m
