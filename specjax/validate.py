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

Beside numbers, booleans and token ids: dtypes (`dtype`), counts written like "2M" (`count`),
load_model's settings a draft would ignore (`draft_settings`), and the files a user hands over:
.npz asset files (`npz`: an empty, truncated or foreign file is a WeightsError naming the file and
what it should hold) and files a long run writes at its end (`writable_file`: checked before the
run, not after it). The CLI checks its flags with the same functions, a flag's name ("--top-p")
as the argument's name.

The ground floor: imports only specjax.errors, numpy and the standard library.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import zipfile
import zlib
from typing import Sequence

import numpy as np

from specjax.errors import InputError, SpecJaxError, WeightsError

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


def _label(name: str, value) -> str:
  """How a rejected value is named: "name=value" for an argument, "--flag value" for a
  command-line flag (the CLI checks its flags with these same functions), the value alone
  without a name."""
  if name.startswith("--"):
    return f"{name} {value!r}"
  return f"{name}={value!r}" if name else repr(value)


def int_range(lo: int, hi: int | None) -> str:
  """The allowed integers as text: "in [lo, hi]" or ">= lo"."""
  return f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"


def number_range(lo: float | None, hi: float | None, lo_open: bool = False,
                 hi_open: bool = False) -> str:
  """The allowed interval as text, e.g. "in (0, 1]" or "in [0, inf)"."""
  left = "-inf" if lo is None else lo
  right = "inf" if hi is None else hi
  return (f"in {'(' if lo_open or lo is None else '['}{left}, "
          f"{right}{')' if hi_open or hi is None else ']'}")


def integer(name: str, value, lo: int = 0, hi: int | None = INT32_MAX, what: str = "") -> int:
  """value as an int in [lo, hi] (hi None: no upper bound), else InputError. Bools and floats
  (8.0 too: an integer argument given as a float is usually a computed value gone wrong) are
  rejected; numpy / JAX integer scalars are accepted."""
  v = scalar(value)
  rng = int_range(lo, hi)
  if isinstance(v, bool) or not isinstance(v, int):
    raise InputError(f"{_label(name, value)} is invalid: must be an integer {rng}{what}, "
                     f"not {_kind(value)}")
  if v < lo or (hi is not None and v > hi):
    raise InputError(f"{_label(name, value)} is invalid: must be an integer {rng}{what}")
  return v


def number(name: str, value, lo: float | None = None, hi: float | None = None, *,
           lo_open: bool = False, hi_open: bool = False, what: str = "") -> float:
  """value as a finite float in the interval from lo to hi (None: unbounded; *_open: that end
  excluded), else InputError. Ints and numpy / JAX float scalars are accepted, bools and NaN
  are not."""
  v = scalar(value)
  rng = number_range(lo, hi, lo_open, hi_open)
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    raise InputError(f"{_label(name, value)} is invalid: must be a finite number {rng}{what}, "
                     f"not {_kind(value)}")
  try:
    v = float(v)
  except OverflowError:  # an int too large for a float
    v = math.inf
  ok = math.isfinite(v) and (lo is None or (v > lo if lo_open else v >= lo)) and (
      hi is None or (v < hi if hi_open else v <= hi))
  if not ok:
    raise InputError(f"{_label(name, value)} is invalid: must be a finite number {rng}{what}")
  return v


def boolean(name: str, value) -> bool:
  """value as a bool, else InputError: only True / False (and numpy / JAX bools), never a
  string such as "no" (truthy) or an int."""
  v = scalar(value)
  if not isinstance(v, bool):
    raise InputError(f"{_label(name, value)} is invalid: must be True or False, not {_kind(value)}")
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


# ----------------------------------------------------------------------------- dtypes and counts

DTYPES = ("float32", "bfloat16", "float16")  # what a model's params can be held in


def dtype(name: str, value, allowed: Sequence[str] = DTYPES) -> str | None:
  """A floating dtype given by name ("bfloat16", "f4") or as a numpy / JAX dtype (jnp.bfloat16,
  np.dtype("float32")) -> its name, one of `allowed`; None stays None (the caller's default).
  An unknown name, a number, an integer dtype, ... is an InputError naming what is allowed
  (numpy's own error names nothing of the caller's)."""
  if value is None:
    return None
  key = None
  if isinstance(value, str):
    key = value.strip().lower()
  if key not in allowed and not isinstance(value, (bool, int, float)):
    try:
      key = np.dtype(value).name
    except (TypeError, ValueError, KeyError, SyntaxError):
      key = None
  if key not in allowed:
    raise InputError(f"{_label(name, value)} is invalid: must be one of {', '.join(allowed)} "
                     f"(a name or a numpy / JAX dtype), or None for the default")
  return key


COUNT_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9}


