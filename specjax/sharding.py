"""Device meshes and sharding: a mesh from a short spec, regex rules -> NamedSharding for params,
the KV cache and the decode state.

Two mesh axes, always both present (size 1 when unused):

    data   batch rows (decoding) or examples (training) are split over it
    model  tensor parallel: attention heads, MLP width and vocabulary are split over it

Parameters are matched by path ("layers/3/attn/wqkv") against `DEFAULT_RULES`, an ordered list of
(regex, PartitionSpec) pairs ending in a catch-all, EasyLM-style; the first `re.search` hit wins.
Rules are data: pass your own list to `load_model(..., rules=)`, `shard_params(..., rules=)`.
A dimension that does not divide by its mesh axis (SmolLM2: 9 query, 3 kv heads on model=2)
falls back to replication on that dimension, is reported once as a `ShardingFallbackWarning`, and
is counted in `memory_report`. `strict=True` makes it a `ShardingError` instead.

Inside the compiled loop the cache and the decode state are pinned with
`with_sharding_constraint` (`constrain_cache`, `constrain_rows`, `constrain_replicated`): rows over
`data`, KV heads over `model` where they divide. Which of the decode state's fields are per-row is
declared by the state itself (decode.DecodeState), not guessed here. Nothing here changes results:
greedy outputs are token-identical to one device.

Everything that builds an array goes through `jax.make_array_from_callback`, so each process only
touches its own shards: a model is never materialised whole on one device, and the same code runs
multi-host after `jax.distributed.initialize()` (see docs/sharding.md).
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specjax import distributed
from specjax.cache import KVCache
from specjax.errors import InputError

AXES = ("data", "model")

# Param paths are "/"-joined keys, e.g. "layers/0/attn/wqkv", "embed", "lm_head". Shapes in
# model.py. Splitting wqkv's K axis keeps each kv head's G query heads with it; wo's H axis is
# split into the same contiguous groups (head h = k * G + g), so attention needs no all-gather.
DEFAULT_RULES: tuple[tuple[str, P], ...] = (
    (r"(^|/)embed$", P("model", None)),  # [V,E] vocab over model (tied head: logits over V)
    (r"(^|/)pos_embed$", P()),  # [P,E] GPT-2 learned positions: small
    (r"(^|/)attn/wqkv$", P(None, "model", None, None)),  # [E,K,G+2,D] kv heads
    (r"(^|/)attn/bqkv$", P("model", None, None)),  # [K,G+2,D]
    (r"(^|/)attn/wo$", P("model", None, None)),  # [H,D,E] query heads
    (r"(^|/)mlp/w_in$", P(None, None, "model")),  # [E,M,F] MLP width
    (r"(^|/)mlp/b_in$", P(None, "model")),  # [M,F]
    (r"(^|/)mlp/w_out$", P("model", None)),  # [F,E]
    (r"(^|/)lm_head$", P(None, "model")),  # [E,V] vocab
    (r".*", P()),  # norms (Gemma's post-norms, q/k norms), output biases: replicated
)


class ShardingError(InputError):
  """A mesh or sharding that cannot work: unknown axis, too many devices, indivisible batch."""


class ShardingFallbackWarning(UserWarning):
  """A tensor dimension did not divide by its mesh axis and was replicated instead."""


# ----------------------------------------------------------------------------- meshes


def make_mesh(spec: "str | Mesh | dict | None" = None, devices: Sequence | None = None) -> Mesh:
  """A ("data", "model") mesh from "data=2,model=4", {"model": 8}, an existing Mesh, or None.

  Omitted axes get size 1; "data=-1" takes the devices the other axis leaves. The mesh uses the
  first prod(sizes) of `devices` (default: all of jax.devices(), every process's on multi-host).
  Raises ShardingError for unknown axis names, bad sizes, or more devices than exist, and
  (under jax.distributed, devices not given) distributed.MeshLeavesProcessError for a mesh that
  holds no device of some process.
  """
  chosen = devices is None  # (devices given: the caller's choice, a process-local mesh too)
  devices = list(jax.devices() if devices is None else devices)
  if isinstance(spec, Mesh):
    return _from_mesh(spec)
  sizes = _axis_sizes(spec)
  fixed = math.prod(s for s in sizes.values() if s != -1)
  for a, s in sizes.items():
    if s == -1:
      if len(devices) % fixed:
        raise ShardingError(f"mesh={spec!r}: {len(devices)} devices do not divide by {fixed}")
      sizes[a] = len(devices) // fixed
  shape = tuple(int(sizes.get(a, 1)) for a in AXES)
  n = math.prod(shape)
  if n > len(devices):
    raise ShardingError(
        f"mesh={spec!r} needs {n} devices but only {len(devices)} exist "
        f"({jax.default_backend()}; on CPU simulate more with "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={n} set before importing jax)")
  arr = device_grid(shape, devices)
  if chosen:
    distributed.check_mesh_covers(arr.flat)
  return _mesh(arr)


def _physical(shape: tuple, devices: list) -> np.ndarray:
  """devices laid out as `shape` along the physical topology where mesh_utils can tile it (a
  TPU slice), else in their order."""
  try:
    from jax.experimental import mesh_utils

    return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
  except Exception:  # topologies mesh_utils cannot tile: plain device order is still correct
    return np.asarray(devices).reshape(shape)


def device_grid(shape: tuple, devices: list) -> np.ndarray:
  """The [data, model] array of devices for a mesh of `shape`. Over several processes that each
  hold the same number of devices, with a model axis that fits in one process's devices, each
  process's devices are laid out on their own (model innermost) and the processes stacked along
  data, so the model axis's collectives stay within a host; mesh_utils over all devices would
  follow the slice's topology instead and may put one model group across hosts. Otherwise: the
  first prod(shape) devices along the topology."""
  n = math.prod(shape)
  model = shape[1]
  by_process: dict = {}
  for d in devices:
    by_process.setdefault(getattr(d, "process_index", 0), []).append(d)
  local = {len(v) for v in by_process.values()}
  if n == len(devices) and len(by_process) > 1 and len(local) == 1:
    per = local.pop()
    if per % model == 0:
      groups = [sorted(by_process[p], key=lambda d: d.id) for p in sorted(by_process)]
      return np.concatenate([_physical((per // model, model), g) for g in groups], axis=0)
  return _physical(shape, devices) if n == len(devices) else np.asarray(devices[:n]).reshape(shape)


def _from_mesh(spec: Mesh) -> Mesh:
  """An existing Mesh as specjax's ("data", "model") mesh (its axes a subset of those)."""
  unknown = [a for a in spec.axis_names if a not in AXES]
  if unknown:
    raise ShardingError(f"mesh has unknown axis name(s) {unknown}; specjax meshes use axes "
                        f"{AXES} (build one with sj.sharding.make_mesh('data=2,model=4'))")
  if tuple(spec.axis_names) == AXES:
    return spec
  sizes = dict(spec.shape)
  arr = np.asarray(spec.devices).reshape(-1)
  shape = tuple(sizes.get(a, 1) for a in AXES)
  return _mesh(arr.reshape(shape))


def _axis_sizes(spec) -> dict:
  """None | {"model": 8} | "data=2,model=4" -> axis -> size (-1: the rest), checked: known axes,
  integer sizes >= 1 or -1, at most one -1."""
  if spec is None:
    sizes = {"data": 1, "model": 1}
  elif isinstance(spec, dict):
    sizes = dict(spec)
  elif isinstance(spec, str):
    sizes = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
      name, eq, val = part.partition("=")
      name = name.strip()
      try:
        size = int(val)
      except ValueError:
        size = None
      if not eq or size is None:
        raise ShardingError(f"mesh={spec!r}: {part!r} is not 'axis=size' (e.g. 'data=2,model=4')")
      if name in sizes:
        raise ShardingError(f"mesh={spec!r}: axis {name!r} given twice")
      sizes[name] = size
  else:
    raise ShardingError(f"mesh={spec!r}: expected a string like 'data=2,model=4', a dict, "
                        f"or a jax.sharding.Mesh")
  unknown = [a for a in sizes if a not in AXES]
  if unknown:
    raise ShardingError(f"mesh={spec!r}: unknown axis name(s) {unknown}; allowed: {', '.join(AXES)}")
  for a, s in sizes.items():
    if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or (s < 1 and s != -1):
      raise ShardingError(f"mesh={spec!r}: axis {a}={s!r} must be an integer >= 1 (or -1: the rest)")
  if list(sizes.values()).count(-1) > 1:
    raise ShardingError(f"mesh={spec!r}: at most one axis may be -1")
  return sizes


def _mesh(arr: np.ndarray) -> Mesh:
  # Auto axes: classic GSPMD propagation from the constraints we set (not sharding-in-types).
  return Mesh(arr, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def axis_size(mesh: Mesh, axes) -> int:
  """Devices along a PartitionSpec entry (None, "model", or ("data", "model"))."""
  if axes is None:
    return 1
  names = axes if isinstance(axes, tuple) else (axes,)
  return math.prod(mesh.shape[a] for a in names)


def mesh_of(tree) -> Mesh | None:
  """The mesh a pytree's arrays are sharded on (first NamedSharding found with > 1 device)."""
  for x in jax.tree_util.tree_leaves(tree):
    s = getattr(x, "sharding", None)
    if isinstance(s, NamedSharding) and s.mesh.size > 1:
      return s.mesh
  return None


# ----------------------------------------------------------------------------- parameters


def path_str(path) -> str:
  """A jax tree path (or specjax flat key tuple) -> "layers/0/attn/wqkv"."""
  from specjax.model import path_key

  key = path if isinstance(path, tuple) and all(isinstance(k, (str, int)) for k in path) \
      else path_key(path)
  return "/".join(str(k) for k in key)


@dataclasses.dataclass(frozen=True)
class Fallback:
  """One tensor whose rule could not apply as written."""
  path: str
  shape: tuple
  dim: int
  axes: Any
  wanted: int  # devices along `axes`
  spec: P  # what it got instead


def _check_rules(mesh: Mesh, rules) -> None:
  for i, rule in enumerate(rules):
    if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[1], P)):
      raise ShardingError(f"rules[{i}]={rule!r} must be a (regex, PartitionSpec) pair")
    for axes in rule[1]:
      for a in (axes if isinstance(axes, tuple) else (axes,)):
        if a is not None and a not in mesh.axis_names:
          raise ShardingError(f"rules[{i}] ({rule[0]!r}) uses unknown mesh axis {a!r}; "
                              f"the mesh has {tuple(mesh.axis_names)}")


