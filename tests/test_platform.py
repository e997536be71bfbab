"""The suite's platform handling (tests/conftest.py): tests marked cpu_only are skipped where
jax's default backend is not the CPU, checked in a child pytest whose jax reports a GPU (nothing
there compiles: the one selected test is skipped at collection)."""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

FAKE_GPU = """
import sys
import jax
import pytest
jax.default_backend = lambda: "gpu"
sys.exit(pytest.main(["-q", "-rs", "-p", "no:cacheprovider", sys.argv[1], "-k", sys.argv[2]]))
"""


def test_cpu_only_tests_are_skipped_on_another_backend():
  r = subprocess.run([sys.executable, "-c", FAKE_GPU,
                      os.path.join(HERE, "decode", "test_decode.py"), "prefill_in_chunks"],
                     cwd=os.path.dirname(HERE), capture_output=True, text=True, timeout=300)
  out = r.stdout + r.stderr
  assert r.returncode == 0, out[-3000:]
  assert "1 skipped" in out and "CPU-only; jax's default backend is gpu" in out, out[-3000:]
