"""Packed copies of a model's dense weights for the CPU matmul kernel (specjax/kernels/matmul.py).

Which weights. `LAYER_SITES` lists the dense products of one decoder layer (model.Block) and how
each weight becomes the [K, N] matrix `kernels.dense` multiplies by. A target packs them in every
layer plus its LM head (`pack`); an EAGLE / MTP module packs them in its one layer plus its fc
(heads.pack_module). One list, so a dense product added to the layer is packed everywhere.

Where the packed copies live. `pack(model)` adds one `Packed` variable beside each dense weight of
the module tree (`layers.i.attn.packed_wqkv`, `packed_wo`, `layers.i.mlp.packed_w_in`,
`packed_w_out`, and `packed_head` on the decoder, from `embed` transposed when the head is tied)
and returns a new Model whose `params` State and `graphdef` carry them. So they travel wherever
params go (through `jax.jit`, `decode.Program.forward`, a method's `arrays`) with no change to any
caller, while every original parameter keeps its name, shape and value: code that reads
`model.params["layers"][0]["attn"]["wqkv"]`, shares an embedding with a draft, or builds a draft
from a target's tensors works unchanged. A draft model that `load_model` builds from a target's
tensors (a shipped draft, a draft asset) is packed like its target, its LM head too unless it
scores a vocabulary subset: its one- and two-token forwards are where the kernel gains most over
XLA (measured: docs/performance.md). A draft being trained is built unpacked. The model reads a
copy where it multiplies (model._packed).

Blocks of a model's own. `to_blocks(model, qtype)` rounds a float32 model's dense weights to GGUF
blocks (Q8_0, Q4_0, Q4_1, by gguf's reference quantizer) and packs those for the blocks kernel, as
`load_model(..., weights="blocks")` packs a GGUF's stored blocks. Beside a target on blocks, its
drafters take blocks too (`drafter_qtype`: Q8_0 unless $SPECJAX_DRAFTER_BLOCKS says otherwise): a
named draft model, EAGLE / MTP modules' products (drafters/layer.pack_module) and every
vocabulary subset's head rows (`subset_head`), so that a drafter's forward costs what its bytes
cost next to the target's (`dense_bytes`, which the defaults read).

Packed copies are a load-time transform: `weights.load_model` makes them (`maybe_pack`: by default
on a single CPU device in float32 or bfloat16, unless
SPECJAX_KERNELS is "0"; `kernels=False` never packs;
`kernels=True` packs or warns), nothing saves them (drafts' own tensors and checkpoints are
written from unpacked models), and they are derived data: if you change a packed model's
parameters, call `pack` again (or `unpack`) so the copies follow.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import kernels
from specjax.kernels import KernelFallbackWarning
from specjax.model import Model, head_rows

PREFIX = "packed_"  # a packed copy of weight `w` is the variable `packed_w` beside it


class Packed(nnx.Variable):
  """A load-time re-layout of a dense weight for the kernel [nb, K, bw]; never saved or trained."""


# The dense products of one decoder layer: (path of the weight from the layer, weight -> the
# [K, N] matrix `dense` multiplies by, given the model width e).
LAYER_SITES = (
    (("attn", "wqkv"), lambda w, e: w.reshape(e, -1)),  # [E,K,G+2,D] -> [E, K*(G+2)*D]
    (("attn", "wo"), lambda w, e: w.reshape(-1, e)),  # [H,D,E] -> [H*D, E]
    (("mlp", "w_in"), lambda w, e: w.reshape(e, -1)),  # [E,M,F] -> [E, M*F]
    (("mlp", "w_out"), lambda w, e: w),  # [F,E]
)


def _attr(obj, names):
  for n in names:
    obj = getattr(obj, n)
  return obj


def _keyed_sites(decoder):
  """(site, owner module, packed attribute name, weight [K,N] or [N,K], transposed) for every
  dense product of a model.Decoder: LAYER_SITES in each layer, then the head; site is the
  weight's path ("layers", i, "attn", "wqkv") or ("head",)."""
  e = decoder.cfg.hidden_size
  for i, block in enumerate(decoder.layers):
    for path, as_matrix in LAYER_SITES:
      owner = _attr(block, path[:-1])
      yield (("layers", i) + path, owner, PREFIX + path[-1],
             as_matrix(getattr(owner, path[-1])[...], e), False)
  if decoder.cfg.tie_word_embeddings:
    yield ("head",), decoder, PREFIX + "head", decoder.embed[...], True
  else:
    yield ("head",), decoder, PREFIX + "head", decoder.lm_head[...], False


