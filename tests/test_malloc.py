"""specjax.malloc: glibc keeps freed XLA-sized buffers mapped once tuned (fewer page faults)."""

import os
import subprocess
import sys
import textwrap

import pytest

import specjax.malloc as malloc
from specjax.errors import InputError

# A worker thread allocating, touching and freeing three 20 MB buffers 200 times: the pattern of
# XLA's CPU temporaries at batch 64. Prints the minor page faults it caused.
CHURN = textwrap.dedent("""
    import ctypes, resource, threading, sys
    import specjax.malloc as malloc
    print("tuned", malloc.tune())
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    def work():
      for _ in range(200):
        ps = [libc.malloc(20 << 20) for _ in range(3)]
        for p in ps:
          libc.memset(p, 1, 20 << 20)
        for p in ps:
          libc.free(p)
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = threading.Thread(target=work)
    t.start()
    t.join()
    print("faults", resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
""")


def _churn(env_extra: dict) -> tuple[bool, int]:
  env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_TOP_PAD_", "GLIBC_TUNABLES")}
  env.update(env_extra)
  out = subprocess.run([sys.executable, "-c", CHURN], env=env, capture_output=True, text=True,
                       check=True).stdout.split()
  return out[1] == "True", int(out[3])


@pytest.mark.skipif(malloc.glibc() is None, reason="malloc tuning applies to glibc only")
def test_tuning_stops_page_fault_churn():
  tuned, faults_tuned = _churn({})
  untuned, faults_default = _churn({"SPECJAX_MALLOC_TOP_PAD": "0"})
  assert tuned and not untuned
  # 600 frees of 20 MB: glibc's defaults give them back each time (~3M faults of 4 KB measured);
  # tuned, the pages stay mapped (~15k faults measured).
  assert faults_default > 10 * faults_tuned, (faults_default, faults_tuned)


def test_users_own_malloc_settings_win():
  tuned, _ = _churn({"MALLOC_TOP_PAD_": "1048576"})
  assert not tuned


def test_bad_env_value_is_a_specific_error(monkeypatch):
  monkeypatch.setattr(malloc, "_result", None)
  monkeypatch.setenv("SPECJAX_MALLOC_TOP_PAD", "lots")
  with pytest.raises(InputError, match="SPECJAX_MALLOC_TOP_PAD='lots'"):
    malloc.tune()
  monkeypatch.setenv("SPECJAX_MALLOC_TOP_PAD", "0")
  assert malloc.tune() is False  # the failed call did not stick: the next one decides afresh
