"""Checkpoint tensors read on demand, one at a time, at the target dtype.

A `Tensor` stands for a checkpoint tensor that has not been read: a view of the file's memory map
(safetensors, and GGUF's float tensors) or a tensor that reading has to build (a dequantized GGUF
tensor). A family converter (specjax/arch) applies plain numpy to it — `.T`, `reshape`,
`np.split`, `np.stack`, `np.concatenate`, indexing, `w + 1.0` — and gets `Tensor`s back, whose
shapes are known at once: the converter's whole output is checked (names, shapes) before a byte of
weights is read.

`host(t, dtype)` then reads one parameter: the numpy operations run on the memory-mapped source,
so a parameter that is only a transpose / reshape / index / split of one source tensor stays a
view of the file, and the returned `Slices` reads each device's slice of it straight into `dtype`
(a multi-host process reads only its devices' slices). A parameter that needs a copy (a fused
projection, a GGUF q/k row un-permutation, a dequantized tensor, a norm plus one) is built whole,
once, and served by slices from that one copy. Data movement commutes with a cast, so a tensor that
reading builds anyway (dequantized: float32) is cast to `dtype` as soon as it is read; arithmetic
does not, so it runs in float32 on its inputs (tiny: norm vectors) and is cast after. For float32
everything is bit-identical to converting float32 numpy copies of the whole checkpoint.

Every source tensor is checked for NaN / inf: a tensor read whole when it is read, one served as a
view of the file slice by slice (each slice as it is read; a slice that fails has its whole source
tensor checked, for the message).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from specjax.errors import WeightsError

# Operations on a Tensor, by what a cast of their inputs does: "move" (data movement: the same
# values rearranged, a cast commutes with it) and "math" (values change: float32, cast after).
# Leaves: "view" (a view of a memory map: reading is free, slices are read on demand) and "read"
# (reading builds the tensor, e.g. dequantizes it).


def check_finite(arr: np.ndarray, name: str, where: str) -> None:
  """WeightsError if a tensor holds NaN or inf. Such a checkpoint otherwise loads without a word
  and generates garbage (NaN logits: every token the last vocabulary id). One sum per tensor
  finds it (NaN and inf propagate); only a non-finite sum, which large finite values can also
  overflow to, pays for the element-wise check. The sum accumulates in float32 (float64 for
  float64): half-precision sums are slow and overflow early."""
  if arr.dtype.kind in "biu":  # integer buffers hold no NaN
    return
  with np.errstate(over="ignore", invalid="ignore"):
    total = arr.sum(dtype=np.float64 if arr.dtype.itemsize > 4 else np.float32)
  if np.isfinite(total) or np.isfinite(arr).all():
    return
  bad = ~np.isfinite(arr)
  first = tuple(int(i) for i in np.argwhere(bad)[0])
  raise WeightsError(f"{where}: tensor {name!r} holds {int(bad.sum())} non-finite value(s) "
                     f"(NaN or inf; the first, {arr[first]}, at index {first}): the checkpoint "
                     f"is corrupt or was saved after training diverged")


def _joined(arrays) -> list:
  """Arrays of different dtypes (a float32 tensor beside a bfloat16 one) as float32, which holds
  every checkpoint float type exactly (numpy cannot promote bfloat16 with float16)."""
  kinds = {a.dtype for a in arrays if isinstance(a, np.ndarray)}
  if len(kinds) <= 1:
    return list(arrays)
  return [np.asarray(a, np.float32) for a in arrays]


def _joined_dtype(dtypes) -> np.dtype:
  kinds = set(dtypes)
  return kinds.pop() if len(kinds) == 1 else np.dtype(np.float32)


def _axis(axis: int, ndim: int) -> int:
  if not -ndim <= axis < ndim:
    raise np.exceptions.AxisError(axis, ndim)
  return axis % ndim


def _shape_of(x) -> tuple:
  return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


class Tensor(np.lib.mixins.NDArrayOperatorsMixin):
  """A checkpoint tensor, or numpy operations on checkpoint tensors, not read yet.

  shape and dtype are known; `np.asarray(t)` reads it whole; `host(t, dtype)` reads it for
  placing (see the module docstring). Supported: `.T`, `.transpose`, `.swapaxes`, `.reshape`,
  indexing, `np.stack` / `np.concatenate` / `np.split` / `np.transpose` / `np.swapaxes` /
  `np.reshape` / `np.expand_dims`, and element-wise arithmetic (+, -, *, /, numpy ufuncs)."""

  __slots__ = ("shape", "dtype", "kind", "name", "where", "_fn", "_inputs", "_views")

  def __init__(self, shape, dtype, kind: str, fn: Callable, inputs=(), *, name: str = "",
               where: str = "", views: bool = False):
    self.shape = tuple(int(s) for s in shape)
    self.dtype = np.dtype(dtype)
    self.kind = kind  # "view" | "read" | "move" | "math"
    self.name, self.where = name, where
    self._fn = fn
    self._inputs = tuple(inputs)
    self._views = views  # a "move" numpy does by a view (transpose, basic index, split, reshape)

  # ------------------------------------------------------------------- what numpy asks of it

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def nbytes(self) -> int:
    return self.size * self.dtype.itemsize

  def __len__(self) -> int:
    return self.shape[0]

  def __repr__(self) -> str:
    what = f" {self.name!r}" if self.name else ""
    return f"lazy.Tensor({self.kind}{what}, shape={self.shape}, dtype={self.dtype})"

  def __array__(self, dtype=None, copy=None):
    """The whole tensor, read and checked (np.asarray(t); what read_checkpoint returns)."""
    arr = self._eval(None, {}, True)
    out = arr if dtype is None else arr.astype(dtype, copy=False)
    return np.array(out) if copy else out

  # ------------------------------------------------------------------- data movement

  def _move(self, shape, fn, views: bool, dtype=None) -> "Tensor":
    return Tensor(shape, self.dtype if dtype is None else dtype, "move", fn, (self,), views=views)

  def transpose(self, *axes) -> "Tensor":
    if len(axes) == 1 and (axes[0] is None or isinstance(axes[0], (tuple, list))):
      axes = axes[0]
    axes = (tuple(reversed(range(self.ndim))) if not axes
            else tuple(_axis(a, self.ndim) for a in axes))
    if sorted(axes) != list(range(self.ndim)):
      raise ValueError(f"axes {axes} do not match a {self.ndim}-d tensor")
    return self._move([self.shape[a] for a in axes], lambda x: x.transpose(axes), True)

  @property
  def T(self) -> "Tensor":
    return self.transpose()

  def swapaxes(self, a: int, b: int) -> "Tensor":
    axes = list(range(self.ndim))
    a, b = _axis(a, self.ndim), _axis(b, self.ndim)
    axes[a], axes[b] = axes[b], axes[a]
    return self.transpose(axes)

  def reshape(self, *shape, order="C") -> "Tensor":
    if order != "C":
      raise ValueError("lazy.Tensor.reshape: only order='C'")
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
      shape = shape[0]
    shape = [int(s) for s in shape]
    if shape.count(-1) == 1:
      rest = math.prod(s for s in shape if s != -1)
      shape[shape.index(-1)] = self.size // rest if rest else 0
    if math.prod(shape) != self.size:
      raise ValueError(f"cannot reshape a tensor of shape {self.shape} into shape {tuple(shape)}")
    shape = tuple(shape)
    return self._move(shape, lambda x: x.reshape(shape), True)

  def __getitem__(self, index) -> "Tensor":
    # numpy's own indexing rules, on a stand-in that costs no memory (every stride 0)
    stand_in = np.broadcast_to(np.empty((), np.int8), self.shape)
    shape = stand_in[index].shape
    parts = index if isinstance(index, tuple) else (index,)
    basic = all(p is None or p is Ellipsis or isinstance(p, (slice, int, np.integer))
                for p in parts)
    return self._move(shape, lambda x: x[index], basic)

  def __array_function__(self, func, types, args, kwargs):
    if func not in _FUNCTIONS:
      names = ", ".join(f"np.{f.__name__}" for f in _FUNCTIONS)
      raise TypeError(f"np.{func.__name__} is not supported on a checkpoint tensor read on "
                      f"demand (specjax.lazy.Tensor; supported: {names}); np.asarray(t) reads "
                      f"it whole")
    return _FUNCTIONS[func](*args, **kwargs)

  # ------------------------------------------------------------------- arithmetic

  def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
    if method != "__call__" or kwargs or ufunc.nout != 1:
      return NotImplemented
    shape = np.broadcast_shapes(*(_shape_of(x) for x in inputs))

    def fn(*values):
      return ufunc(*values)

    return Tensor(shape, np.float32, "math", fn, inputs)

  # ------------------------------------------------------------------- reading

  def _eval(self, cast, memo: dict, check: bool) -> np.ndarray:
    """The tensor as numpy. cast: the target dtype, applied where reading builds a tensor anyway
    (data movement above it commutes with it) or after arithmetic; None keeps source dtypes.
    check: NaN / inf-check memory-mapped sources whole here (else the caller checks slices)."""
    key = (id(self), None if cast is None else np.dtype(cast).name)
    if key in memo:
      return memo[key]
    if self.kind == "view":
      out = self._fn()
      if check:
        check_finite(out, self.name, self.where)
    elif self.kind == "read":
      out = self._fn()
      check_finite(out, self.name, self.where)
      if cast is not None and out.dtype != cast:
        out = out.astype(cast)
    elif self.kind == "move":
      values = [x._eval(cast, memo, check) if isinstance(x, Tensor) else x for x in self._inputs]
      out = self._fn(*_joined(values))
    else:  # math: float32 inputs (norm vectors: small), the result cast as a whole
      values = [np.asarray(x._eval(None, memo, True), np.float32) if isinstance(x, Tensor) else x
                for x in self._inputs]
      out = np.asarray(self._fn(*values), np.float32)
      if cast is not None:
        out = out.astype(cast)
    memo[key] = out
    return out

  def _view_leaf(self) -> "Tensor | None":
    """The memory-mapped source tensor this is a plain view of (transposes, reshapes, basic
    indexing, splits down to one "view" leaf), else None."""
    t = self
    while (t.kind == "move" and t._views and len(t._inputs) == 1
           and isinstance(t._inputs[0], Tensor)):
      t = t._inputs[0]
    return t if t.kind == "view" else None


def leaf(name: str, shape, dtype, read: Callable[[], np.ndarray], *, mapped: bool,
         where: str = "") -> Tensor:
  """One checkpoint tensor. read() -> its array (shape, dtype): a view of a memory map
  (mapped=True: reading it costs nothing, its slices are read as placed) or an array reading
  builds (mapped=False: a dequantized tensor)."""
  return Tensor(shape, dtype, "view" if mapped else "read", read, name=name, where=where)


# ----------------------------------------------------------------------------- numpy functions


def _tensors(arrays) -> list:
  return [a if isinstance(a, Tensor) else np.asarray(a) for a in arrays]


def _stack(arrays, axis=0, out=None, **kw):
  if out is not None or kw:
    raise TypeError("np.stack on lazy tensors: only arrays and axis")
  arrays = _tensors(arrays)
  shapes = {_shape_of(a) for a in arrays}
  if len(shapes) != 1:
    raise ValueError(f"np.stack: all input arrays must have the same shape, got {sorted(shapes)}")
  shape = list(shapes.pop())
  axis = _axis(axis, len(shape) + 1)
  shape.insert(axis, len(arrays))
  return Tensor(shape, _joined_dtype(a.dtype for a in arrays), "move",
                lambda *xs: np.stack(xs, axis), arrays)


def _concatenate(arrays, axis=0, out=None, **kw):
  if out is not None or kw or axis is None:
    raise TypeError("np.concatenate on lazy tensors: only arrays and an integer axis")
  arrays = _tensors(arrays)
  shapes = [_shape_of(a) for a in arrays]
  axis = _axis(axis, len(shapes[0]))
  rest = {s[:axis] + s[axis + 1:] for s in shapes}
  if len(rest) != 1 or len({len(s) for s in shapes}) != 1:
    raise ValueError(f"np.concatenate: shapes {shapes} differ outside axis {axis}")
  shape = list(shapes[0])
  shape[axis] = sum(s[axis] for s in shapes)
  return Tensor(shape, _joined_dtype(a.dtype for a in arrays), "move",
                lambda *xs: np.concatenate(xs, axis), arrays)


def _split(ary, indices_or_sections, axis=0):
  axis = _axis(axis, ary.ndim)
  n = ary.shape[axis]
  if isinstance(indices_or_sections, (int, np.integer)):
    if n % indices_or_sections:
      raise ValueError("array split does not result in an equal division")
    step = n // indices_or_sections
    cuts = [step * i for i in range(1, int(indices_or_sections))]
  else:
    cuts = [int(i) for i in indices_or_sections]
  bounds = [0] + cuts + [n]
  lead = (slice(None),) * axis
  return [ary[lead + (slice(a, max(a, b)),)] for a, b in zip(bounds[:-1], bounds[1:])]


def _expand_dims(a, axis):
  axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
  shape = list(a.shape)
  for ax in sorted(_axis(x, a.ndim + len(axes)) for x in axes):
    shape.insert(ax, 1)
  return a.reshape(shape)


_FUNCTIONS = {
    np.stack: _stack,
    np.concatenate: _concatenate,
    np.split: _split,
    np.transpose: lambda a, axes=None: a.transpose(axes),
    np.swapaxes: lambda a, axis1, axis2: a.swapaxes(axis1, axis2),
    np.reshape: lambda a, shape=None, order="C", **kw: a.reshape(kw.get("newshape", shape),
                                                                order=order),
    np.expand_dims: _expand_dims,
}


# ----------------------------------------------------------------------------- reading for placing


def _index_key(index) -> tuple:
  return tuple((i.start, i.stop, i.step) if isinstance(i, slice) else i for i in index)


class Slices:
  """One parameter ready to place: `slices[index]` is a new numpy array of that index (a shard) in
  `dtype`, what `jax.make_array_from_callback` asks for per device. Read from the memory map
  where the parameter is a view of it; the same index asked twice (devices that replicate a
  shard) is read once. np.asarray(slices) is the whole parameter."""

  def __init__(self, arr: np.ndarray, dtype, source: Tensor | None = None,
               source_arr: np.ndarray | None = None):
    self._arr = arr
    self.dtype = np.dtype(dtype)
    self.shape = tuple(arr.shape)
    self.ndim = len(self.shape)
    self._source, self._source_arr = source, source_arr  # checked slice by slice when set
    self._read: dict = {}

  def __getitem__(self, index) -> np.ndarray:
    index = index if isinstance(index, tuple) else (index,)
    key = _index_key(index)
    if key not in self._read:
      out = np.array(self._arr[index], self.dtype)
      if self._source is not None:
        try:
          check_finite(out, self._source.name, self._source.where)
        except WeightsError:
          # The message names the source's own count and index; a finite source that the
          # cast overflowed (float16) is not the checkpoint's fault, and loads as before.
          check_finite(self._source_arr, self._source.name, self._source.where)
          self._source = None
      self._read[key] = out
    return self._read[key]

  def __array__(self, dtype=None, copy=None):
    out = self[(slice(None),) * self.ndim]
    self._read.clear()
    return out if dtype is None else out.astype(dtype)


def host(x, dtype) -> Slices:
  """A parameter (a Tensor, or a numpy array) read for placing at `dtype`: see the module
  docstring. A numpy array is served as it is (its slices converted)."""
  dtype = np.dtype(dtype)
  if not isinstance(x, Tensor):
    return Slices(np.asarray(x), dtype)
  source = x._view_leaf()
  memo: dict = {}
  arr = x._eval(dtype, memo, source is None)
  if source is None:
    return Slices(arr, dtype)
  whole = memo[(id(source), dtype.name)]
  if np.may_share_memory(arr, whole):
    return Slices(arr, dtype, source, whole)  # a view: slices read from the file, checked each
  check_finite(whole, source.name, source.where)  # numpy copied (a reshape of a transpose)
  return Slices(arr, dtype)
