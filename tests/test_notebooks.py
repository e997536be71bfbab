"""Every notebook runs top to bottom (its own asserts included).

The notebooks read SPECJAX_NOTEBOOK_SMALL=1 (set here) to run fewer configurations: fewer programs
to compile, shorter generations, the slow distribution checks skipped (tests/test_lossless.py
covers those). Their committed outputs come from a normal run. All notebooks share one persistent
jax compilation cache for the session, so a program that several of them run (the autoregressive
baseline at the same shape, say) is compiled once.
"""

from __future__ import annotations

import glob
import os
import time

import pytest

NOTEBOOKS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "notebooks", "*.ipynb")))


@pytest.fixture(scope="session")
def compile_cache_dir(tmp_path_factory):
  return os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(tmp_path_factory.mktemp("jax_cache"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, monkeypatch, compile_cache_dir):
  import nbformat
  from jupyter_client.kernelspec import NATIVE_KERNEL_NAME
  from nbclient import NotebookClient

  # The kernel inherits this process's environment.
  monkeypatch.setenv("SPECJAX_NOTEBOOK_SMALL", "1")
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", compile_cache_dir)
  nb = nbformat.read(path, as_version=4)
  t0 = time.perf_counter()
  # execute() raises on the first failing cell (the notebooks assert what they show).
  NotebookClient(nb, timeout=600, kernel_name=NATIVE_KERNEL_NAME,
                 resources={"metadata": {"path": os.path.dirname(path)}}).execute()
  print(f"{os.path.basename(path)}: {time.perf_counter() - t0:.0f}s")
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(c.get("execution_count") for c in code), "a cell did not run"
