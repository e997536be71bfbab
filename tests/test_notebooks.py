"""Every notebook runs top to bottom (its own asserts included)."""

from __future__ import annotations

import glob
import os

import pytest

NOTEBOOKS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "notebooks", "*.ipynb")))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path):
  import nbformat
  from nbclient import NotebookClient

  nb = nbformat.read(path, as_version=4)
  from jupyter_client.kernelspec import NATIVE_KERNEL_NAME

  # execute() raises on the first failing cell (the notebooks assert what they show).
  NotebookClient(nb, timeout=600, kernel_name=NATIVE_KERNEL_NAME,
                 resources={"metadata": {"path": os.path.dirname(path)}}).execute()
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(c.get("execution_count") for c in code), "a cell did not run"
