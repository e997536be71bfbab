"""CPU fast path for the model's dense layers: a weight-streaming matmul through jax.ffi.

    y[M,N] = x[M,K] @ W,   M = B*T in [1, MAX_ROWS],   W packed once at load into [nb, K, bw]

Why. A decode step reads every weight once, and for 1..32 rows the arithmetic is small: a forward
of T tokens should cost about what a forward of one costs. XLA's CPU backend runs one row on a
bandwidth-bound matrix-vector path but 2-16 rows on its general GEMM path, which repacks the weight
on every call (2 tokens ~1.3-1.5x, 16 tokens ~2.4-2.8x one token on SmolLM2-135M). The kernel
(matmul.cc) instead streams each contiguous column block of the pre-packed weight once per call
and updates M rows of accumulators from it, on AVX-512, AVX2+FMA or a portable path picked at run
time, split over a small persistent thread pool (see experiments/kernels/README.md).

Where the packed copies live. `pack(model)` adds one `Packed` variable beside each dense weight of
the module tree (`layers.i.attn.packed_wqkv`, `packed_wo`, `layers.i.mlp.packed_w_in`,
`packed_w_out`, and `packed_head` on the decoder, from `embed` transposed when the head is tied)
and returns a new Model whose `params` State and `graphdef` carry them. So they travel wherever
params go (through `jax.jit`, `decode.Program.forward`, a method's `arrays`) with no change to any
caller, while every original parameter keeps its name, shape and value: code that reads
`model.params["layers"][0]["attn"]["wqkv"]`, shares an embedding with a draft, or builds a draft
from a target's tensors works unchanged (a draft built that way has no packed copies and runs on
XLA; its forwards are small). Packed copies are a load-time transform: `weights.load_model` makes
them, nothing saves them (drafts' own tensors and checkpoints are written from unpacked models),
and they are derived data: if you change a packed model's parameters, call `pack` again
(or `unpack`) so the copies follow.

When the kernel runs. `dense(x, w, packed)` (used by model.py at every matmul) calls the kernel at
trace time iff a packed copy is present, x is float32 and M = prod(x.shape[:-1]) <= MAX_ROWS;
otherwise, and whenever it is differentiated (a custom_vjp whose forward rule is XLA's dot), it is
XLA's dot on the original weight. `load_model(..., kernels=None)` packs when the process runs on a
single CPU device in float32 and `SPECJAX_KERNELS` is not "0"; `kernels=False` never packs;
`kernels=True` packs or warns. If the kernel cannot be built (no compiler, a failed build) or the
CPU has neither AVX-512 nor AVX2+FMA, specjax warns once and stays on XLA: same tokens, XLA's
speed. Results match XLA to float32 rounding (the kernel sums k in order with FMAs), and a row's
result does not depend on how many rows share the call.

Environment: SPECJAX_KERNELS=0 (off), SPECJAX_KERNELS_ISA=avx512|avx2|scalar (force a path),
SPECJAX_KERNEL_THREADS (default: min(cores, 4)), SPECJAX_CXX (compiler), SPECJAX_CACHE (build
cache root; see build.py).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

MAX_ROWS = 32  # the largest M = B*T sent to the kernel; larger calls (prefill) use XLA
ENV = "SPECJAX_KERNELS"
TARGET = "specjax_dense_f32"
ISAS = {"scalar": 0, "avx2": 1, "avx512": 2}
BLOCK_WIDTHS = (64, 48, 32, 16)


class KernelFallbackWarning(UserWarning):
  """The CPU kernels are unavailable here; specjax uses XLA's dot instead (same results)."""


class Packed(nnx.Variable):
  """A load-time re-layout of a dense weight for the kernel ([nb, K, bw]); never saved or trained."""


# ----------------------------------------------------------------------------- loading

_lock = threading.Lock()
_state: dict = {"tried": False, "lib": None, "reason": None}


def _detect_isa(lib) -> int:
  """The best path this CPU supports (0 scalar, 1 avx2+fma, 2 avx512). Tests replace this hook
  to simulate a CPU without vector instructions."""
  return lib.specjax_kernel_detected_isa()


def switched_off() -> bool:
  """Whether SPECJAX_KERNELS turns the kernels off ("0", "false", "off", "no")."""
  return os.environ.get(ENV, "").strip().lower() in ("0", "false", "off", "no")


def load(cxx: str | None = None, cache_dir: str | None = None):
  """The loaded kernel library (ctypes.CDLL), building it on first use; None if unavailable.

  Tried once per process: a failure warns once (KernelFallbackWarning) and is remembered.
  """
  with _lock:
    if _state["tried"]:
      return _state["lib"]
    _state["tried"] = True
    try:
      _state["lib"] = _load(cxx, cache_dir)
    except Exception as e:  # noqa: BLE001 -- any failure means: use XLA, and say why once
      _state["reason"] = str(e)
      warnings.warn(f"specjax.kernels unavailable, using XLA's dot instead: {e}",
                    KernelFallbackWarning, stacklevel=3)
    return _state["lib"]


