"""Exceptions a user can act on. Each names the argument or file, its value and what is allowed."""


class SpecJaxError(Exception):
  """Base class of every error specjax raises on purpose."""


class ConfigError(SpecJaxError, ValueError):
  """A model configuration specjax cannot run (unsupported architecture, bad fields)."""


class WeightsError(SpecJaxError, ValueError):
  """Missing, unexpected, mis-shaped or unreadable tensors in a checkpoint."""


class ModelNotFoundError(SpecJaxError, FileNotFoundError):
  """An unknown model name, or a path holding no model."""


class InputError(SpecJaxError, ValueError):
  """A bad argument to generate() or a method constructor."""


def check_int(name: str, value, lo: int, hi: int | None = None, what: str = "") -> None:
  """Raises InputError unless value is an integer in [lo, hi] (hi=None: no upper bound)."""
  import numpy as np

  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo or (
      hi is not None and value > hi):
    rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
    raise InputError(f"{name}={value!r} is invalid: must be an integer in {rng}{what}"
                     if hi is not None else f"{name}={value!r} is invalid: must be an integer {rng}{what}")
