"""Every instruction-set path of a kernel module, and a fixture that forces one of them."""

from __future__ import annotations

import pytest


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