def _load(cxx, cache_dir):
  from specjax.kernels import build

  path = build.build(cxx, cache_dir)
  lib = ctypes.CDLL(path)
  for name in ("specjax_kernel_isa", "specjax_kernel_detected_isa", "specjax_kernel_set_isa",
               "specjax_kernel_threads"):
    getattr(lib, name).restype = ctypes.c_int
  lib.specjax_kernel_set_isa.argtypes = [ctypes.c_int]
  forced = os.environ.get("SPECJAX_KERNELS_ISA", "").strip().lower()
  if forced:
    if forced not in ISAS:
      raise ValueError(f"SPECJAX_KERNELS_ISA={forced!r}: expected one of {sorted(ISAS)}")
    if lib.specjax_kernel_set_isa(ISAS[forced]) != ISAS[forced]:
      raise RuntimeError(f"SPECJAX_KERNELS_ISA={forced}: this CPU does not support it")
  else:
    isa = _detect_isa(lib)
    if isa < ISAS["avx2"]:
      raise RuntimeError("this CPU has neither AVX-512 nor AVX2+FMA: the portable kernel would "
                         "be slower than XLA")
    lib.specjax_kernel_set_isa(isa)
  if not _state.get("registered"):  # once per process, even if a test makes us load again
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.SpecjaxDenseF32), platform="cpu")
    _state["registered"] = True
  return lib


def available() -> bool:
  """Whether the kernel is built, loaded and worth using on this CPU (builds it on first call)."""
  return load() is not None


def isa() -> str | None:
  """The instruction-set path in use ("avx512", "avx2", "scalar"), or None if unavailable."""
  lib = load()
  return None if lib is None else {v: k for k, v in ISAS.items()}[lib.specjax_kernel_isa()]


def set_isa(name: str) -> str:
  """Forces a path the CPU supports (tests run all of them); returns the path now in use."""
  lib = load()
  if lib is None:
    raise RuntimeError("specjax.kernels unavailable: " + str(_state["reason"]))
  return {v: k for k, v in ISAS.items()}[lib.specjax_kernel_set_isa(ISAS[name])]


def threads() -> int:
  lib = load()
  return 1 if lib is None else lib.specjax_kernel_threads()


def _reset_for_tests():
  """Forgets the load attempt, so the next call retries (tests of the fallback paths)."""
  with _lock:
    _state.update(tried=False, lib=None, reason=None)


# ----------------------------------------------------------------------------- packing


