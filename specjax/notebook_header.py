"""The header each notebook prints first: which shipped assets its outputs were made with, and on
what. tests/test_notebooks.py compares a notebook's recorded header with the assets shipped today,
so outputs made with older assets fail the tests until `make notebooks` runs them again.

    print(header("smollm2-135m-medusa"))

    specjax notebook header
    jax 0.8.1 | CPU: <model name> x 2 cores | load average 1.52 1.10 0.80 (1, 5, 15 min)
    asset smollm2-135m-medusa sha256:3f2a... steps 1300 | held-out top1_0 0.241 top5_0 0.445 ...

Asset lines are deterministic (a short sha256 of the file and the held-out numbers its header
records); the jax / machine line is for the reader: timings depend on it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os

from specjax import shipped

CORPUS = "corpus/"  # names starting so are corpus folders under the assets: "corpus/smollm2-135m"


@functools.lru_cache(maxsize=None)
def _sha256(paths: tuple[str, ...], stamp: tuple) -> str:
  """Short sha256 over the files' bytes in order (stamp: their sizes and mtimes, for the cache)."""
  h = hashlib.sha256()
  for p in paths:
    with open(p, "rb") as f:
      for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
  return h.hexdigest()[:12]


def _digest(paths: list[str]) -> str:
  return _sha256(tuple(paths), tuple((os.path.getsize(p), os.path.getmtime(p)) for p in paths))


def _npz_header(path: str) -> dict:
  """The JSON `__header__` every drafter asset (draft model or heads) carries."""
  import numpy as np

  with np.load(path) as z:
    return json.loads(bytes(z["__header__"]).decode()) if "__header__" in z.files else {}


def asset_line(name: str) -> str:
  """One line for a shipped asset: a registered drafter name (shipped.DRAFTERS) or
  "corpus/<model>" (a corpus folder under the assets)."""
  if name.startswith(CORPUS):
    folder = os.path.join(shipped.ASSETS_DIR, name)
    if not os.path.isdir(folder):
      return f"asset {name} missing"
    files = sorted(os.path.join(folder, f) for f in os.listdir(folder)
                   if os.path.isfile(os.path.join(folder, f)))
    return f"asset {name} sha256:{_digest(files)} ({len(files)} files)"
  path = shipped.get(name).path
  if not os.path.isfile(path):
    return f"asset {name} missing"
  meta = _npz_header(path)
  held = meta.get("held_out") or {}
  numbers = " ".join(f"{k} {held[k]:.3f}" for k in sorted(held)
                     if k.startswith(("top1", "top5")) and isinstance(held[k], (int, float)))
  return (f"asset {name} sha256:{_digest([path])} steps {meta.get('steps', '?')} | held-out "
          f"{numbers or 'not recorded'}")


def machine_line() -> str:
  """jax version, CPU model and cores, load average: what the timings below depend on."""
  cpu = "unknown CPU"
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
  except OSError:
    pass
  load = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
  return (f"jax {importlib.metadata.version('jax')} | CPU: {cpu} x {os.cpu_count()} cores | "
          f"load average {load} (1, 5, 15 min)")


def header(*names: str) -> str:
  """The notebook header: the machine line, then one line per shipped asset in `names`."""
  assets = [asset_line(n) for n in names] or ["assets: none (this notebook uses no shipped asset)"]
  return "\n".join(["specjax notebook header", machine_line(), *assets])