def spec_for(mesh: Mesh, path: str, shape: tuple, rules=None,
             strict: bool = False) -> tuple[P, list[Fallback]]:
  """The first matching rule's PartitionSpec for a tensor, made to fit its shape.

  Dimensions that do not divide by their axes are replicated instead (a Fallback each), or with
  strict=True raise ShardingError.
  """
  rules = DEFAULT_RULES if rules is None else rules
  for pattern, spec in rules:
    if re.search(pattern, path):
      break
  else:
    spec = P()
  entries = list(spec) + [None] * (len(shape) - len(spec))
  if len(entries) > len(shape):
    raise ShardingError(f"rule {pattern!r} gives {spec} ({len(spec)} dims) to parameter {path} "
                        f"of shape {tuple(shape)}")
  falls = []
  for d, axes in enumerate(entries):
    n = axis_size(mesh, axes)
    if n > 1 and shape[d] % n:
      if strict:
        raise ShardingError(f"parameter {path} {tuple(shape)}: dim {d} ({shape[d]}) does not "
                            f"divide by mesh axis {axes!r} of size {n}")
      entries[d] = None
      falls.append((d, axes, n))
  out = P(*entries)
  return out, [Fallback(path, tuple(shape), d, a, n, out) for d, a, n in falls]


def _warn(fallbacks: list[Fallback]) -> None:
  """Says once which rules fell back (one line per distinct tensor kind, not per layer)."""
  if not fallbacks:
    return
  kinds = {}
  for f in fallbacks:
    kind = re.sub(r"/\d+/", "/*/", f.path)
    kinds.setdefault((kind, f.shape, f.dim, f.axes, f.wanted), []).append(f)
  lines = [f"  {kind} {list(shape)}: dim {dim} ({shape[dim]}) does not divide by {axes}={n}; "
           f"replicated on that dim ({len(fs)} tensor{'s' if len(fs) > 1 else ''})"
           for (kind, shape, dim, axes, n), fs in sorted(kinds.items(), key=str)]
  warnings.warn("sharding fell back to replication (see sj.sharding.memory_report):\n"
                + "\n".join(lines), ShardingFallbackWarning, stacklevel=3)