def dense_sites(decoder):
  """(owner module, packed attribute name, weight [K,N] or [N,K], transposed) for every dense
  product of a model.Decoder, in _keyed_sites' order: where a packed or quantized copy goes."""
  for _, *rest in _keyed_sites(decoder):
    yield tuple(rest)


def _rebuild(model, module):
  graphdef, params = nnx.split(module)
  new = Model(model.config, graphdef, params, model.tokenizer, name=model.name, dtype=model.dtype,
              shared=model.shared)
  for k, v in vars(model).items():  # extras a loader attached (vocab_subset, asset_header, ...)
    if k not in vars(new):
      setattr(new, k, v)
  return new


def is_packed_path(path) -> bool:
  """Whether a params leaf's key path (jax.tree_util) names a packed copy."""
  return PREFIX in jax.tree_util.keystr(path)


def is_packed(model) -> bool:
  """Whether the model's params carry packed copies."""
  return any(is_packed_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(model.params))


def on_kernel(model) -> bool:
  """Whether the model runs its few-row products on the kernel (packed, and the kernel loads):
  a drafter working beside it then packs its own dense weights too."""
  return is_packed(model) and kernels.available()


def pack(model, *, warn: bool = True, head: bool = True):
  """A new Model whose params also carry packed copies of every dense weight (see the module
  docstring), float32 or bfloat16 as the model's weights; the model itself if the kernel is
  unavailable (warned once), if its dtype is neither, or if it is already packed. head=False leaves the LM head unpacked: a draft that
  scores a vocabulary subset never multiplies by the whole head (subset_head packs its rows)."""
  if is_packed(model):
    return model
  dtype = jnp.dtype(model.dtype)
  if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    if warn:
      warnings.warn(f"specjax.kernels: {model.dtype} weights are not supported (float32 or "
                    f"bfloat16 only); using XLA", KernelFallbackWarning, stacklevel=2)
    return model
  if not kernels.available():
    return model
  nt = kernels.threads()
  module = model.module()
  for site, owner, name, w, transposed in _keyed_sites(module):
    if head or site != ("head",):
      setattr(owner, name, Packed(jnp.asarray(kernels.pack_weight(
          np.asarray(w), transposed=transposed, num_threads=nt))))
  return _rebuild(model, module)


def pack_blocks(model, blocks: dict, *, head: bool = True):
  """Like `pack`, with a site's GGUF blocks as its packed copy where `blocks` has them (head:
  as for `pack`).

  blocks: {site: (rows uint8 [N, K/block * bytes], type name)} as gguf_file.gguf_blocks returns
  (rows in the output order of the [K, N] matrix the model multiplies by). Those products read
  the stored blocks (kernels.blocks_dense); every other site gets the fp32 packed copy. The
  blocks encode the same numbers as the model's float32 parameters (which stay, for prefill's
  XLA products and for training), so logits agree up to summation order."""
  if is_packed(model):
    model = unpack(model)
  nt = kernels.threads()
  module = model.module()
  for site, owner, name, w, transposed in _keyed_sites(module):
    if site == ("head",) and not head:
      continue
    n = w.shape[0] if transposed else w.shape[1]
    k = w.shape[1] if transposed else w.shape[0]
    if site in blocks:
      rows, kind = blocks[site]
      if rows.shape[0] != n:
        raise ValueError(f"blocks for {site}: {rows.shape[0]} rows, the weight has {n} outputs")
      packed = kernels.pack_blocks(rows, n, k, kind)
    else:
      packed = kernels.pack_weight(np.asarray(w), transposed=transposed, num_threads=nt)
    setattr(owner, name, Packed(jnp.asarray(packed)))
  return _rebuild(model, module)


