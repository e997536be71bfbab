"""One C++ kernel library as Python sees it: built on first use (build.py), loaded once per
process through ctypes, its instruction-set path chosen at run time, its FFI target registered.

Each kernel module (matmul.py, blocks.py, qdot.py, attention.py) holds one `Library` and exposes
at least its `available`, `isa` and `set_isa`. The C++ side of every library exports
`<prefix>_isa`, `<prefix>_detected_isa`, `<prefix>_set_isa(int)` and `<prefix>_threads` beside
its XLA FFI handler (handler.h's SJ_LIBRARY_EXPORTS; isa.h holds the parts and the dispatch).

Environment: SPECJAX_KERNELS=0 (all kernels off), SPECJAX_KERNELS_ISA=avx512|avx2|scalar (force a
path; an error if the CPU lacks it).
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from typing import Callable

import jax

from specjax.kernels import build

ENV = "SPECJAX_KERNELS"
ISAS = {"scalar": 0, "avx2": 1, "avx512": 2}


class KernelFallbackWarning(UserWarning):
  """The CPU kernels are unavailable here; specjax uses XLA's dot instead (same results)."""


def on_cpu(kernel: Callable, fallback: Callable, *args):
  """kernel(*args) where the computation is compiled for a CPU, fallback(*args) elsewhere.

  The kernels are XLA FFI targets registered for the CPU alone, and a packed copy says nothing
  about where a program runs (a model packed on the host, then placed on a GPU; a quantized
  self-draft's copies on a TPU). The choice is made when XLA lowers the program for its platform
  (jax.lax.platform_dependent: only the branch for that platform is lowered), not from
  jax.default_backend() at trace time."""
  return jax.lax.platform_dependent(*args, cpu=kernel, default=fallback)


def rows_of(x):
  """x as a product kernel takes it: as it is with two dimensions or more ([B, T, K]: the
  handlers read M as the product of the leading ones; a reshape around every product makes XLA's
  simplifier move reshapes through the residual stream one operation per pass until its
  iteration limit; handler.h), a vector as one row."""
  return x if x.ndim >= 2 else x[None]


def switched_off() -> bool:
  """Whether SPECJAX_KERNELS turns the kernels off ("0", "false", "off", "no")."""
  return os.environ.get(ENV, "").strip().lower() in ("0", "false", "off", "no")


class Library:
  """name: the build table's entry (build.LIBRARIES); prefix: the C symbols' prefix; handler:
  the FFI handler's symbol, registered as `target`; lacking: why a CPU below AVX2 gets no kernel;
  instead: what runs instead (for the one warning a failed load gives); detect(lib) -> the best
  ISA code (a hook the module resolves late, so tests can simulate another CPU); setup(lib):
  further ctypes declarations; switchable: whether SPECJAX_KERNELS=0 makes `available` False (the
  blocks module's does not: its products check the switch themselves, as before); more: further
  (handler symbol, target) pairs the library registers beside the first."""

  def __init__(self, name: str, prefix: str, handler: str, target: str, *, lacking: str,
               instead: str, detect: Callable, setup: Callable | None = None,
               switchable: bool = True, more: tuple = ()):
    self.name, self.prefix, self.handler, self.target = name, prefix, handler, target
    self.more = tuple(more)
    self.lacking, self.instead, self.detect, self.setup = lacking, instead, detect, setup
    self.switchable = switchable
    self._lock = threading.Lock()
    self.state: dict = {"tried": False, "lib": None, "reason": None, "registered": False}

  def load(self, cxx: str | None = None, cache_dir: str | None = None):
    """The loaded library (ctypes.CDLL), building it on first use; None if unavailable. Tried
    once per process: a failure warns once (KernelFallbackWarning) and is remembered."""
    with self._lock:
      if self.state["tried"]:
        return self.state["lib"]
      self.state["tried"] = True
      try:
        self.state["lib"] = self._load(cxx, cache_dir)
      except Exception as e:  # noqa: BLE001 -- any failure means: fall back, and say why once
        self.state["reason"] = str(e)
        warnings.warn(f"specjax.kernels.{self.name} unavailable, {self.instead}: {e}",
                      KernelFallbackWarning, stacklevel=4)
      return self.state["lib"]

  def _fn(self, lib, suffix: str):
    return getattr(lib, f"{self.prefix}_{suffix}")

  def _load(self, cxx, cache_dir):
    lib = ctypes.CDLL(build.build(cxx, cache_dir, library=self.name))
    for suffix in ("isa", "detected_isa", "set_isa", "threads"):
      self._fn(lib, suffix).restype = ctypes.c_int
    self._fn(lib, "set_isa").argtypes = [ctypes.c_int]
    if self.setup is not None:
      self.setup(lib)
    forced = os.environ.get("SPECJAX_KERNELS_ISA", "").strip().lower()
    if forced:
      if forced not in ISAS:
        raise ValueError(f"SPECJAX_KERNELS_ISA={forced!r}: expected one of {sorted(ISAS)}")
      if self._fn(lib, "set_isa")(ISAS[forced]) != ISAS[forced]:
        raise RuntimeError(f"SPECJAX_KERNELS_ISA={forced}: this CPU does not support it")
    else:
      best = self.detect(lib)
      if best < ISAS["avx2"]:
        raise RuntimeError(self.lacking)
      self._fn(lib, "set_isa")(best)
    if not self.state["registered"]:  # once per process, even if a test makes us load again
      for handler, target in ((self.handler, self.target), *self.more):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, handler)),
                                    platform="cpu")
      self.state["registered"] = True
    return lib

  def require(self):
    """The library, or a RuntimeError saying why it is unavailable."""
    lib = self.load()
    if lib is None:
      raise RuntimeError(f"specjax.kernels.{self.name} unavailable: {self.state['reason']}")
    return lib

  def available(self) -> bool:
    """Whether the kernel is switched on (SPECJAX_KERNELS, where switchable), built, loaded and
    worth using on this CPU (builds it on first call; switched off, nothing is built)."""
    return not (self.switchable and switched_off()) and self.load() is not None

  def isa(self) -> str | None:
    """The path in use ("avx512", "avx2", "scalar"), or None if unavailable."""
    lib = self.load()
    return None if lib is None else {v: k for k, v in ISAS.items()}[self._fn(lib, "isa")()]

  def set_isa(self, name: str) -> str:
    """Forces a path the CPU supports (tests run all of them); returns the path now in use."""
    if name not in ISAS:
      raise ValueError(f"name={name!r}: expected one of {sorted(ISAS)}")
    code = self._fn(self.require(), "set_isa")(ISAS[name])
    return {v: k for k, v in ISAS.items()}[code]

  def threads(self) -> int:
    """The thread-pool size (1 when unavailable)."""
    lib = self.load()
    return 1 if lib is None else self._fn(lib, "threads")()

  def api(self) -> tuple:
    """(load, available, isa, set_isa, threads): what each kernel module exposes as its own."""
    return self.load, self.available, self.isa, self.set_isa, self.threads

  def reset(self) -> None:
    """Forgets the load attempt, so the next call retries (tests of the fallback paths)."""
    with self._lock:
      self.state.update(tried=False, lib=None, reason=None)