def block_width(n: int, num_threads: int) -> int:
  """Column-block width for an N-column weight: the widest block that splits N's blocks evenly
  over the threads (576 columns on 2 threads: 12 blocks of 48 rather than 9 of 64)."""
  def cost(bw):
    nb = -(-n // bw)
    return -(-nb // num_threads) * bw, -bw
  return min(BLOCK_WIDTHS, key=cost)


def pack_weight(w: np.ndarray, *, transposed: bool = False, num_threads: int | None = None,
                bw: int | None = None) -> np.ndarray:
  """A dense weight [K, N] (or [N, K] with transposed=True, e.g. a tied embedding) -> the
  kernel's layout [nb, K, bw] float32: column block j holds W[:, j*bw:(j+1)*bw] row by row,
  zero-padded past N."""
  w = np.asarray(w, np.float32)
  if w.ndim != 2:
    raise ValueError(f"pack_weight: expected a 2-D weight, got shape {w.shape}")
  wk = w.T if transposed else w  # [K, N] (a view)
  k, n = wk.shape
  bw = bw or block_width(n, num_threads or threads())
  nb = -(-n // bw)
  out = np.zeros((nb, k, bw), np.float32)
  full = n // bw
  if full:
    out[:full] = wk[:, :full * bw].reshape(k, full, bw).transpose(1, 0, 2)
  if n > full * bw:
    out[full, :, :n - full * bw] = wk[:, full * bw:]
  return out


def _dense_sites(module):
  """(owner module, packed attribute name, weight [K,N] or [N,K], transposed) for every dense
  layer of a Decoder."""
  cfg = module.cfg
  e = cfg.hidden_size
  for block in module.layers:
    a, m = block.attn, block.mlp
    yield a, "packed_wqkv", a.wqkv[...].reshape(e, -1), False
    yield a, "packed_wo", a.wo[...].reshape(-1, e), False
    yield m, "packed_w_in", m.w_in[...].reshape(e, -1), False
    yield m, "packed_w_out", m.w_out[...], False
  if cfg.tie_word_embeddings:
    yield module, "packed_head", module.embed[...], True
  else:
    yield module, "packed_head", module.lm_head[...], False


def _rebuild(model, module):
  from specjax.model import Model

  graphdef, params = nnx.split(module)
  new = Model(model.config, graphdef, params, model.tokenizer, name=model.name, dtype=model.dtype,
              shared=model.shared)
  for k, v in vars(model).items():  # extras a loader attached (vocab_subset, asset_header, ...)
    if k not in vars(new):
      setattr(new, k, v)
  return new


def is_packed(model) -> bool:
  return any("packed_" in jax.tree_util.keystr(p)
             for p, _ in jax.tree_util.tree_leaves_with_path(model.params))


def pack(model, *, warn: bool = True):
  """A new Model whose params also carry packed copies of every dense weight (see the module
  docstring); the model itself if the kernel is unavailable (warned once), if its dtype is not
  float32, or if it is already packed."""
  if is_packed(model):
    return model
  if jnp.dtype(model.dtype) != jnp.dtype(jnp.float32):
    if warn:
      warnings.warn(f"specjax.kernels: {model.dtype} weights are not supported (float32 only); "
                    f"using XLA", KernelFallbackWarning, stacklevel=2)
    return model
  if not available():
    return model
  nt = threads()
  module = model.module()
  for owner, name, w, transposed in _dense_sites(module):
    setattr(owner, name, Packed(jnp.asarray(pack_weight(np.asarray(w), transposed=transposed,
                                                        num_threads=nt))))
  return _rebuild(model, module)


def unpack(model):
  """The model without its packed copies (XLA everywhere)."""
  if not is_packed(model):
    return model
  module = model.module()
  for owner, name, _, _ in _dense_sites(module):
    if hasattr(owner, name):
      delattr(owner, name)
  return _rebuild(model, module)


def single_cpu_device() -> bool:
  devices = jax.devices()
  return len(devices) == 1 and devices[0].platform == "cpu"


def maybe_pack(model, kernels: bool | None):
  """load_model's policy: None = pack if SPECJAX_KERNELS allows, on one CPU device, in float32;
  True = pack (warning if impossible); False = never."""
  if kernels is False or (kernels is None and (switched_off() or not single_cpu_device()
                                               or jnp.dtype(model.dtype) != jnp.float32)):
    return model
  if kernels is True and not single_cpu_device():
    warnings.warn("specjax.kernels: the kernel runs on a single CPU device only; using XLA",
                  KernelFallbackWarning, stacklevel=3)
    return model
  return pack(model)


# ----------------------------------------------------------------------------- the op


def _xla(x, w, transposed: bool):
  """x [..., K] @ w [K, ...] (or w [N, K] transposed) as XLA's dot: the fallback, and the
  reference the kernel is tested against."""
  return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1 if transposed else 0,)), ((), ())))


def _ffi(x2, packed, n: int):
  return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32),
                          vmap_method="sequential")(x2, packed)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _kernel(x2, w2, packed, transposed):
  """x2 [M,K] -> [M,N] through the kernel. w2 (the original weight, [K,N] or [N,K]) is only read
  when differentiated: the forward rule is then XLA's dot, so gradients never see the kernel."""
  return _ffi(x2, packed, w2.shape[0] if transposed else w2.shape[1])


def _kernel_fwd(x2, w2, packed, transposed):
  return _xla(x2, w2, transposed), (x2, w2)


def _kernel_bwd(transposed, res, g):
  x2, w2 = res
  if transposed:  # w2 [N,K]
    return g @ w2, g.T @ x2, None
  return g @ w2.T, x2.T @ g, None


_kernel.defvjp(_kernel_fwd, _kernel_bwd)


def dense(x: jax.Array, w: jax.Array, packed: jax.Array | None = None, *,
          transposed: bool = False) -> jax.Array:
  """x [..., K] @ w [K, *out] -> [..., *out]; transposed: w [N, K] -> [..., N] (a tied head).

  packed [nb, K, bw]: w's packed copy (pack_weight); with it, and M = prod(x.shape[:-1]) in
  [1, MAX_ROWS] and float32 operands, the product runs in the kernel, else in XLA's dot.
  """
  k = x.shape[-1]
  out = w.shape[:1] if transposed else w.shape[1:]
  m = int(np.prod(x.shape[:-1], dtype=np.int64))
  if (packed is None or not 1 <= m <= MAX_ROWS or x.dtype != jnp.float32
      or w.dtype != jnp.float32 or packed.dtype != jnp.float32 or not available()):
    return _xla(x, w, transposed)
  w2 = w if transposed else w.reshape(k, -1)
  y = _kernel(x.reshape(m, k), w2, packed, transposed)
  return y.reshape(*x.shape[:-1], *out)