def param_specs(mesh: Mesh, params, rules=None, strict: bool = False):
  """(tree of PartitionSpec like params, [Fallback]) for any pytree of arrays or shape structs."""
  rules = DEFAULT_RULES if rules is None else rules
  _check_rules(mesh, rules)
  falls: list[Fallback] = []

  def one(path, x):
    spec, f = spec_for(mesh, path_str(path), tuple(x.shape), rules, strict)
    falls.extend(f)
    return spec

  return jax.tree_util.tree_map_with_path(one, params), falls


def put(x, sharding: NamedSharding) -> jax.Array:
  """Places a host (numpy) or device array with `sharding`, building only this process's shards.

  x may also be a host value read by slices (anything with .shape and x[index] -> numpy, e.g. a
  checkpoint tensor being loaded, specjax.lazy.Slices): only this process's devices' slices are
  read. Multi-host: a host value must be the same on every process (as a loaded checkpoint is)."""
  if isinstance(x, jax.Array):
    if x.sharding == sharding:
      return x
    if jax.process_count() == 1:
      return jax.device_put(x, sharding)
    x = to_host(x)
  if not (hasattr(x, "shape") and hasattr(x, "__getitem__")):
    x = np.asarray(x)
  return jax.make_array_from_callback(tuple(x.shape), sharding, lambda idx: x[idx])


