"""The files a published drafter comes in: which container a path is (a directory, safetensors, a
torch zip or legacy pickle, numpy .npz), its tensors as numpy arrays and its config.json.

Pickles (.pt / .bin) are read with `torch.load(weights_only=True)` only, and refused unless they
hold a flat {name: tensor} dict. A container is told by a file's first bytes, never its name;
what the tensors are (the layout) is specjax.drafters.layouts' question.
"""

from __future__ import annotations

import json
import os
import zipfile

import numpy as np

from specjax.errors import WeightsError

# The layouts specjax.drafters.layouts recognises (named in the errors of a path it cannot read).
LAYOUTS = {
    "medusa-1": "FasterDecoding Medusa-1 (medusa_lm_head.safetensors / .pt: {i}.{j}.linear.weight, "
                "{i}.{L}.weight)",
    "medusa-vllm": "vLLM Medusa (blocks.{i}.layers.{j}.weight, lm_heads.{i}.weight, token_map)",
    "eagle": "SafeAILab EAGLE-1/2 (fc.weight [E,2E], layers.0.*)",
    "mtp-deepseek": "DeepSeek-V3-style MTP layers in an HF checkpoint (num_nextn_predict_layers; "
                    "model.layers.{L+k}.{enorm,hnorm,eh_proj,shared_head}.*)",
    "eagle3": "SafeAILab EAGLE-3 (fc.weight [E,3E], midlayer.*, lm_head.weight [Vd,E], d2t, t2d)",
    "dflash": "z-lab DFlash (config.json dflash_config; fc.weight [E,nE], hidden_norm.weight, "
              "layers.{i}.self_attn.{q,k}_norm.weight)",
    "npz": "specjax's own heads (.npz from save_heads)",
}


def _layout_list() -> str:
  return "; ".join(f"{k}: {v}" for k, v in LAYOUTS.items())


# Trainer state an HF output directory may hold beside the weights: never read.
_NOT_WEIGHTS = ("training_args.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


# ----------------------------------------------------------------------------- containers


def container(path: str) -> str | None:
  """"safetensors" | "torch" | "npz" | None, from a file's first bytes (not its name)."""
  try:
    with open(path, "rb") as f:
      head = f.read(9)
  except OSError:
    return None
  if head[:2] == b"PK":  # a zip: torch.save's archive holds a data.pkl, numpy's .npz only .npy
    try:
      with zipfile.ZipFile(path) as z:
        names = z.namelist()
    except zipfile.BadZipFile:
      return None
    if any(n.endswith("data.pkl") for n in names):
      return "torch"
    return "npz" if names and all(n.endswith(".npy") for n in names) else None
  if head[:1] == b"\x80":  # a legacy (pre-zip) torch pickle
    return "torch"
  if len(head) == 9 and head[8:9] == b"{":  # u64 header length, then the JSON header
    return "safetensors"
  return None


def is_published(path: str) -> bool:
  """A directory, or a safetensors / torch file: read here rather than as our .npz."""
  return os.path.isdir(path) or container(path) in ("safetensors", "torch")


def _read_safetensors(path: str, keep=None) -> dict:
  from safetensors import safe_open

  keep = keep or (lambda name: True)
  out = {}
  try:
    with safe_open(path, framework="np") as f:
      for k in f.keys():
        if keep(k):
          out[k] = f.get_tensor(k)
  except Exception as e:  # e.g. bfloat16, which numpy cannot hold: torch reads it
    try:
      with safe_open(path, framework="pt") as f:
        return {k: _torch_to_numpy(f.get_tensor(k)) for k in f.keys() if keep(k)}
    except Exception:  # no torch, or a corrupt file: the first error says more
      raise WeightsError(f"{path}: cannot read safetensors file ({e})") from e
  return out


def _torch_to_numpy(t) -> np.ndarray:
  import torch

  if t.is_floating_point() and t.dtype not in (torch.float16, torch.float32, torch.float64):
    t = t.float()  # bfloat16 and float8: exact in float32
  return t.detach().cpu().numpy()


def _read_torch(path: str) -> dict:
  """A .pt / .bin: torch.load(weights_only=True), which unpickles tensors and plain containers
  only; anything but a flat {name: tensor} dict is refused too."""
  try:
    import torch
  except ImportError as e:
    raise WeightsError(f"{path}: a torch pickle needs torch installed to read it "
                       f"(safetensors files do not)") from e
  try:
    obj = torch.load(path, map_location="cpu", weights_only=True)
  except Exception as e:  # weights_only's UnpicklingError, or a corrupt archive
    raise WeightsError(f"{path}: refused: torch.load(weights_only=True) cannot read it as "
                       f"tensors only ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
  if not isinstance(obj, dict):
    raise WeightsError(f"{path}: refused: holds a {type(obj).__name__}, not a dict of tensors")
  bad = [k for k, v in obj.items() if not (isinstance(k, str) and isinstance(v, torch.Tensor))]
  if bad:
    raise WeightsError(f"{path}: refused: entry {bad[0]!r} is a {type(obj[bad[0]]).__name__}, "
                       f"not a tensor (a drafter file holds tensors only)")
  return {k: _torch_to_numpy(v) for k, v in obj.items()}


def _weight_files(path: str) -> list:
  if not os.path.isdir(path):
    return [path]
  names = sorted(n for n in os.listdir(path)
                 if n.endswith(_WEIGHT_SUFFIXES) and n not in _NOT_WEIGHTS)
  files = [os.path.join(path, n) for n in names]
  safe = [f for f in files if container(f) == "safetensors"]  # preferred: nothing to unpickle
  files = safe or [f for f in files if container(f) == "torch"]
  if not files:
    raise WeightsError(f"{path}: no drafter weights in this directory (expected .safetensors, "
                       f".bin or .pt files; recognised layouts: {_layout_list()})")
  return files


def tensors(path: str, keep=None) -> dict:
  """Every tensor of a drafter file or directory: {name: numpy array}; keep(name) -> bool, if
  given, selects the tensors to read (a safetensors file's others are never read)."""
  out = {}
  for f in _weight_files(path):
    kind = container(f)
    if kind == "safetensors":
      out.update(_read_safetensors(f, keep))
    elif kind == "torch":
      out.update({k: x for k, x in _read_torch(f).items() if keep is None or keep(k)})
    else:
      raise WeightsError(f"{f}: neither safetensors nor a torch archive (recognised layouts: "
                         f"{_layout_list()})")
  return out


def config_json(path: str) -> dict:
  """The config.json of a drafter directory, or beside a drafter file; {} if there is none."""
  d = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
  f = os.path.join(d, "config.json")
  if not os.path.isfile(f):
    return {}
  try:
    with open(f) as fh:
      cfg = json.load(fh)
  except (OSError, ValueError) as e:
    raise WeightsError(f"{f}: not readable JSON ({e})") from e
  return cfg if isinstance(cfg, dict) else {}
