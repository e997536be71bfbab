"""Checks of user-facing arguments: every entry point (sj.generate, the loaders, bench, the CLI)
uses these, so the same bad value gets the same error everywhere.

Each checker returns the value as a plain Python object (int, float, bool, list[int]) or raises
InputError naming the argument, the value and what is allowed, before anything loads or compiles.
They exist because Python's own types let wrong values through silently:
- bool is a subclass of int, so `True` passes `isinstance(x, int)` and `stop_at_eos="no"` is
  truthy; here bools are not integers and only bools are booleans;
- bytes is a sequence of ints, so `b"text"` passes as token ids; here it is rejected;
- numpy and JAX scalars (np.int64(8), jnp.float32(0.5), a 0-d array) are not int / float
  instances, yet they are the numbers users hold; here they are accepted and converted;
- device integers are int32 and PRNG seeds 64-bit: a larger Python int overflows inside JAX with
  an error that names nothing of the caller's, so the ranges are checked here first.

The ground floor: imports only specjax.errors and numpy.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from specjax.errors import InputError

INT32_MAX = 2**31 - 1  # device integers (lengths, top_k, token ids) are int32
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # jax.random.PRNGKey takes a 64-bit signed seed


def scalar(value):
  """A numpy or JAX scalar (or 0-d array) as the Python bool / int / float it holds; anything
  else unchanged (so the checkers below can reject it by its own type)."""
  if isinstance(value, (bool, int, float)):
    return value
  dtype, shape = getattr(value, "dtype", None), getattr(value, "shape", None)
  if dtype is None or shape != ():
    return value
  try:
    dtype = np.dtype(dtype)
  except TypeError:
    return value
  if dtype.kind == "b":
    return bool(value)
  if dtype.kind in "iu":
    return int(value)
  if dtype.kind == "f" or "float" in dtype.name:  # bfloat16 is not kind "f"
    return float(value)
  return value


def _is_array(value) -> bool:
  """A numpy or JAX array (anything with a shape that numpy can read)."""
  return hasattr(value, "__array__") and hasattr(value, "shape")


def _kind(value) -> str:
  """How a rejected value is described: its type's name."""
  return type(value).__name__


def integer(name: str, value, lo: int = 0, hi: int | None = INT32_MAX, what: str = "") -> int:
  """value as an int in [lo, hi] (hi None: no upper bound), else InputError. Bools and floats
  (8.0 too: an integer argument given as a float is usually a computed value gone wrong) are
  rejected; numpy / JAX integer scalars are accepted."""
  v = scalar(value)
  rng = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
  if isinstance(v, bool) or not isinstance(v, int):
    raise InputError(f"{name}={value!r} is invalid: must be an integer {rng}{what}, "
                     f"not {_kind(value)}")
  if v < lo or (hi is not None and v > hi):
    raise InputError(f"{name}={value!r} is invalid: must be an integer {rng}{what}")
  return v


def number(name: str, value, lo: float | None = None, hi: float | None = None, *,
           lo_open: bool = False, hi_open: bool = False, what: str = "") -> float:
  """value as a finite float in the interval from lo to hi (None: unbounded; *_open: that end
  excluded), else InputError. Ints and numpy / JAX float scalars are accepted, bools and NaN
  are not."""
  v = scalar(value)
  left = "-inf" if lo is None else lo
  right = "inf" if hi is None else hi
  rng = (f"{'(' if lo_open or lo is None else '['}{left}, "
         f"{right}{')' if hi_open or hi is None else ']'}")
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    raise InputError(f"{name}={value!r} is invalid: must be a finite number in {rng}{what}, "
                     f"not {_kind(value)}")
  try:
    v = float(v)
  except OverflowError:  # an int too large for a float
    v = math.inf
  ok = math.isfinite(v) and (lo is None or (v > lo if lo_open else v >= lo)) and (
      hi is None or (v < hi if hi_open else v <= hi))
  if not ok:
    raise InputError(f"{name}={value!r} is invalid: must be a finite number in {rng}{what}")
  return v


def boolean(name: str, value) -> bool:
  """value as a bool, else InputError: only True / False (and numpy / JAX bools), never a
  string such as "no" (truthy) or an int."""
  v = scalar(value)
  if not isinstance(v, bool):
    raise InputError(f"{name}={value!r} is invalid: must be True or False, not {_kind(value)}")
  return v


def seed(name: str, value) -> int:
  """A PRNG seed: an integer in jax.random.PRNGKey's 64-bit signed range."""
  return integer(name, value, SEED_MIN, SEED_MAX, " (a 64-bit signed seed)")


def token_ids(name: str, ids, vocab_size: int) -> list[int]:
  """A sequence of token ids (a list / tuple of ints or a 1-d integer array) as list[int], each
  in [0, vocab_size). Bools, floats, strings and bytes are rejected with their index."""
  if not isinstance(ids, np.ndarray) and _is_array(ids):  # a JAX array
    ids = np.asarray(ids)
  if isinstance(ids, np.ndarray):
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
      raise InputError(f"{name} is a {ids.dtype} array of shape {ids.shape}: token ids must be "
                       f"a 1-d integer array or a list of ints")
    ids = ids.tolist()
  if isinstance(ids, (str, bytes, bytearray)) or not isinstance(ids, Sequence):
    raise InputError(f"{name} must be a list of token ids (ints), got {_kind(ids)}")
  out = []
  for j, t in enumerate(ids):
    v = scalar(t)
    if isinstance(v, bool) or not isinstance(v, int):
      raise InputError(f"{name}[{j}]={t!r} is invalid: token ids must be integers in "
                       f"[0, {vocab_size}), not {_kind(t)}")
    if not 0 <= v < vocab_size:
      raise InputError(f"{name} has token id {v} outside [0, {vocab_size}) (at index {j})")
    out.append(v)
  return out


def prompts(value, vocab_size: int, name: str = "prompts") -> list:
  """A list of prompts, each a string or token ids: -> list of str / list[int] (ids checked by
  `token_ids`). Bytes are rejected rather than read as ids (b"abc" is a sequence of ints)."""
  if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
    raise InputError(f"{name} must be a list of strings or a list of token-id lists, got "
                     f"{_kind(value)} (wrap a single prompt in a list: [prompt])")
  if len(value) == 0:
    raise InputError(f"{name} is empty: pass at least one prompt")
  out = []
  for i, p in enumerate(value):
    if isinstance(p, (bytes, bytearray)):
      raise InputError(f"{name}[{i}] is {_kind(p)}: pass text as str (e.g. "
                       f"{name}[{i}].decode('utf-8')) or token ids as a list of ints")
    if isinstance(p, str):
      out.append(p)
    elif isinstance(p, Sequence) or _is_array(p):
      out.append(token_ids(f"{name}[{i}]", p, vocab_size))
    else:
      raise InputError(f"{name}[{i}] must be a string or a list of token ids (ints), got "
                       f"{_kind(p)}")
  return out
