"""What the one-layer drafters (EAGLE, MTP, EAGLE-3) share: a target `Block` over their own arrays.

A feature drafter's params are flat, every tensor with a leading [K] (one entry per module), and
its layer's tensors sit under "layer." + the target Block's own path ("layer.attn.wqkv"), so the
layer has exactly the target's layer type. `module_arrays` nests module k's tensors (so sharding
rules see ".../layer/attn/wqkv"), `pack_module` adds kernel-packed copies of its dense weights,
and `block` merges one target Block over them for a module to call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.errors import InputError
from specjax.model import Block, path_key, rms_unit, rope_inv_freq
from specjax.packing import LAYER_SITES, PREFIX, Packed, kernel_copy


@functools.lru_cache(maxsize=32)
def layer_template(config, dtype_name: str = "float32"):
  """(graphdef, abstract state) of one target `Block` for a ModelConfig (cached: hashable)."""
  abstract = nnx.eval_shape(lambda: Block(config, jnp.dtype(dtype_name), nnx.Rngs(0)))
  return nnx.split(abstract)


def layer_keys(config) -> dict:
  """{"layer.attn.wqkv": shape, ...} for one target Block."""
  _, abstract = layer_template(config)
  return {"layer." + ".".join(map(str, path_key(p))): tuple(x.shape)
          for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}


def block_params(config, seed: int) -> dict:
  """A fresh target Block's tensors by flat name ("layer.attn.wqkv": [E,Kv,G+2,D], ...), float32."""
  _, st = nnx.split(Block(config, jnp.float32, nnx.Rngs(seed)))
  return {"layer." + ".".join(map(str, path_key(p))): x
          for p, x in jax.tree_util.tree_flatten_with_path(st)[0]}


def identity(x):
  return x


def rms(x, scale, eps):
  """RMSNorm of x [...,E] with scale [E], in x's dtype."""
  return (scale * rms_unit(x, eps)).astype(x.dtype)


def rope(config, positions):
  """positions [B,T] -> (cos, sin) [B,T,D/2] of the target's global rope (None without rope)."""
  if config.position != "rope":
    return None
  angles = positions[..., None].astype(jnp.float32) * jnp.asarray(rope_inv_freq(config))
  return jnp.cos(angles), jnp.sin(angles)


def block(config, arrays: dict, dtype, packed: dict | None = None, input_norm: bool = True):
  """One target Block over a module's nested layer arrays {"attn": {"wqkv": ...}, ...}.
  input_norm False: the arrays hold no "attn_norm" and the block's input norm is the identity
  (published EAGLE-1/2 layers; EAGLE-3's layer norms its inputs itself). packed: `pack_module`'s
  copies by flat name ("layer.attn.wqkv"), set beside the weights they copy."""
  graphdef, abstract = layer_template(config, jnp.dtype(dtype).name)

  def leaf(path, x):
    d = arrays
    for p in path_key(path):
      if not input_norm and p == "attn_norm":
        return jnp.ones(x.shape, x.dtype)  # a placeholder; replaced by the identity below
      d = d[p]
    return d

  out = nnx.merge(graphdef, jax.tree_util.tree_map_with_path(leaf, abstract))
  if not input_norm:
    out.attn_norm = identity
  for name, arr in (packed or {}).items():  # "layer.attn.wqkv" -> block.attn.packed_wqkv
    parts = name.split(".")
    if parts[0] == "layer":
      setattr(_at_attr(out, parts[1:-1]), PREFIX + parts[-1], Packed(arr))
  return out


def module_arrays(params: dict, k: int) -> dict:
  """Module k of flat feature-head params -> a nested dict {"fc_w", "fc_b", ("norm_e",
  "norm_h"), "layer": {"attn": {"wqkv": ...}, ...}} (nested so sharding rules see
  ".../layer/attn/wqkv" and split the layer as they split the target's)."""
  out: dict = {}
  for name, x in params.items():
    parts = name.split(".")
    d = out
    for p in parts[:-1]:
      d = d.setdefault(p, {})
    d[parts[-1]] = x[k]
  return out


# The dense weights of one feature module, as (path in `module_arrays`' nested dict, weight -> the
# [K, N] matrix `dense` multiplies by): its fc, then its layer's products, which are the target's.
_DENSE = ((("fc_w",), lambda w, e: w),) + tuple((("layer",) + p, f) for p, f in LAYER_SITES)


def _at(d: dict, path: tuple):
  for p in path:
    d = d[p]
  return d


def _at_attr(obj, names):
  for n in names:
    obj = getattr(obj, n)
  return obj


def pack_module(mod: dict, qtype: str | None = None) -> dict:
  """`mod` (module_arrays) plus "packed": {path: packed copy} of its dense weights for
  specjax.kernels, so the module's few-row products (EAGLE-2's frontier, a catch-up over the
  accepted tokens) take the kernel's bandwidth path instead of XLA's 2-16-row GEMM path, as the
  target's own layers do. Call only for a packed target (the kernel available, float32).
  qtype (packing.drafter_qtype: beside a target on blocks): each weight rounded to GGUF blocks
  of that type, the module's float32 weight replaced by the blocks' values (its XLA products,
  past the kernel's rows, compute the same numbers) and the blocks as its packed copy."""
  e = mod["fc_w"].shape[-1]
  sites = _DENSE + ((("fuse_w",), lambda w, e: w),) if "fuse_w" in mod else _DENSE  # EAGLE's taps
  out, packed = _copy_nested(mod), {}
  for path, f in sites:
    w = _at(mod, path)
    values, packed[".".join(path)] = kernel_copy(np.asarray(f(w, e), np.float32), qtype)
    if values is not None:  # (blocks: the module's weight becomes their values)
      _at(out, path[:-1])[path[-1]] = jnp.asarray(values.reshape(w.shape), w.dtype)
  return dict(out, packed=packed)


def _copy_nested(d: dict) -> dict:
  return {k: _copy_nested(v) if isinstance(v, dict) else v for k, v in d.items()}


def check_vocab_ids(vocab, vocab_size: int) -> np.ndarray | None:
  if vocab is None:
    return None
  arr = np.asarray(vocab)
  if not (arr.ndim == 1 and arr.size > 0 and np.issubdtype(arr.dtype, np.integer)
          and arr.min() >= 0 and arr.max() < vocab_size and len(np.unique(arr)) == arr.size):
    raise InputError(f"vocab must be distinct token ids in [0, {vocab_size}) as a non-empty 1-D "
                     f"integer array, got shape {arr.shape} dtype {arr.dtype}")
  return arr.astype(np.int32)


def check_scale(scale) -> None:
  if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale < 0:
    raise InputError(f"scale={scale!r} is invalid: must be a number >= 0")