BLOCK_QUANTS = ("Q8_0", "Q4_0", "Q4_1")  # what `to_blocks` quantizes to (gguf's own quantizer)


def quantize_rows(rows, qtype: str):
  """rows [N, K] float -> (the GGUF blocks [N, K/32 * bytes] uint8, their values [N, K] float32),
  by gguf's reference quantizer (the one llama.cpp's conversion scripts use)."""
  from gguf import GGMLQuantizationType, quants

  kind = GGMLQuantizationType[qtype]
  raw = quants.quantize(np.asarray(rows, np.float32), kind)
  return raw, np.asarray(quants.dequantize(raw, kind), np.float32).reshape(np.shape(rows))


def block_copy(rows, qtype: str):
  """rows [N, K] float -> (their values once rounded to `qtype` blocks [N, K] float32, the blocks
  packed for the kernel), or None where K is not whole blocks of 32: a drafter's own weight
  beside a target on blocks (drafter_qtype)."""
  n, k = np.shape(rows)
  if k % 32:
    return None
  raw, values = quantize_rows(rows, qtype)
  return values, jnp.asarray(kernels.pack_blocks(raw, n, k, qtype))


def kernel_copy(mat, qtype: str | None):
  """A drafter's dense weight mat [K, N] float32 -> (values, copy): its copy for the kernel, as
  GGUF blocks of `qtype` (drafter_qtype; block_copy) where given and K is whole blocks, else in
  the float32 kernel's layout; values [K, N] the weight's values once rounded to those blocks,
  for the drafter's own float weight (None: unchanged)."""
  copy = None if qtype is None else block_copy(np.asarray(mat).T, qtype)
  if copy is None:
    return None, jnp.asarray(kernels.pack_weight(np.asarray(mat)))
  values, packed = copy
  return np.asarray(values).T, packed


BYTES_PER_WEIGHT = {"Q8_0": 34 / 32, "Q4_0": 18 / 32, "Q4_1": 20 / 32}


def dense_bytes(model) -> tuple[float, float]:
  """(bytes per weight of the layers' dense products, of the LM head) as a forward at batch 1
  reads them: the packed copies' bytes where the model has them (a GGUF's blocks: their block
  sizes), else the dtype's. What the defaults compare drafters' costs by (methods/defaults.py)."""
  c = model.config
  item = float(jnp.dtype(model.dtype).itemsize)
  layer_w = sum(np.prod(np.shape(w)) for site, _, _, w, _ in _keyed_sites(model.module())
                if site != ("head",))
  layers = head = 0.0
  for path, x in jax.tree_util.tree_leaves_with_path(model.params):
    key = jax.tree_util.keystr(path)
    if PREFIX + "head" in key:
      head += getattr(x, "nbytes", 0)
    elif PREFIX in key:
      layers += getattr(x, "nbytes", 0)
  return (layers / layer_w if layers else item,
          head / (c.vocab_size * c.hidden_size) if head else item)


def drafter_bytes(model) -> float:
  """Bytes per weight a drafter beside `model` reads for its own dense weights and subset head
  rows: its blocks' (drafter_qtype), else float32's (drafters are float32)."""
  qtype = drafter_qtype(model)
  return BYTES_PER_WEIGHT[qtype] if qtype else 4.0


DRAFTER_ENV = "SPECJAX_DRAFTER_BLOCKS"


