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
XLA (SmolLM2's shipped draft: 3.0 -> 1.9 ms a forward). A draft being trained is built unpacked.
The model reads a copy where it multiplies (model._packed).

Packed copies are a load-time transform: `weights.load_model` makes them (`maybe_pack`: by default
on a single CPU device in float32, or bfloat16 where the CPU has AVX512-BF16, unless
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
  unavailable (warned once), if its dtype is neither (or bfloat16 on a CPU without AVX512-BF16:
  warned), or if it is already packed. head=False leaves the LM head unpacked: a draft that
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
  if dtype == jnp.bfloat16 and not kernels.matmul.bf16_available():
    if warn:
      warnings.warn("specjax.kernels: bfloat16 weights need AVX512-BF16, which this CPU (or the "
                    "forced kernel path) lacks; using XLA", KernelFallbackWarning, stacklevel=2)
    return model
  nt = kernels.threads()
  module = model.module()
  for site, owner, name, w, transposed in _keyed_sites(module):
    if head or site != ("head",):
      setattr(owner, name, Packed(jnp.asarray(kernels.pack_weight(
          np.asarray(w), transposed=transposed, num_threads=nt))))
  return _rebuild(model, module)


def pack_blocks(model, blocks: dict):
  """Like `pack`, with a site's GGUF blocks as its packed copy where `blocks` has them.

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


def pack_int8(model, blocks: dict):
  """Every dense product on int8 activations times the GGUF's own blocks (the W4A8 target,
  `load_model(..., weights="blocks", activations="int8")`): each site's packed copy is the
  QWeight of its blocks (kernels/quant.py: Q4_1 on the integer-dot kernel, Q8_0 in XLA's integer
  dot), which multiplies itself. blocks: as for `pack_blocks`; every site must be there, of a
  type in quant.GGUF_TYPES (load_model checks the file before it reads it)."""
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
  if on_kernel(model):
    out[PREFIX + "head"] = jnp.asarray(kernels.pack_weight(np.asarray(rows), transposed=True))
  return out
