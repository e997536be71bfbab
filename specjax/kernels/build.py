"""Builds specjax's C++ kernels with the system C++ compiler into a per-user cache, once.

Each library in LIBRARIES (the fp32 matmul, the GGUF-blocks matmul, the Q4_1 integer dot, decode
attention) is one
source compiled once per instruction-set part and linked into its own shared library.

The shared library lands in `$SPECJAX_CACHE/kernels/<key>/` (default `~/.cache/specjax`), where
<key> hashes the source and every header of ours it includes (found by reading its `#include
"..."` lines, so a header cannot be left out of the key: isa.h, handler.h, pool.h), the build
flags, the machine architecture and the installed jaxlib version (the XLA FFI headers come from
that jaxlib), so a new jaxlib or an edited kernel or header builds a new library and an old one is
never loaded against the wrong headers. A build holds a lock file
beside the library (`<library>.lock`, flock), so processes that need the same library at once
(a test run's workers on a fresh cache) compile it once: the others wait, then load it. It
writes to a temporary name and renames it into place, so a reader never sees half a library.

The compiler is `$SPECJAX_CXX`, else `$CXX`, else `c++`/`g++` on PATH.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile

LIB_NAME = "libspecjax_kernels.so"
BASE_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-Wall")
# (part, extra flags); the ISA-specific parts only on x86-64.
PARTS_X86 = (("SJ_MAIN", ()), ("SJ_AVX512", ("-mavx512f", "-mavx512vl", "-mavx2", "-mfma")),
             ("SJ_AVX2", ("-mavx2", "-mfma")), ("SJ_SCALAR", ()))
PARTS_OTHER = (("SJ_MAIN", ()), ("SJ_SCALAR", ()))
# name -> (source, library file, extra flags per part (or "*" for every part)). blocks.cc needs
# F16C on its AVX2 path (fp16 scales) and no FMA contraction (its dequantised weights round as the
# reference's do).
LIBRARIES = {
    "matmul": ("matmul.cc", LIB_NAME, {"*": ("-ffp-contract=off",)}),
    "blocks": ("blocks.cc", "libspecjax_blocks.so",
               {"*": ("-ffp-contract=off",), "SJ_AVX2": ("-mf16c",)}),
    # qdot.cc's AVX-512 path needs BW and VNNI (vpdpbusd), its AVX2 path F16C (fp16 scales); no
    # contraction, so that every path folds the blocks with the same explicit fmas.
    "qdot": ("qdot.cc", "libspecjax_qdot.so",
             {"*": ("-ffp-contract=off",), "SJ_AVX512": ("-mavx512bw", "-mavx512vnni"),
              "SJ_AVX2": ("-mf16c",)}),
    # attention.cc: no contraction (its arithmetic names every fma); the avx512 part runs the
    # AVX2 code, so it needs FMA.
    "attention": ("attention.cc", "libspecjax_attention.so",
                  {"*": ("-ffp-contract=off",), "SJ_AVX512": ("-mfma",)}),
}
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


class BuildError(RuntimeError):
  """The kernels could not be built (no compiler, a compile error, ...); the message says why."""


def user_cache(*parts: str) -> str:
  """specjax's per-user cache folder, `$SPECJAX_CACHE` else `~/.cache/specjax`, joined with parts
  (the kernels build under "kernels", specjax.calibrate keeps cost curves under "calibration")."""
  root = os.environ.get("SPECJAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "specjax"))
  return os.path.join(root, *parts)


def cache_root() -> str:
  return user_cache("kernels")


def find_compiler(cxx: str | None = None) -> str:
  """The C++ compiler to use: the argument, $SPECJAX_CXX, $CXX, or c++ / g++ on PATH."""
  for cand in (cxx, os.environ.get("SPECJAX_CXX"), os.environ.get("CXX")):
    if cand:
      path = shutil.which(cand)
      if path is None:
        raise BuildError(f"C++ compiler {cand!r} not found")
      return path
  for cand in ("c++", "g++", "clang++"):
    path = shutil.which(cand)
    if path:
      return path
  raise BuildError("no C++ compiler found (tried c++, g++, clang++; set SPECJAX_CXX)")


def _parts():
  return PARTS_X86 if platform.machine() in ("x86_64", "AMD64") else PARTS_OTHER


def headers(source: str) -> tuple[str, ...]:
  """The paths of the headers of ours that `source` includes, directly or through one another
  (`#include "name"` lines naming a file beside it; the XLA FFI headers come from jaxlib, whose
  version is in the key), sorted."""
  found, todo = set(), [source]
  while todo:
    with open(todo.pop()) as f:
      for name in _INCLUDE.findall(f.read()):
        path = os.path.join(os.path.dirname(source), name)
        if os.path.isfile(path) and path not in found:
          found.add(path)
          todo.append(path)
  return tuple(sorted(found))


def _library(library: str):
  if library not in LIBRARIES:
    raise ValueError(f"library={library!r}: expected one of {sorted(LIBRARIES)}")
  source, lib_name, extra = LIBRARIES[library]
  source = os.path.join(os.path.dirname(__file__), source)
  return source, lib_name, extra, headers(source)


def build_key(library: str = "matmul") -> str:
  import jaxlib

  source, _, extra, headers = _library(library)
  h = hashlib.sha256()
  for path in (source, *headers):
    with open(path, "rb") as f:
      h.update(f.read())
  h.update(repr((BASE_FLAGS, _parts(), platform.machine(), jaxlib.__version__)).encode())
  h.update(repr(sorted(extra.items())).encode())
  return h.hexdigest()[:16]


def library_path(cache_dir: str | None = None, library: str = "matmul") -> str:
  return os.path.join(cache_dir or cache_root(), build_key(library), _library(library)[1])


def build(cxx: str | None = None, cache_dir: str | None = None, *, force: bool = False,
          library: str = "matmul") -> str:
  """Returns the path of the built library, compiling it first if the cache lacks it."""
  import jax

  source, lib_name, extra, _ = _library(library)
  out = library_path(cache_dir, library)
  if os.path.isfile(out) and not force:
    return out
  compiler = find_compiler(cxx)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out + ".lock", "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    if os.path.isfile(out) and not force:  # another process built it while this one waited
      return out
    _compile(compiler, source, lib_name, extra, jax.ffi.include_dir(), out)
  return out


def _compile(compiler: str, source: str, lib_name: str, extra: dict, include: str, out: str):
  """Compiles `source` per instruction-set part and links the parts into `out`."""
  with tempfile.TemporaryDirectory(dir=os.path.dirname(out)) as tmp:
    procs, objs = [], []
    for part, flags in _parts():  # compiled in parallel; `main` (the FFI headers) is the slowest
      obj = os.path.join(tmp, part + ".o")
      cmd = [compiler, *BASE_FLAGS, *flags, *extra.get("*", ()), *extra.get(part, ()),
             f"-DSJ_PART={part}", "-I", include, "-c", source, "-o", obj]
      procs.append((cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
      objs.append(obj)
    for cmd, p in procs:
      log = p.communicate()[0].decode(errors="replace")
      if p.returncode != 0:
        raise BuildError(f"compiling the kernels failed: {' '.join(cmd)}\n{log[-3000:]}")
    tmp_lib = os.path.join(tmp, lib_name)
    cmd = [compiler, "-shared", "-pthread", *objs, "-o", tmp_lib]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if p.returncode != 0:
      raise BuildError(f"linking the kernels failed: {' '.join(cmd)}\n"
                       f"{p.stdout.decode(errors='replace')[-3000:]}")
    os.replace(tmp_lib, out)