def drafter_qtype(model) -> str | None:
  """The block type a drafter beside `model` rounds its own dense weights and its vocabulary
  subset's head rows to, so that they run on the blocks kernel as the target does: the model's
  own (`to_blocks`), or Q8_0 beside a target on a GGUF's blocks (SmolLM2's and Gemma 3's files
  store their heads so; a quarter of float32's bytes). None (float32 packed copies) for any
  other target, off the kernel, or where $SPECJAX_DRAFTER_BLOCKS is "0" ("Q4_0" / "Q4_1" /
  "Q8_0" choose the type). Drafting changes, never the output: the target verifies."""
  import os

  if getattr(model, "weights", "float32") != "blocks" or not on_kernel(model):
    return None
  env = os.environ.get(DRAFTER_ENV, "").strip().upper()
  if env == "0":
    return None
  if env:
    if env not in BLOCK_QUANTS:
      from specjax.errors import InputError
      raise InputError(f"${DRAFTER_ENV}={env!r} is invalid: must be 0 or one of "
                       f"{', '.join(BLOCK_QUANTS)}")
    return env
  return getattr(model, "blocks_qtype", None) or "Q8_0"


def to_blocks(model, qtype: str = "Q8_0", *, head: bool = True, strict: bool = True):
  """A float32 model on GGUF blocks of its own: every dense weight (the head too unless
  head=False) quantized to `qtype` (BLOCK_QUANTS) by `quantize_rows`, its float32 parameter
  replaced by the blocks' values, and the blocks as its packed copy (`pack_blocks`), so the
  model's few-row products run on the blocks kernel and its prefill's XLA products compute the
  same numbers. For a draft beside a target on `weights="blocks"`: the draft then reads a
  quarter (Q8_0) or an eighth (Q4_*) of its float32 bytes per forward. The model changes (its
  weights are rounded); speculative decoding stays exact, since the target verifies. A tied head
  rounds the embedding too (one table, as in a GGUF file). Every product's K must be a multiple
  of 32 (strict=False: a product whose K is not stays float32, on the float32 kernel)."""
  from specjax.errors import InputError

  if qtype not in BLOCK_QUANTS:
    raise InputError(f"qtype={qtype!r} is invalid: must be one of {', '.join(BLOCK_QUANTS)}")
  if jnp.dtype(model.dtype) != jnp.float32 or not single_cpu_device():
    raise InputError(f"to_blocks: a float32 model on one CPU device; got dtype={model.dtype} "
                     f"on {len(jax.devices())} device(s)")
  if is_packed(model):
    model = unpack(model)
  module = model.module()
  blocks = {}
  for site, owner, name, w, transposed in _keyed_sites(module):
    if site == ("head",) and not head:
      continue
    rows = np.asarray(w) if transposed else np.asarray(w).T  # [N, K]
    if rows.shape[1] % 32 and not strict:
      continue
    if rows.shape[1] % 32:
      raise InputError(f"to_blocks: {'.'.join(map(str, site))} has K={rows.shape[1]}, not a "
                       f"multiple of 32")
    raw, values = quantize_rows(rows, qtype)
    # the head's weight: the embedding when tied (transposed), else lm_head. A new variable:
    # the model's own (shared with the caller's params) keeps its value.
    pname = name[len(PREFIX):] if site != ("head",) else ("embed" if transposed else "lm_head")
    old = getattr(owner, pname)
    setattr(owner, pname, type(old)(jnp.asarray(
        (values if transposed else values.T).reshape(old[...].shape), old[...].dtype)))
    blocks[site] = (raw, qtype)
  # head=False: the head stays float32 and unpacked (a draft scoring a vocabulary subset)
  out = pack_blocks(_rebuild(model, module), blocks, head=head)
  out.weights = "blocks"
  out.blocks_qtype = qtype
  return out