def shard_params(mesh, params, rules=None, *, strict: bool = False, warn: bool = True):
  """Places a pytree of parameters (a Model's params, a draft's, optax state) by the rules.

  Works on any pytree: paths are matched by `re.search`, so optax's ("0", "mu", "layers", 0,
  "attn", "wqkv") gets the same spec as the parameter itself. Arrays already placed right are
  returned as they are.
  """
  mesh = make_mesh(mesh)
  specs, falls = param_specs(mesh, params, rules, strict)
  if warn:
    _warn(falls)
  return jax.tree_util.tree_map(lambda x, s: put(x, NamedSharding(mesh, s)), params, specs)


def placer(mesh, rules=None, *, strict: bool = False) -> Callable:
  """place(key, host) -> jax.Array for `model.from_flat(place=...)`: shards each tensor as it is
  converted, so the whole model never sits on one device. host: a numpy array, or a tensor read
  by slices (`reads_slices`: from_flat hands it a lazy.Slices, and each device's slice is read
  from the checkpoint as it is placed). Its `.fallbacks` lists what fell back; call `.done()` to
  warn about them once."""
  mesh = make_mesh(mesh)
  rules = DEFAULT_RULES if rules is None else rules
  _check_rules(mesh, rules)
  falls: list[Fallback] = []

  def place(key, arr):
    spec, f = spec_for(mesh, path_str(tuple(key)), tuple(arr.shape), rules, strict)
    falls.extend(f)
    return put(arr, NamedSharding(mesh, spec))

  place.fallbacks = falls
  place.done = lambda: _warn(falls)
  place.reads_slices = True
  return place


def shard_batch(mesh, batch, axis: str = "data"):
  """Splits every leaf's leading (example) dimension over `axis` (data-parallel training).

  batch: a pytree of [N, ...] host or device arrays; N must divide by the axis size.
  """
  mesh = make_mesh(mesh)
  n = mesh.shape[axis]

  def one(path, x):
    x = x if isinstance(x, jax.Array) else np.asarray(x)
    if x.ndim == 0 or x.shape[0] % n:
      raise ShardingError(f"batch leaf {path_str(path) or '<root>'} has shape {tuple(x.shape)}: "
                          f"its leading dim must divide by mesh axis {axis}={n}")
    return put(x, NamedSharding(mesh, P(axis)))

  return jax.tree_util.tree_map_with_path(one, batch)


def replicate(mesh, tree):
  """Every leaf replicated on every device of the mesh (scalars, keys, small tables)."""
  mesh = make_mesh(mesh)
  return jax.tree_util.tree_map(lambda x: put(x, NamedSharding(mesh, P())), tree)


