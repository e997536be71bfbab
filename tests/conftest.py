"""The suite's pytest hooks and fixtures: XLA's settings for the suite, the 8-device and CPU-only
markers, one compilation cache per run, the tiny model and the embedded SmolLM2. The helpers
tests share are in tests/helpers/ (imported from there; no test imports this file)."""

from __future__ import annotations

import os

# XLA's CPU backend at optimization level 0 for the suite (set before jax starts its backend):
# XLA's compiles are most of this suite's time, and LLVM's optimization of each fused kernel most
# of a compile; at level 0 a tiny model's decoding program compiles ~2.4x faster than at level 1
# (autoregressive, a draft model and lookahead: 10.4 -> 4.4 s), and those programs run in
# milliseconds either way. One LLVM setting comes with it: instruction selection stays on
# SelectionDAG (`-fast-isel=false`). At level 0 LLVM otherwise selects instructions with FastISel,
# which never fuses a multiply and an add into an FMA, and falls back to SelectionDAG, which does,
# for a kernel holding an instruction FastISel does not handle (a gather's clamped index, say).
# Whether a kernel holds one depends on XLA's fusion choices, which depend on shapes: the sum of
# squares in a norm then rounded once in the one-token forward (the embedding gather fused into
# it) and twice in a 64-token block (the gather fused elsewhere), and batch invariance failed
# there (tests/test_invariance.py's GGUF case, rows 53-63). With SelectionDAG every kernel fuses
# alike, as at levels 1 to 3 (3 is XLA's default). LLVM's expensive passes are off too (LLVM's
# passes keep floating-point semantics, and the lossless suite runs under the same flags). XLA's
# elemental emitters too (specjax/compile_options.py): the tiny models' programs compile faster
# with them, and the real models' decoding and training programs, compiled with compile_options,
# keep the fusion emitters. SPECJAX_TEST_XLA_OPT=1 runs the suite at level 1 (what it ran at
# before), =2 leaves XLA at its own defaults.
_OPT = os.environ.get("SPECJAX_TEST_XLA_OPT", "0")


def _add_xla_flag(flag: str) -> None:
  """Appends --name=value to XLA_FLAGS unless the user's XLA_FLAGS set that name already."""
  flags = os.environ.get("XLA_FLAGS", "")
  if flag.split("=")[0] not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "") and _OPT != "2":
  _add_xla_flag(f"--xla_backend_optimization_level={_OPT}")
  _add_xla_flag("--xla_llvm_disable_expensive_passes=true")
  _add_xla_flag("--xla_cpu_use_fusion_emitters=false")
  if _OPT == "0":
    _add_xla_flag("--xla_backend_extra_options=-fast-isel=false")


def _one_thread_per_worker() -> None:
  """Under pytest-xdist with as many workers as cores or more (make test: two on two), each
  worker, and every process it starts (notebook kernels, the 8-device child, CLI runs), computes
  on one thread: the CPU kernel's pool (SPECJAX_KERNEL_THREADS) and XLA's Eigen pool. Otherwise
  each sizes its pools for every core, two workers run four busy threads on two cores, and a
  kernel call's threads wait on each other (three test files: 173 -> 155 s). The kernel's
  threaded path keeps a test of its own
  (kernels/test_matmul.py::test_threads_split_the_work_not_the_numbers)."""
  count = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
  # The cores this process may run on, as the kernel's pool counts them (its affinity mask).
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  if not (os.environ.get("PYTEST_XDIST_WORKER") and count) or int(count) < (cores or 1):
    return
  os.environ.setdefault("SPECJAX_KERNEL_THREADS", "1")
  _add_xla_flag("--xla_cpu_multi_thread_eigen=false")


_one_thread_per_worker()

# On a GPU, XLA takes 75% of the device's memory when its client starts: a second pytest-xdist
# worker (make test: two) would then run out of memory. Growing on demand lets workers share it;
# CPU runs are unaffected.
if os.environ.get("PYTEST_XDIST_WORKER"):
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

import specjax as sj  # noqa: E402

from tests.helpers.models import tiny_model  # noqa: E402

EIGHT_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"

# Unit tests time nothing (timing lives in bench.py and experiments/): the methods' defaults come
# from specjax.calibrate.DEFAULT_CURVE and no cost curve is measured or written to the user's
# cache. tests/test_calibrate.py switches calibration on where it tests it.
os.environ["SPECJAX_CALIBRATION"] = "0"


def pytest_collection_modifyitems(config, items):
  """Tests marked eight_devices run only in a process started with 8 simulated devices
  (tests/test_sharding.py starts one); elsewhere they are deselected, not skipped. Tests marked
  cpu_only are skipped where jax's default backend is not the CPU (the platform is the
  environment's: JAX_PLATFORMS, else the accelerator jax finds)."""
  cpu_only = [i for i in items if i.get_closest_marker("cpu_only") is not None]
  if cpu_only and jax.default_backend() != "cpu":
    skip = pytest.mark.skip(reason=f"CPU-only; jax's default backend is {jax.default_backend()}")
    for i in cpu_only:
      i.add_marker(skip)
  if EIGHT_DEVICE_FLAG in os.environ.get("XLA_FLAGS", ""):
    return
  keep = [i for i in items if i.get_closest_marker("eight_devices") is None]
  if len(keep) != len(items):
    config.hook.pytest_deselected(items=[i for i in items if i not in keep])
  # Longest first: the 8-device child run (minutes) starts at once, so on two workers
  # (make test) it runs beside the rest of the suite instead of after it.
  items[:] = sorted(keep, key=lambda i: i.name not in FIRST)


FIRST = {"test_on_8_simulated_devices"}


@pytest.fixture(scope="session", autouse=True)
def _shared_compile_cache(tmp_path_factory):
  """One persistent jax compilation cache per test run, shared by the pytest-xdist workers (their
  base temp folders share a parent) and the notebooks: a program that several tests compile (the
  autoregressive reference at a given shape, the same method on the same tiny model) is built by
  XLA once per run and loaded after that, the same executable either way. Fresh for every run,
  so nothing carries over between runs; a cache the caller chose (JAX_COMPILATION_CACHE_DIR) wins.
  A size bound makes jax lock the folder around each read and write, so one worker never reads an
  entry another is still writing."""
  if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "jax-cache"
    shared.mkdir(exist_ok=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(shared)  # CLI children and notebooks too
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.3)
  jax.config.update("jax_compilation_cache_max_size", 8 << 30)
  yield


def _num_mappings() -> int:
  try:
    with open("/proc/self/maps") as f:
      return sum(1 for _ in f)
  except OSError:
    return 0


@pytest.fixture(autouse=True)
def _bound_compiled_code():
  """Compiled XLA programs hold JIT code in memory mappings; the whole suite compiles far more
  than Linux's default vm.max_map_count (65530) allows at once, and a compile past it crashes.
  decode's compile cache bounds itself; this also catches other jitted code (training steps,
  model.apply in tests) by clearing every cache once the process nears the limit. Clearing
  happens between tests, never inside one, so tests that count compiles stay exact."""
  from specjax import decode

  cache = decode.compile_cache
  if _num_mappings() > 30000 or len(cache.programs) > cache.max_programs - 24:
    import gc
    cache.clear()
    gc.collect()
  yield


@pytest.fixture(scope="session")
def tiny():
  return tiny_model()


@pytest.fixture(scope="session")
def smollm2():
  # float32 on every platform (load_model's default is bfloat16 on an accelerator): the parity
  # tests that read this fixture compare against float32 references.
  import jax.numpy as jnp
  return sj.load_model("smollm2-135m", dtype=jnp.float32)
