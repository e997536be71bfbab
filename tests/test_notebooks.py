"""Every notebook runs top to bottom (its own asserts included), and its committed outputs were made
with the assets shipped today (the header its first code cell prints; no notebook is run for that).

The notebooks read SPECJAX_NOTEBOOK_SMALL=1 (set here) to run fewer configurations: fewer programs
to compile, shorter generations, the slow distribution checks skipped (tests/methods/test_lossless.py
covers those). Their committed outputs come from a normal run (`make notebooks`). All notebooks
share one persistent jax compilation cache for the session, so a program that several of them run
(the autoregressive baseline at the same shape, say) is compiled once.
"""

from __future__ import annotations

import ast
import glob
import json
import os
import time

import pytest

NOTEBOOKS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "notebooks", "*.ipynb")))
RERUN = "run `make notebooks` to record today's outputs"


def recorded_header(path: str) -> tuple[list[str], list[str]]:
  """(asset names the first code cell's header(...) call asks for, the asset lines its committed
  output shows) of one notebook, read from the .ipynb JSON."""
  with open(path) as f:
    nb = json.load(f)
  first = next(c for c in nb["cells"] if c["cell_type"] == "code")
  source = "".join(first["source"])
  tree = ast.parse("\n".join(ln for ln in source.splitlines() if not ln.lstrip().startswith("%")))
  calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
           and getattr(n.func, "id", getattr(n.func, "attr", None)) == "header"]
  assert len(calls) == 1, f"{path}: the first code cell must print notebook_header.header(...) once"
  names = [ast.literal_eval(a) for a in calls[0].args]
  text = "".join("".join(o.get("text", "")) for o in first.get("outputs", [])
                 if o.get("output_type") == "stream" and o.get("name") == "stdout")
  lines = text.splitlines()
  assert "specjax notebook header" in lines, f"{path}: no recorded header output; {RERUN}"
  body = lines[lines.index("specjax notebook header") + 2:]
  return names, [ln for ln in body if ln.startswith(("asset ", "assets: "))]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_recorded_header_matches_shipped_assets(path):
  """The asset lines a notebook's outputs were recorded with (file hashes, held-out numbers) are
  those of the assets shipped today: a retrained head or a changed corpus means stale outputs."""
  from specjax import notebook_header

  names, recorded = recorded_header(path)
  today = notebook_header.header(*names).splitlines()[2:]
  assert recorded == today, (f"{os.path.basename(path)} was run with other assets than those shipped "
                             f"today; {RERUN}.\nrecorded: {recorded}\ntoday:    {today}")


def test_header_check_sees_a_stale_notebook(tmp_path):
  """A recorded asset line that differs from today's (an older hash) fails the check."""
  from specjax import notebook_header

  name = "smollm2-135m-medusa"
  line = notebook_header.asset_line(name)
  stale = line.replace("sha256:", "sha256:0")
  for recorded, ok in ((line, True), (stale, False)):
    nb = {"cells": [{"cell_type": "code", "source": f"print(header({name!r}))", "outputs": [
        {"output_type": "stream", "name": "stdout",
         "text": f"specjax notebook header\njax ...\n{recorded}\n"}]}]}
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps(nb))
    names, lines = recorded_header(str(path))
    assert names == [name] and (lines == [line]) == ok


@pytest.fixture(scope="session")
def compile_cache_dir(tmp_path_factory):
  """One persistent jax cache for every notebook, shared by the pytest-xdist workers too (their
  base temp folders share a parent): the programs several notebooks run (the autoregressive
  baseline and prompt lookup on the same prompt, say) compile once per run, not once per worker."""
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return os.environ["JAX_COMPILATION_CACHE_DIR"]
  base = tmp_path_factory.getbasetemp()
  shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "notebooks-jax-cache"
  shared.mkdir(exist_ok=True)
  return str(shared)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, monkeypatch, compile_cache_dir):
  import nbformat
  from jupyter_client.kernelspec import NATIVE_KERNEL_NAME
  from nbclient import NotebookClient

  # The kernel inherits this process's environment.
  monkeypatch.setenv("SPECJAX_NOTEBOOK_SMALL", "1")
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", compile_cache_dir)
  # A size bound makes jax lock the cache folder around each read and write, so one worker never
  # reads an entry another is still writing.
  monkeypatch.setenv("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))
  nb = nbformat.read(path, as_version=4)
  t0 = time.perf_counter()
  # execute() raises on the first failing cell (the notebooks assert what they show).
  NotebookClient(nb, timeout=600, kernel_name=NATIVE_KERNEL_NAME,
                 resources={"metadata": {"path": os.path.dirname(path)}}).execute()
  print(f"{os.path.basename(path)}: {time.perf_counter() - t0:.0f}s")
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(c.get("execution_count") for c in code), "a cell did not run"
