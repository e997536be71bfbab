"""Shared fixtures: tiny random models (no weights needed), the embedded SmolLM2, prompt sets."""

from __future__ import annotations

import os

# XLA's CPU backend at optimization level 1 for the suite (set before jax starts its backend):
# XLA's compiles are most of this suite's time, and at level 1 they take ~10-15% less (the tiny
# models' programs run in milliseconds either way). Level 0 is not used: there a 10-row tree
# verification on a soft-capped target no longer gave the one-row forward's bits (not found why;
# presumably an elementwise function compiled differently for different shapes), a difference the
# lossless suite exists to catch. LLVM's expensive passes are off too (compiles of the embedded
# model's programs ~10-20% faster; LLVM's passes keep floating-point semantics, and the lossless
# suite runs under the same flags). XLA's elemental emitters too (specjax/compile_options.py):
# the tiny models' programs compile faster with them (-n 2: tests/test_lossless.py and
# test_tree.py 246 -> 220 s; test_model.py, test_weights_blocks.py and test_medusa.py 163 -> 143 s),
# and the real models' decoding and training programs, compiled with compile_options, keep the
# fusion emitters. SPECJAX_TEST_XLA_OPT=2 leaves XLA at its own defaults.
_OPT = os.environ.get("SPECJAX_TEST_XLA_OPT", "1")


def _add_xla_flag(flag: str) -> None:
  """Appends --name=value to XLA_FLAGS unless the user's XLA_FLAGS set that name already."""
  flags = os.environ.get("XLA_FLAGS", "")
  if flag.split("=")[0] not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "") and _OPT != "2":
  _add_xla_flag(f"--xla_backend_optimization_level={_OPT}")
  _add_xla_flag("--xla_llvm_disable_expensive_passes=true")
  _add_xla_flag("--xla_cpu_use_fusion_emitters=false")


def _one_thread_per_worker() -> None:
  """Under pytest-xdist with as many workers as cores or more (make test: two on two), each
  worker, and every process it starts (notebook kernels, the 8-device child, CLI runs), computes
  on one thread: the CPU kernel's pool (SPECJAX_KERNEL_THREADS) and XLA's Eigen pool. Otherwise
  each sizes its pools for every core, two workers run four busy threads on two cores, and a
  kernel call's threads wait on each other (three test files: 173 -> 155 s). The kernel's
  threaded path keeps a test of its own (test_kernels.py::test_threads_split_the_work_not_the_numbers)."""
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
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import specjax as sj  # noqa: E402
from specjax import prompts  # noqa: E402

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


def tiny_config(**kw) -> sj.ModelConfig:
  base = dict(arch="llama", vocab_size=61, hidden_size=32, num_layers=2, num_heads=4,
              num_kv_heads=2, head_dim=8, intermediate_size=48, max_position_embeddings=512,
              rope_theta=10000.0, tie_word_embeddings=False, eos_token_ids=())
  base.update(kw)
  return sj.ModelConfig(**base)


def isa_paths(lib) -> list[str]:
  """Every instruction-set path this CPU can run for one kernel module (specjax.kernels,
  kernels.attention, .blocks, .qdot); none where that kernel is unavailable."""
  if not lib.available():
    return []
  best = lib.ISAS[lib.isa()]
  return [name for name, v in lib.ISAS.items() if v <= best]


def isa_fixture(lib):
  """A fixture that forces `lib`'s instruction-set path to its parameter for one test and
  restores it after (parametrize it indirectly over isa_paths(lib))."""
  @pytest.fixture
  def isa_path(request):
    before = lib.isa()
    assert lib.set_isa(request.param) == request.param
    yield request.param
    lib.set_isa(before)
  return isa_path


def tiny_model(seed: int = 0, scale: float = 0.3, **kw) -> sj.Model:
  """A random model with logits spread wide enough that greedy argmax has no near-ties."""
  return sj.Model.random(tiny_config(**kw), seed=seed, scale=scale)


def memoryless_model(seed: int = 0) -> sj.Model:
  """A tiny model with every attention output zeroed: its greedy next token is a function of the
  current token alone, so text it generated predicts its own continuation exactly (drafts that
  copy or Jacobi-iterate it are accepted)."""
  import jax.numpy as jnp

  m = tiny_model(seed=seed)
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.zeros_like(x) if "'wo'" in jax.tree_util.keystr(path) else x, m.params)
  return sj.Model(m.config, m.graphdef, params)


@pytest.fixture(scope="session")
def tiny():
  return tiny_model()


@pytest.fixture(scope="session")
def smollm2():
  # float32 on every platform (load_model's default is bfloat16 on an accelerator): the parity
  # tests that read this fixture compare against float32 references.
  import jax.numpy as jnp
  return sj.load_model("smollm2-135m", dtype=jnp.float32)


def shared_prompts(n: int, kind: str = "mt_bench") -> list[str]:
  """First n prompts from ../shared/data/prompts (first turns), or the built-in sample where the
  shared folder is absent: the tests need some text, not a benchmark's."""
  return prompts.load(kind, n, fallback=True)


def random_adapters(target, rank: int, seed: int) -> dict:
  """specjax.lora.init's adapters with B drawn at random too (init leaves it zero): merged in,
  they make a model that really differs from `target` (Medusa-2's adapted model in tests)."""
  from specjax import lora

  ad = lora.init(target, rank=rank, seed=seed)
  key = jax.random.PRNGKey(seed + 100)
  return {n: dict(v, b=jax.random.normal(jax.random.fold_in(key, i), v["b"].shape))
          for i, (n, v) in enumerate(sorted(ad.items()))}


def random_prompts(n: int, vocab: int, seed: int = 0, lo: int = 3, hi: int = 20) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, vocab, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def assert_greedy(model, runs, new_tokens: int) -> None:
  """runs: (prompt, generated tokens) pairs. Each generation must be what autoregressive greedy
  decoding of `model` emits: its argmax after every position, from one teacher-forced forward
  over all rows (right-padded; causal, so the padding changes nothing before it)."""
  from specjax.model import forward_sequence

  seqs = np.zeros((len(runs), max(len(p) + len(t) for p, t in runs)), np.int32)
  for i, (p, t) in enumerate(runs):
    seqs[i, :len(p) + len(t)] = p + t
  logits = np.asarray(forward_sequence(model.config, model.module(model.params), seqs)[0])
  for i, (p, t) in enumerate(runs):
    want = logits[i].argmax(-1)[len(p) - 1:len(p) + new_tokens - 1].tolist()
    assert len(t) == new_tokens and t == want, (p, t, want)


def assert_same_greedy(model, prompts, reference, tokens, what: str = "") -> None:
  """A method's greedy tokens against autoregressive decoding's, row by row. Where the arithmetic
  is batch-invariant (the CPU: its kernels and fixed reduction orders) identity is required; on
  an accelerator, whose fused kernels round by shape, a divergence fails only where the
  autoregressive run's top-2 margin there exceeds the dtype's bound (specjax.exactness), and the
  report names each divergence with its margin."""
  tokens, reference = [list(t) for t in tokens], [list(r) for r in reference]
  if jax.default_backend() == "cpu":
    assert tokens == reference, what
    return
  from specjax import exactness

  report = exactness.check_greedy(model, prompts, reference, tokens)
  assert report.ok, f"{what}\n{report.summary()}"
