"""LoRA adapters on a target's layer matrices (Hu et al. 2021): Medusa-2's adapted backbone.

A matrix site W (its leading `IN_AXES[site]` axes are the input, the rest the output, in
specjax's layouts: model.py) gets W + (alpha / r) * (A @ B) reshaped to W's shape, A [in, r]
drawn N(0, 1 / in), B [r, out] zero: the adapted model starts out as the original, exactly.

    adapters = init(target, rank=8, sites=("wqkv", "wo", "w_in", "w_out"))
    params = merge(target.params, adapters, alpha / rank)     # differentiable; inside the loss
    model = merged_model(target, adapters, scale)             # a Model with merged weights

    model = adapted_model("medusa2.npz", target)              # the adapters of an asset, merged

adapters: {"layers.<i>.<block>.<site>": {"a": [in, r], "b": [r, out]}} (plain dict of float32).
The embedding, norms and LM head are never adapted. In a Medusa-2 asset (training/medusa2.py
writes it) they are float16 arrays named LORA_PREFIX + "<name>.a" / ".b" beside the heads, with
the header's "lora": {"rank", "alpha", "sites"}. This module reads them without any training code,
so `sj.load_model("smollm2-135m-medusa2")` needs none.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import InputError, check_int
from specjax.shipped import adapted_name

LORA_PREFIX = "__lora__."
IN_AXES = {"wqkv": 1, "wo": 2, "w_in": 1, "w_out": 1}  # leading axes that form a site's input
SITES = tuple(IN_AXES)


def _name(path) -> str:
  from specjax.model import path_key

  return ".".join(map(str, path_key(path)))


def site_shapes(params, sites=SITES) -> dict:
  """{adapter name: (in, out)} of every matrix of `params` (a Model's params) at `sites`."""
  out = {}
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = _name(path)
    site = name.rsplit(".", 1)[-1]
    if name.startswith("layers.") and site in sites:
      k = IN_AXES[site]
      out[name] = (math.prod(x.shape[:k]), math.prod(x.shape[k:]))
  return out


def check_sites(sites) -> tuple:
  """sites: a comma-separated string or a sequence of names from SITES -> a tuple."""
  if isinstance(sites, str):
    sites = tuple(s.strip() for s in sites.split(",") if s.strip())
  sites = tuple(sites)
  bad = [s for s in sites if s not in IN_AXES]
  if not sites or bad:
    raise InputError(f"lora sites {list(sites)} are invalid: choose among {', '.join(SITES)}")
  return sites


def init(target, rank: int = 8, sites=SITES, seed: int = 0) -> dict:
  """Fresh adapters for `target` (A random, B zero: no change to the model until trained)."""
  sites = check_sites(sites)
  shapes = site_shapes(target.params, sites)
  width = min(min(s) for s in shapes.values())
  check_int("rank", rank, 1, width, f" (at most the smallest adapted matrix side, {width})")
  key = jax.random.PRNGKey(seed)
  out = {}
  for i, (name, (n_in, n_out)) in enumerate(sorted(shapes.items())):
    a = jax.random.normal(jax.random.fold_in(key, i), (n_in, rank), jnp.float32) / np.sqrt(n_in)
    out[name] = {"a": a, "b": jnp.zeros((rank, n_out), jnp.float32)}
  return out


def merge(params, adapters: dict, scale: float):
  """params with every adapted matrix W replaced by W + scale * (a @ b) (in W's dtype)."""

  def one(path, x):
    ad = adapters.get(_name(path))
    if ad is None:
      return x
    delta = (scale * (ad["a"] @ ad["b"])).reshape(x.shape)
    return (x.astype(jnp.float32) + delta).astype(x.dtype)

  return jax.tree_util.tree_map_with_path(one, params)


def merged_model(target, adapters: dict, scale: float, name: str = ""):
  """A Model sharing `target`'s config and tokenizer whose weights have the adapters merged in
  (packed again for the CPU kernel if `target` was packed)."""
  from specjax import packing
  from specjax.model import Model

  packed = packing.is_packed(target)
  base = packing.unpack(target) if packed else target
  params = jax.jit(merge, static_argnums=2)(base.params, adapters, float(scale))
  out = Model(base.config, base.graphdef, params, base.tokenizer, name=name or base.name,
              dtype=base.dtype)
  return packing.pack(out, warn=False) if packed else out


def flat(adapters: dict) -> dict:
  """{"<name>.a": array, "<name>.b": array} (for files)."""
  return {f"{n}.{k}": np.asarray(v[k]) for n, v in adapters.items() for k in ("a", "b")}


def unflat(arrays: dict) -> dict:
  out: dict = {}
  for key, x in arrays.items():
    name, k = key.rsplit(".", 1)
    out.setdefault(name, {})[k] = jnp.asarray(np.asarray(x, np.float32))
  return out


def read_adapters(path: str) -> tuple[dict, dict]:
  """(adapters, header) of a Medusa-2 asset; WeightsError if the file holds no adapters."""
  import json

  from specjax import validate
  from specjax.errors import WeightsError

  with validate.npz(path, "a Medusa-2 asset (specjax train medusa2 --export)") as z:
    header = json.loads(bytes(z["__header__"]).decode())
    arrays = {k[len(LORA_PREFIX):]: z[k] for k in z.files if k.startswith(LORA_PREFIX)}
  if not header.get("medusa2") or not arrays:
    raise WeightsError(f"{path}: not a Medusa-2 asset (no adapters): Medusa-1 heads load with "
                       f"sj.load_heads alone")
  return unflat(arrays), header


def adapted_model(path: str, target, *, asset: tuple[dict, dict] | None = None):
  """`target` (the original Model) with a Medusa-2 asset's adapters merged in; InputError if
  they were trained for another target (a site or shape that differs). asset: what
  `read_adapters(path)` returned already (the file is then not read again)."""
  adapters, header = asset if asset is not None else read_adapters(path)
  want = site_shapes(target.params, header["lora"]["sites"])
  got = {n: (a["a"].shape[0], a["b"].shape[1]) for n, a in adapters.items()}
  if got != want:
    bad = sorted(set(got) ^ set(want)) or [n for n in want if want[n] != got[n]]
    raise InputError(f"{path}: adapters for another target (first mismatch {bad[0]!r}: "
                     f"{got.get(bad[0])} vs this target's {want.get(bad[0])})")
  lc = header["lora"]
  return merged_model(target, adapters, lc["alpha"] / lc["rank"], name=adapted_name(target.name))
