"""The kernels' house (specjax/kernels/build.py, library.py): every header a kernel includes is in
its build key and in the package data, and a kernel that cannot be built says so once. Nothing
here compiles."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import tomllib
import warnings

import pytest

from specjax.kernels import build
from specjax.kernels.library import KernelFallbackWarning, Library

HERE = os.path.dirname(build.__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))


def _includes(path: str) -> set[str]:
  """The headers beside the kernels that `path` includes (jaxlib's XLA FFI headers are not)."""
  with open(path) as f:
    names = re.findall(r'^\s*#\s*include\s+"([^"]+)"', f.read(), re.M)
  return {n for n in names if os.path.isfile(os.path.join(HERE, n))}


def test_every_header_is_in_the_key_and_the_package_data():
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    data = tomllib.load(f)["tool"]["setuptools"]["package-data"]["specjax"]
  for name in build.LIBRARIES:
    source, _, _, headers = build._library(name)
    ours = _includes(source)
    for h in list(ours):
      ours |= _includes(os.path.join(HERE, h))
    assert {"isa.h", "handler.h", "pool.h"} <= ours, name
    assert {os.path.basename(h) for h in headers} == ours, name
    for path in (source, *headers):
      rel = os.path.relpath(path, os.path.join(ROOT, "specjax"))
      assert any(fnmatch.fnmatch(rel, g) for g in data), f"{rel} is not in the package data"


def test_an_edited_header_builds_anew(monkeypatch, tmp_path):
  """Editing pool.h (or any included header) changes every library's key: no stale library."""
  for f in os.listdir(HERE):
    if f.endswith((".cc", ".h")):
      shutil.copy(os.path.join(HERE, f), tmp_path / f)
  monkeypatch.setattr(build, "__file__", str(tmp_path / "build.py"))
  before = {name: build.build_key(name) for name in build.LIBRARIES}
  with open(tmp_path / "pool.h", "a") as f:
    f.write("\n// an edit\n")
  after = {name: build.build_key(name) for name in build.LIBRARIES}
  assert all(before[n] != after[n] for n in build.LIBRARIES)


@pytest.mark.parametrize("name", sorted(build.LIBRARIES))
def test_a_kernel_that_cannot_be_built_says_so_once(monkeypatch, tmp_path, name):
  """No compiler (a wheel on a machine without one): one warning naming the kernel and the
  reason, then the fallback, silently."""
  monkeypatch.setenv("SPECJAX_CXX", "no-such-compiler-here")
  lib = Library(name, "specjax_x", "SpecjaxX", "specjax_x", lacking="", instead="using XLA",
                detect=lambda lib: 2)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert lib.load(cache_dir=str(tmp_path)) is None and not lib.available()
    assert lib.isa() is None and lib.threads() == 1
  said = [str(w.message) for w in caught if issubclass(w.category, KernelFallbackWarning)]
  assert len(said) == 1, said
  assert f"specjax.kernels.{name} unavailable, using XLA" in said[0]
  assert "no-such-compiler-here" in said[0] and "not found" in said[0]
