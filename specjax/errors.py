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