def count(name: str, value, lo: int = 1) -> int:
  """A count given as an integer or as text: "2000000", "2_000_000", "500k", "2M", "1.5k" ->
  int >= lo. Text that is not a whole number ("inf", "2.5", "abc") is an InputError."""
  import decimal

  v = scalar(value)
  n = None
  if isinstance(v, int) and not isinstance(v, bool):
    n = v
  elif isinstance(v, str):
    s = v.strip().lower().replace("_", "")
    mult = COUNT_SUFFIXES.get(s[-1:], 1)
    try:
      d = decimal.Decimal(s[:-1] if mult > 1 else s) * mult
    except decimal.InvalidOperation:
      d = None
    if d is not None and d.is_finite() and d == d.to_integral_value():
      n = int(d)
  if n is None or n < lo:
    raise InputError(f"{_label(name, value)} is invalid: must be a whole count "
                     f"{int_range(lo, None)}, like 2000000, 500k or 2M")
  return n


# ----------------------------------------------------------------------------- files


@contextlib.contextmanager
def npz(path, what: str):
  """Opens the .npz archive at `path` for reading inside the block (no pickles). A missing,
  empty, truncated or foreign file, or an array the block asks for that is not there, is a
  WeightsError naming the file and `what` it should be (e.g. "heads written by sj.save_heads"),
  not numpy's EOFError or zipfile's BadZipFile."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise WeightsError(f"{path}: no such file; expected {what}")
  if os.path.getsize(path) == 0:
    raise WeightsError(f"{path} is empty (0 bytes); expected {what}")
  try:
    z = np.load(path, allow_pickle=False)
  except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
    raise WeightsError(f"{path} is not a readable .npz archive (truncated, or another kind of "
                       f"file: {type(e).__name__}: {e}); expected {what}") from e
  if not isinstance(z, np.lib.npyio.NpzFile):
    raise WeightsError(f"{path} holds a single array (.npy), not a .npz archive; expected {what}")
  try:
    with z:
      yield z
  except SpecJaxError:
    raise
  except KeyError as e:  # NpzFile's message: "<name> is not a file in the archive"
    name = str(e.args[0] if e.args else e).split(" is not a file")[0]
    raise WeightsError(f"{path} has no array {name!r} (it holds {', '.join(z.files) or 'none'}); "
                       f"expected {what}") from e
  except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
    raise WeightsError(f"{path}: an array cannot be read (truncated or damaged: "
                       f"{type(e).__name__}: {e}); expected {what}") from e


def writable_file(name: str, path, suffix: str | None = None) -> str:
  """A file a long run writes at its end (an export), checked before the run starts: a path
  (ending in `suffix`, if given) that is not a folder, under a writable folder (or under the
  nearest existing folder above it, where the writer creates the rest). Creates nothing;
  returns the absolute path."""
  if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
    raise InputError(f"{_label(name, path)} is invalid: must be a file path")
  full = os.path.abspath(os.fspath(path))
  if suffix and not full.endswith(suffix):
    raise InputError(f"{_label(name, path)} is invalid: must end in {suffix}")
  if os.path.isdir(full):
    raise InputError(f"{_label(name, path)} is a folder: give a file path in it, e.g. "
                     f"{os.path.join(os.fspath(path), 'out' + (suffix or '.npz'))}")
  folder = os.path.dirname(full)
  while not os.path.exists(folder):
    folder = os.path.dirname(folder)
  if not os.path.isdir(folder):
    raise InputError(f"{_label(name, path)} cannot be written: {folder} is a file, not a folder")
  try:
    with tempfile.TemporaryFile(dir=folder):
      pass
    if os.path.exists(full) and not os.access(full, os.W_OK):
      raise PermissionError(13, "the file is read-only")
  except OSError as e:
    raise InputError(f"{_label(name, path)} cannot be written: folder {folder} is not writable "
                     f"({e.strerror or e})") from None
  return full


def draft_settings(name: str, *, weights: str, dtype: str | None, drafter: bool,
                   on_target: bool, target_dtype=None) -> None:
  """load_model's settings that a shipped draft (drafter: `name` is one) or a draft built on an
  already loaded target (on_target; target_dtype: that target's dtype) cannot honour, as an
  InputError rather than ignored: weights="blocks" (a draft is built from its target's float32
  tensors and has no GGUF blocks of its own) and, on a target, a dtype other than the target's."""
  if weights == "blocks" and (drafter or on_target):
    what = "with target=" if on_target else f"for the shipped draft {name!r}"
    raise InputError(f"weights='blocks' is invalid {what}: a draft is built from its target's "
                     f"tensors and has no GGUF blocks of its own; weights='blocks' applies to a "
                     f"model loaded from a .gguf, e.g. load_model('smollm2-135m', "
                     f"weights='blocks'). Allowed here: weights='float32'")
  if on_target and dtype is not None and target_dtype is not None and \
      dtype != np.dtype(target_dtype).name:
    raise InputError(f"dtype={dtype!r} is invalid with target=: a draft built on a loaded target "
                     f"runs in the target's dtype ({np.dtype(target_dtype).name}); load the "
                     f"target in {dtype} or leave dtype unset")