def pack_int8(model, blocks: dict):
  """Every dense product on int8 activations times the GGUF's own blocks (the W4A8 target,
  `load_model(..., weights="blocks", activations="int8")`): each site's packed copy is the
  QWeight of its blocks (kernels/quant.py, `from_gguf`: Q4_0 / Q4_1 / Q4_K as Q4_1 blocks, Q8_0 /
  Q5_0 as Q8_0 blocks, Q6_K as a QSum of two Q8_0 halves; on the integer-dot kernel where it is
  available, else XLA's integer dot), which multiplies itself. blocks: as for `pack_blocks`;
  every site must be there, of a type in quant.GGUF_TYPES (load_model checks the file before it
  reads it)."""
  from specjax.kernels import quant

  if is_packed(model):
    model = unpack(model)
  module = model.module()
  for site, owner, name, w, transposed in _keyed_sites(module):
    n = w.shape[0] if transposed else w.shape[1]
    k = w.shape[1] if transposed else w.shape[0]
    if site not in blocks or blocks[site][1] not in quant.GGUF_TYPES:
      kind = blocks[site][1] if site in blocks else "float"
      raise ValueError(f"int8 activations: {'.'.join(map(str, site))} is {kind}; the int8 path "
                       f"multiplies {sorted(quant.GGUF_TYPES)} blocks")
    rows, kind = blocks[site]
    setattr(owner, name, Packed(quant.from_gguf(rows, n, k, kind)))
  return _rebuild(model, module)


def unpack(model):
  """The model without its packed copies (XLA everywhere)."""
  if not is_packed(model):
    return model
  module = model.module()
  for owner, name, _, _ in dense_sites(module):
    if hasattr(owner, name):
      delattr(owner, name)
  return _rebuild(model, module)


def on_cpu_devices(model) -> bool:
  """Whether the model's weights live on CPU devices: where the CPU kernels run and a forward
  shares the host's cores (decided from the arrays, not from jax.default_backend())."""
  leaf = next(iter(jax.tree_util.tree_leaves(model.params)), None)
  try:
    return all(d.platform == "cpu" for d in leaf.devices())
  except AttributeError:  # no arrays (or abstract ones): where jax runs by default
    return jax.default_backend() == "cpu"


def single_cpu_device() -> bool:
  devices = jax.devices()
  return len(devices) == 1 and devices[0].platform == "cpu"


def maybe_pack(model, kernels_on: bool | None, *, head: bool = True):
  """load_model's policy: None = pack if SPECJAX_KERNELS allows, on one CPU device, in float32
  or bfloat16; True = pack (warning if impossible); False = never. head: as for `pack`."""
  if kernels_on is False or (kernels_on is None and (
      kernels.switched_off() or not single_cpu_device()
      or jnp.dtype(model.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)))):
    return model
  if kernels_on is True and not single_cpu_device():
    warnings.warn("specjax.kernels: the kernel runs on a single CPU device only; using XLA",
                  KernelFallbackWarning, stacklevel=3)
    return model
  return pack(model, head=head)


def subset_head(model, ids) -> dict:
  """{"vocab": ids [Vs], "head": head_rows [Vs,E]} for a drafter scoring a vocabulary subset
  (model.subset_logits), plus "packed_head" (the rows packed for the kernel) when the target runs
  on it: drafters score 1-32 rows at a time (EAGLE-2's frontier, Medusa's heads), where XLA's
  GEMM path is slowest."""
  ids = jnp.asarray(ids)
  rows = head_rows(model.config, model.params, ids)
  out = {"vocab": ids, "head": rows}
  qtype = drafter_qtype(model)  # beside a model on blocks: the rows as blocks too
  copy = None if qtype is None else block_copy(np.asarray(rows), qtype)
  if copy is not None:
    out["head"], out[PREFIX + "head"] = jnp.asarray(copy[0]), copy[1]
  elif on_kernel(model):
    out[PREFIX + "head"] = jnp.asarray(kernels.pack_weight(np.asarray(rows), transposed=True))
  return out
