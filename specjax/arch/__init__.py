"""Model families, one module each, and the one table that picks a family by model_type.

A family module owns everything specific to its architecture:
  MODEL_TYPES / GGUF_ARCHS       the HF model_type values and GGUF architectures it reads;
  config_from_hf(f, model_type)  an HF config.json (an HFFields) -> ModelConfig, its per-layer
                                 attention pattern (windows, rope) included;
  params_from_hf(cfg, src)       HF safetensors names -> specjax flat params (model.py layouts);
  check_tensors(cfg, src, where) a missing tensor the config implies, named before any is read;
and, for GGUF: config_from_gguf(fields, arch, source), GGUF_NAMES / GGUF_LAYER_NAMES (llama.cpp
names -> HF names), gguf_permuted(cfg) and optionally gguf_tensor(cfg, hf_name, w) (a stored value
-> HF's, e.g. Gemma's norms stored as 1 + w). Adding a family is one module here plus its tests
(tests/arch/); model.py reads only the ModelConfig.

`src.get(name, shape)` returns the checkpoint tensor not read yet (specjax.lazy.Tensor): write
plain numpy on it (`.T`, reshape, indexing, np.split / np.stack / np.concatenate, arithmetic) and
it is recorded, then run one parameter at a time as the model is placed (specjax/weights.py).
"""

from __future__ import annotations

import os

from specjax.arch import gemma, gpt2, llama, phi3
from specjax.config import HFFields, ModelConfig, read_hf_json
from specjax.errors import ConfigError

FAMILIES = (llama, gemma, phi3, gpt2)
BY_MODEL_TYPE = {t: fam for fam in FAMILIES for t in fam.MODEL_TYPES}
BY_GGUF_ARCH = {a: fam for fam in FAMILIES for a in fam.GGUF_ARCHS}
SUPPORTED = tuple(BY_MODEL_TYPE)


def family(model_type: str, source: str = "config"):
  """The family module for an HF model_type; ConfigError listing the supported ones."""
  if model_type not in BY_MODEL_TYPE:
    raise ConfigError(f"{source}: unsupported architecture model_type={model_type!r}; "
                      f"supported: {', '.join(SUPPORTED)}")
  return BY_MODEL_TYPE[model_type]


def from_hf_dict(hf: dict, *, source: str = "config.json") -> ModelConfig:
  """An HF config.json's dict -> ModelConfig; ConfigError naming the file, field and value."""
  if not isinstance(hf, dict):
    raise ConfigError(f"{source}: expected a JSON object of config fields, got a "
                      f"{type(hf).__name__}")
  model_type = hf.get("model_type")
  if model_type is None:
    raise ConfigError(f"{source}: no 'model_type' field")
  f = HFFields(hf, source)
  cfg = family(model_type, source).config_from_hf(f, model_type)
  try:
    cfg.validate()
  except ConfigError as e:
    raise ConfigError(f"{source}: {e}") from None
  return cfg


def from_hf_dir(path: str | os.PathLike) -> ModelConfig:
  hf, file = read_hf_json(path)
  return from_hf_dict(hf, source=file)


def from_gguf_fields(fields: dict, *, source: str) -> ModelConfig:
  """GGUF metadata (decoded to Python values) -> ModelConfig."""
  arch = fields.get("general.architecture")
  if arch not in BY_GGUF_ARCH:
    raise ConfigError(f"{source}: unsupported GGUF architecture {arch!r}; supported: "
                      f"{', '.join(BY_GGUF_ARCH)}")
  cfg = BY_GGUF_ARCH[arch].config_from_gguf(fields, arch, source)
  cfg.validate()
  return cfg


def of(cfg: ModelConfig):
  """The family module of a loaded config."""
  return family(cfg.arch)