def to_host(x) -> np.ndarray:
  """A device array as numpy on every process (gathers shards other hosts hold)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


# ----------------------------------------------------------------------------- memory


@dataclasses.dataclass
class MemoryReport:
  mesh: dict  # axis -> size
  total_bytes: int  # all parameters, once
  per_device_bytes: int  # the most any one device holds
  fallback_bytes: int  # per device: bytes held only because a rule fell back to replication
  fallbacks: list

  def __str__(self):
    mib = 1 << 20
    mesh = ",".join(f"{a}={s}" for a, s in self.mesh.items())
    out = (f"mesh {mesh}: params {self.total_bytes / mib:.1f} MiB total, "
           f"{self.per_device_bytes / mib:.1f} MiB per device")
    if self.fallbacks:
      out += (f" ({self.fallback_bytes / mib:.1f} MiB of it from {len(self.fallbacks)} tensors "
              f"replicated by fallback)")
    return out


def memory_report(mesh, params, rules=None) -> MemoryReport:
  """Per-device parameter bytes from shard shapes (params may be arrays or ShapeDtypeStructs)."""
  mesh = make_mesh(mesh)
  specs, falls = param_specs(mesh, params, rules)
  leaves = jax.tree_util.tree_leaves(params)
  spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda s: isinstance(s, P))
  total = per_dev = 0
  for x, s in zip(leaves, spec_leaves):
    item = np.dtype(x.dtype).itemsize
    total += math.prod(x.shape) * item
    per_dev += math.prod(NamedSharding(mesh, s).shard_shape(tuple(x.shape))) * item
  fb = 0
  flat = {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  seen = set()
  for f in falls:
    if f.path in seen:
      continue
    seen.add(f.path)
    x = flat[f.path]
    item = np.dtype(x.dtype).itemsize
    got = math.prod(NamedSharding(mesh, f.spec).shard_shape(f.shape)) * item
    fb += got - got // f.wanted  # what it would have been had the dim divided
  return MemoryReport(dict(mesh.shape), total, per_dev, fb, sorted(seen))


def device_bytes(tree) -> dict:
  """Bytes each device actually holds for a pytree of placed arrays: {device: bytes}."""
  out: dict = {}
  for x in jax.tree_util.tree_leaves(tree):
    for sh in x.addressable_shards:
      out[sh.device] = out.get(sh.device, 0) + sh.data.size * sh.data.dtype.itemsize
  return out


# ----------------------------------------------------------------------------- cache and state


def cache_spec(mesh: Mesh, num_kv_heads: int) -> P:
  """[B,K,S,D] K/V buffers: rows over data, kv heads over model where they divide."""
  return P("data", "model" if num_kv_heads % mesh.shape["model"] == 0 else None, None, None)


def check_batch(mesh: Mesh, batch: int) -> None:
  """Raises ShardingError (before anything compiles) if `batch` rows cannot split over data."""
  n = mesh.shape["data"]
  if batch % n:
    raise ShardingError(f"batch of {batch} prompts does not divide by mesh axis data={n}: pass a "
                        f"multiple of {n} prompts, or a mesh with a data axis dividing {batch}")


def check_model_axis(mesh: Mesh, params, rules=None) -> None:
  """Raises ShardingError if the model axis is > 1 but shards no parameter at all: every dim it
  was meant to split (heads, MLP width, vocab) is indivisible, so it would only waste devices."""
  n = mesh.shape["model"]
  if n == 1:
    return
  specs, falls = param_specs(mesh, params, rules)
  used = any("model" in [a for e in s for a in (e if isinstance(e, tuple) else (e,))]
             for s in jax.tree_util.tree_leaves(specs, is_leaf=lambda s: isinstance(s, P)))
  if not used:
    dims = sorted({f"{re.sub(r'/[0-9]+/', '/*/', f.path)} dim {f.dim}={f.shape[f.dim]}"
                   for f in falls})
    raise ShardingError(f"mesh axis model={n} divides none of the dimensions it splits "
                        f"({'; '.join(dims)}); choose a model size dividing the kv heads, "
                        f"MLP width or vocabulary")


def constrain_cache(mesh: Mesh, cache: KVCache) -> KVCache:
  """Inside jit: a KV cache's buffers pinned by `cache_spec`, its lengths [B] over data."""
  wsc = jax.lax.with_sharding_constraint
  layers = tuple({n: wsc(b, NamedSharding(mesh, cache_spec(mesh, b.shape[1])))
                  for n, b in layer.items()} for layer in cache.layers)
  return cache.replace(layers=layers, lengths=wsc(cache.lengths, NamedSharding(mesh, P("data"))))


def constrain_rows(mesh: Mesh, x: jax.Array) -> jax.Array:
  """Inside jit: a per-row array [B, ...] pinned with its rows over data."""
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("data")))


def constrain_replicated(mesh: Mesh, tree):
  """Inside jit: every array of a pytree pinned whole on every device."""
  return jax.tree_util.tree_map(
      lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P())), tree)


def replicate_outputs(mesh: Mesh | None, state):
  """Inside jit: everything but KV caches replicated, so every process can read the result."""
  if mesh is None:
    return state

  def one(x):
    if isinstance(x, KVCache) or x is None or not hasattr(x, "shape"):
      return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P()))

  return jax.tree_util.tree_map(one, state, is_leaf=lambda x: isinstance(x, KVCache))


def rows(mesh: Mesh, tree):
  """Places [B, ...] inputs (prompts, lengths, sampling params) with rows over data."""
  return jax.tree_util.tree_map(lambda x: put(x, NamedSharding(mesh, P("data"))), tree)
