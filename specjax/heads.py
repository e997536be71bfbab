"""Drafting heads on a frozen target: a frozen config plus a params pytree, and their file format.

    heads = sj.init_heads(target, "medusa", num_heads=4, seed=0)   # untrained
    heads = sj.load_heads("smollm2-135m-medusa")                  # shipped (specjax/assets)
    heads = sj.load_heads("my_heads.npz", target)                 # checked against the target
    save_heads(heads, "my_heads.npz")

Medusa-1 heads (Cai et al. 2024): head k (k = 0..K-1) reads the target's final-normed hidden state
h_t (what the target's LM head reads; Medusa applies its heads to the same tensor, the base model's
last hidden state after its final norm) and predicts token t + k + 2 (the target itself predicts
t + 1, the pending token). Each head is `num_layers` residual blocks x <- x + SiLU(x W + b)
followed by an LM head. W starts at zero (and b at zero here), so an untrained head is the target's
LM head. The LM head is the target's own, frozen and shared (no copy of the [V,E] matrix), scored
either over the whole vocabulary or over a subset `vocab` [Vs] of token ids (the matching rows of
the target's head: on a CPU the 49152 x 576 head of SmolLM2 is a fifth of the model's bytes, and
K heads read it once per step in one [B*K,E] x [E,V] matmul).

File format (.npz): the params as float16 arrays "w" [K,L,E,E] and "b" [K,L,E], "__vocab__" [Vs]
int32 (empty: the full vocabulary) and "__header__", a JSON header {format, kind, num_heads,
num_layers, hidden_size, vocab_size, target, ...}.

EAGLE and MTP heads (issue 12; same file format and I/O, other tensors) are K sequential modules
of one decoder layer each (EAGLE: K = 1), see `feature_module`. Their params are flat, every
tensor with a leading [K]: "fc_w" [K,2E,E], "fc_b" [K,E], for MTP also "norm_e" and "norm_h"
[K,E], and the layer's tensors under "layer." + the target Block's own path, e.g.
"layer.attn.wqkv" [K,E,Kv,G+2,D], so a head's layer has exactly the target's layer type.

Fused features (EAGLE-3's idea, Li et al. 2025: a low, a middle and the high layer's states rather
than the last one alone): an EAGLE head with `taps` = (i, j, ...) reads, instead of the target's
final-normed feature f_t, g_t = fuse_w^T [r_i(t); r_j(t); ...; f_t] + fuse_b, where r_i is the
residual stream after the target's first i layers, RMS-normalised without a scale (so a middle
layer's large activations enter on the same scale as f). "fuse_w" [1,(n+1)E,E], "fuse_b" [1,E].
Initialised (and grown from an unfused head, `add_taps`) as the identity on f and zero on the taps,
so such a head starts out computing exactly what the unfused one does. Only the first draft depth
reads g; deeper ones read the head's own outputs, as before. The target runs with
`Decoder(..., taps=)`, which returns the taps beside f.

EAGLE-3 heads (kind "eagle3", Li et al. 2025, as SafeAILab publishes them; specjax.drafters reads
and writes their files) are one module too, in the same flat params, and `sj.Eagle` runs them:
  "fuse_w" [1,3E,E]   fc (no bias) over cat(r_a, r_b, r_c), the RAW residual stream entering the
                      target's layers a, b, c = (2, L // 2, L - 3) (layouts.eagle3_taps; the target
                      runs with `Decoder(..., taps=, raw_taps=True)`; the final feature it returns
                      beside them is not read). Its output h is what the feature buffer holds.
  "norm_emb", "norm_hid" [1,E]   RMSNorm scales of the embedding and of h (input_layernorm,
                      hidden_norm); the layer's attention reads x = cat(norm_emb(emb), norm_hid(h))
                      [..,2E]: "layer.attn.wqkv" [1,2E,Kv,G+2,D], then h + attn is the residual,
                      and "layer.mlp_norm.scale", "layer.mlp.*" the MLP, as a Llama layer's.
  "norm" [1,E], "lm" [1,Vd,E]   the head's own final norm and LM head over its draft vocabulary
                      (vocab [Vd]: the target ids of its rows; None when Vd = V in order).
  "embed" [1,V,E]     optional: the head's own embedding (else the target's, shared).
Later draft depths feed the layer's output back as h, without the fc (as EAGLE-1/2 heads feed
their predicted feature back): exactly `feature_module`'s contract, so the drafting, the catch-up
and the tree code are EAGLE's. The layer is a Llama layer whatever the target's family
(`midlayer_config`: no biases, qk-norms or post-norms), with the target's attention shapes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import distributed, hub, sharding, shipped
from specjax.errors import InputError, ModelNotFoundError, WeightsError, check_int
from specjax.packing import LAYER_SITES

KINDS = ("medusa", "eagle", "mtp", "eagle3", "dflash")
FEATURE_KINDS = ("eagle", "mtp", "eagle3")  # one-decoder-layer modules on the target's features

# Shipped heads in specjax/assets, from the one registry of shipped drafters:
# name -> (target name, asset file).
# Medusa-2 assets hold Medusa heads (for the adapted target) beside the adapters.
NAMED_HEADS = {d.name: (d.target, d.asset) for d in shipped.DRAFTERS.values()
               if d.kind in KINDS or d.kind == "medusa2"}


@dataclasses.dataclass(frozen=True)
class HeadsConfig:
  kind: str  # "medusa" | "eagle" | "mtp"
  num_heads: int  # K (EAGLE: 1; MTP: modules)
  num_layers: int  # residual blocks per head
  hidden_size: int  # E of the target
  vocab_size: int  # V of the target
  target: str = ""  # the target's name when known (informational)
  vocab_subset: int = 0  # Vs, the size of the scored subset (0: the full vocabulary)
  taps: tuple = ()  # EAGLE with fused features: the target layers whose outputs are fused (below)
  # False: the module's layer puts no norm on its input (published EAGLE-1/2 heads: the fc output
  # enters attention as it is); its params then hold no "layer.attn_norm.*".
  input_norm: bool = True


@dataclasses.dataclass(frozen=True, eq=False)
class Heads:
  """config: HeadsConfig; params: {"w": [K,L,E,E], "b": [K,L,E]} (Medusa; with "lm" [K,V or Vs,E],
  each head's own LM head, as published Medusa-1 heads have, instead of the target's) or the flat
  feature-module tensors (EAGLE / MTP, see the module docstring); vocab: [Vs] int32 or None."""
  config: HeadsConfig
  params: Any
  vocab: Any = None
  meta: dict = dataclasses.field(default_factory=dict)  # training notes from the file header

  def __repr__(self):
    c = self.config
    if c.kind == "dflash":
      return c.describe()
    sub = f", vocab subset {c.vocab_subset}" if c.vocab_subset else ""
    sub += f", fused taps {list(c.taps)}" if c.taps else ""
    return (f"Heads({c.kind}: K={c.num_heads} x {c.num_layers} block(s), E={c.hidden_size}, "
            f"V={c.vocab_size}{sub}{', for ' + c.target if c.target else ''})")


def _check_vocab_ids(vocab, vocab_size: int) -> np.ndarray | None:
  if vocab is None:
    return None
  arr = np.asarray(vocab)
  if not (arr.ndim == 1 and arr.size > 0 and np.issubdtype(arr.dtype, np.integer)
          and arr.min() >= 0 and arr.max() < vocab_size and len(np.unique(arr)) == arr.size):
    raise InputError(f"vocab must be distinct token ids in [0, {vocab_size}) as a non-empty 1-D "
                     f"integer array, got shape {arr.shape} dtype {arr.dtype}")
  return arr.astype(np.int32)


def init_heads(target, kind: str = "medusa", *, num_heads: int | None = None, num_layers: int = 1,
               seed: int = 0, scale: float = 0.0, vocab=None, taps=(),
               input_norm: bool = True, **dflash) -> Heads:
  """Fresh heads for `target` (a specjax Model). Medusa (num_heads default 4): scale 0 (Medusa's
  init) makes every head the target's LM head; scale > 0 draws W ~ N(0, scale^2 / E) and
  b ~ N(0, scale^2) (tests). EAGLE (one module) and MTP (num_heads modules, default 2): see
  `init_feature_heads` (EAGLE also takes `taps`, fused features: see the module docstring, and
  input_norm=False: the published EAGLE-1/2 architecture, no norm on the layer's input). EAGLE-3:
  `init_eagle3_heads` (vocab: its draft vocabulary). DFlash: num_layers drafter layers and
  `dflash` = block_size, mask_token_id, target_layer_ids (specjax.drafters.dflash.init_params;
  scale 0 there means its default 0.02)."""
  if kind not in KINDS:
    raise InputError(f"kind={kind!r} is invalid: heads kinds built so far are {', '.join(KINDS)}")
  if kind == "dflash":
    from specjax.drafters import dflash as df
    return Heads(*df.init_params(target, num_layers=num_layers, seed=seed, scale=scale or 0.02,
                                 **dflash))
  if dflash:
    raise InputError(f"{', '.join(sorted(dflash))}: options of DFlash heads, not {kind}")
  if taps and kind not in ("eagle", "eagle3"):
    raise InputError(f"taps={taps!r}: fused features are for EAGLE heads, not {kind}")
  if input_norm is not True and (input_norm is not False or kind != "eagle"):
    raise InputError(f"input_norm={input_norm!r}: True, or False for EAGLE heads (the published "
                     f"EAGLE-1/2 layer), not {kind}")
  if kind == "eagle3":
    if taps:
      raise InputError(f"taps={taps!r}: an EAGLE-3 head reads target layers 2, L // 2 and L - 3")
    return init_eagle3_heads(target, seed=seed, scale=scale, vocab=vocab)
  if kind in FEATURE_KINDS:
    return init_feature_heads(target, kind, num_heads=num_heads, num_layers=num_layers, seed=seed,
                              scale=scale, vocab=vocab, taps=taps, input_norm=input_norm)
  num_heads = 4 if num_heads is None else num_heads
  check_int("num_heads", num_heads, 1, 16)
  check_int("num_layers", num_layers, 1, 8)
  if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale < 0:
    raise InputError(f"scale={scale!r} is invalid: must be a number >= 0")
  c = target.config
  e = c.hidden_size
  ids = _check_vocab_ids(vocab, c.vocab_size)
  kw, kb = jax.random.split(jax.random.PRNGKey(seed))
  w = scale / np.sqrt(e) * jax.random.normal(kw, (num_heads, num_layers, e, e), jnp.float32)
  b = scale * jax.random.normal(kb, (num_heads, num_layers, e), jnp.float32)
  cfg = HeadsConfig(kind, num_heads, num_layers, e, c.vocab_size, getattr(target, "name", ""),
                    0 if ids is None else int(ids.size))
  dtype = getattr(target, "dtype", jnp.float32)
  return Heads(cfg, {"w": w.astype(dtype), "b": b.astype(dtype)}, ids)


def check_fits(heads: Heads, target) -> None:
  """Raises InputError unless `heads` were made for a target of this width and vocabulary."""
  c, t = heads.config, target.config
  if c.kind == "dflash":
    from specjax.drafters import dflash as df
    return df.check_fits(c, heads.params, target, repr(heads))
  if (c.hidden_size, c.vocab_size) != (t.hidden_size, t.vocab_size):
    raise InputError(
        f"heads {heads!r} were made for a target of width {c.hidden_size} and vocabulary "
        f"{c.vocab_size}, but this target has width {t.hidden_size} and vocabulary "
        f"{t.vocab_size}: load or train heads for this model")
  if c.kind == "eagle3":
    from specjax.drafters.layouts import eagle3_taps

    want_taps = eagle3_taps(t.num_layers)
    if tuple(c.taps) != want_taps:
      raise InputError(f"heads {heads!r} read target layers {list(c.taps)}, but EAGLE-3 reads "
                       f"{list(want_taps)} of a target of {t.num_layers} layers: load or train "
                       f"heads for this model")
  elif c.taps and max(c.taps) >= t.num_layers:
    raise InputError(f"heads {heads!r} fuse the outputs of target layers {list(c.taps)}, but this "
                     f"target has {t.num_layers} layers: load or train heads for this model")
  if c.kind in FEATURE_KINDS:
    want = feature_shapes(c.kind, c.num_heads, target, c.taps, c.input_norm,
                          c.vocab_subset or c.vocab_size, "embed" in heads.params,
                          "norm_o" in heads.params)
    got = {k: tuple(np.shape(v)) for k, v in heads.params.items()}
    if got != want:
      bad = sorted(set(want) ^ set(got)) or [k for k in want if want[k] != got[k]]
      raise InputError(
          f"heads {heads!r} have layer tensors that do not fit this target's layer type "
          f"(first mismatch: {bad[0]!r}: {got.get(bad[0])} vs {want.get(bad[0])}): load or "
          f"train heads for this model")


def save_heads(heads: Heads, path: str, meta: dict | None = None, extra: dict | None = None) -> str:
  """Writes heads to one .npz (float16 params + JSON header); returns the path. extra: more
  arrays stored beside them under their own names (a Medusa-2 asset's adapters), which must not
  collide with the heads' own."""
  c = heads.config
  header = {"format": 1, **dataclasses.asdict(c), **heads.meta, **(meta or {})}
  os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
  vocab = np.zeros((0,), np.int32) if heads.vocab is None else np.asarray(heads.vocab, np.int32)
  # (to_host: heads sharded over processes are gathered, on every process alike)
  arrays = {k: sharding.to_host(v).astype(np.float16) for k, v in heads.params.items()}
  clash = sorted(set(extra or {}) & (set(arrays) | {"__header__", "__vocab__"}))
  if clash:
    raise InputError(f"save_heads: extra arrays {clash} would overwrite the heads' own")

  def write(tmp):
    with open(tmp, "wb") as f:  # np.savez would append ".npz" to any other suffix
      np.savez(f, __header__=np.frombuffer(json.dumps(header).encode(), np.uint8),
               __vocab__=vocab, **arrays, **(extra or {}))

  return distributed.write_once(path, write, "heads")  # by process 0 alone


HEADS_FILE = "heads (.npz written by sj.save_heads / `specjax train medusa|eagle|mtp --export`)"


def _header(z, path: str) -> dict:
  """A heads file's JSON header from its open archive; a draft model asset or a foreign .npz is
  a WeightsError saying what the file is and what was expected."""
  try:
    header = json.loads(bytes(z["__header__"]).decode())
  except (UnicodeDecodeError, ValueError) as e:
    raise WeightsError(f"{path}: its __header__ is not JSON ({e}); expected {HEADS_FILE}") from e
  if not isinstance(header, dict):
    raise WeightsError(f"{path}: its __header__ is not a JSON object; expected {HEADS_FILE}")
  if "kind" not in header and "shared" in header:  # shipped.export_draft's header
    raise WeightsError(f"{path} is a draft model asset (export_draft), not {HEADS_FILE}: use it "
                       f"with method draft (sj.DraftModel / load_model with target=)")
  required = [f.name for f in dataclasses.fields(HeadsConfig)
              if f.default is dataclasses.MISSING and f.name not in header]
  if required:
    raise WeightsError(f"{path}: its header has no {', '.join(required)}; expected {HEADS_FILE}")
  if header["kind"] not in KINDS:
    raise WeightsError(f"{path}: heads of kind {header['kind']!r}; expected one of "
                       f"{', '.join(KINDS)}")
  return header


def _read(path: str, dtype) -> Heads:
  from specjax import validate

  with validate.npz(path, HEADS_FILE) as z:
    header = _header(z, path)
    vocab = z["__vocab__"]
    params = {k: jnp.asarray(z[k].astype(np.float32), dtype) for k in z.files
              if not k.startswith("__")}
  cls = _config_class(header["kind"])
  fields = {f.name for f in dataclasses.fields(cls)}
  try:
    cfg = cls(**{k: tuple(header[k]) if k in ("taps", "target_layer_ids") else header[k]
                 for k in fields if k in header})
  except (TypeError, ValueError) as e:
    raise WeightsError(f"{path}: heads header does not describe heads ({e})") from e
  k, l, e = cfg.num_heads, cfg.num_layers, cfg.hidden_size
  want = {"w": (k, l, e, e), "b": (k, l, e)}
  if cfg.kind == "dflash":
    from specjax.drafters.dflash import param_shapes
    want = param_shapes(cfg)
  elif cfg.kind == "eagle3":  # the layer's shapes are checked against a target (check_fits)
    want = {"fuse_w": (1, 3 * e, e), "lm": (1, cfg.vocab_subset or cfg.vocab_size, e)}
  elif cfg.kind in FEATURE_KINDS:  # the layer's shapes are checked against a target (check_fits)
    want = {"fc_w": (k, 2 * e, e), "fc_b": (k, e)}
    if cfg.taps:
      want.update(fuse_w=(k, (len(cfg.taps) + 1) * e, e), fuse_b=(k, e))
    if not any(n.startswith("layer.") for n in params):
      raise WeightsError(f"{path}: {cfg.kind} heads file has no layer tensors")
  for name, shape in want.items():
    if name not in params or tuple(params[name].shape) != shape:
      got = None if name not in params else tuple(params[name].shape)
      raise WeightsError(f"{path}: heads tensor {name!r} has shape {got}, expected {shape}")
  meta = {k: v for k, v in header.items() if k not in fields and k != "format"}
  return Heads(cfg, params, vocab.astype(np.int32) if vocab.size else None, meta)


def load_heads(path_or_name: str, target=None, *, dtype=None, revision: str | None = None) -> Heads:
  """Shipped heads by name (see NAMED_HEADS), a file written by `save_heads`, or published heads
  (a directory, .safetensors, .pt or .bin in the Medusa or EAGLE layouts: specjax.drafters). With
  `target`, checks that they fit it (width and vocabulary) and uses its dtype.

  A Hugging Face Hub name, "org/name" (the repository's config.json and weights) or
  "org/name/FILE" (one .npz / .safetensors / .pt / .bin file, with the config.json beside it),
  is read from the Hugging Face cache, downloaded there first where needed (never with
  HF_HUB_OFFLINE set), at `revision` (default main); a shipped name or an existing local path of
  the same name wins (specjax.hub)."""
  if not isinstance(path_or_name, (str, os.PathLike)):
    raise InputError(f"load_heads: expected a heads name or path, got "
                     f"{type(path_or_name).__name__}")
  name = os.fspath(path_or_name)
  what = hub.what_is(name, (*NAMED_HEADS, *shipped.DRAFTERS), hub.HEADS_SUFFIXES)
  hub.check_revision(name, revision, what)
  if name in NAMED_HEADS:
    target_name, file = NAMED_HEADS[name]
    path = os.path.join(os.path.dirname(__file__), "assets", file)
    if not os.path.isfile(path):
      kind = name.rsplit("-", 1)[-1]
      raise ModelNotFoundError(
          f"heads {name!r}: the asset {path} is not there (not trained and shipped yet). Train "
          f"heads for {target_name!r} with `specjax train {kind} --model {target_name} --corpus "
          f"DIR --export heads.npz` and load them with sj.load_heads('heads.npz', target)")
  elif name in shipped.DRAFTERS:
    d = shipped.DRAFTERS[name]
    raise InputError(f"load_heads: {name!r} is a shipped {d.kind} model, not heads: load it with "
                     f"sj.load_model({name!r}, target=sj.load_model({d.target!r})) and pass it to "
                     f"sj.DraftModel")
  elif what == hub.LOCAL:
    path = name
  elif what == hub.HUB:
    path = hub.heads_path(name, revision)
  else:
    raise ModelNotFoundError(f"load_heads: {name!r} is neither a shipped heads name "
                             f"({', '.join(NAMED_HEADS)}), a file or directory, nor a Hugging "
                             f"Face Hub name (org/name, or org/name/FILE)")
  dt = dtype or (getattr(target, "dtype", None) if target is not None else None) or jnp.float32
  from specjax.drafters import layouts  # published layouts (Medusa, EAGLE): directories, .pt, ...

  if layouts.is_published(path):
    fields, params, vocab, meta = layouts.read(path, None if target is None else target.config)
    _check_shared(path, meta.pop("shared_with_target", None), target)
    if target is not None and "embed" in params and _max_diff(
        np.asarray(params["embed"][0]), target.params["embed"][...]) == 0:
      params = {k: v for k, v in params.items() if k != "embed"}  # a copy of the target's: share
    heads = Heads(_config_class(fields.get("kind"))(
        **{k: tuple(v) if k in ("taps", "target_layer_ids") else v for k, v in fields.items()}),
                  {k: jnp.asarray(v, dt) for k, v in params.items()}, vocab, meta)
  else:
    heads = _read(path, dt)
  if target is not None:
    check_fits(heads, target)
  return heads


def _config_class(kind):
  """The config type of heads of `kind` (DFlash drafters have their own shape)."""
  if kind == "dflash":
    from specjax.drafters.dflash import DFlashConfig
    return DFlashConfig
  return HeadsConfig


def _max_diff(host: np.ndarray, x: jax.Array) -> float:
  """max |host - x| in float32 (inf where the shapes differ), computed where x lives: a target
  sharded over processes is compared on its devices, never copied to a host."""
  if tuple(host.shape) != tuple(x.shape):
    return float("inf")
  return float(jax.jit(lambda a, b: jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                       )(host, x))


def _check_shared(path: str, shared, target) -> None:
  """MTP layers carry copies of the target's LM head (and embedding), which specjax's modules read
  from the target itself: each copy must equal the target's (in the target's dtype)."""
  if not shared:
    return
  t = target.params
  lm = t["lm_head"][...].T if "lm_head" in t else t["embed"][...]
  emb = t["embed"][...]
  for k, (head, table) in enumerate(shared):
    for what, copy, own in (("shared_head.head", head, lm), ("embed_tokens", table, emb)):
      if copy is None:
        continue
      diff = _max_diff(np.asarray(jnp.asarray(copy, own.dtype)), own)
      if diff != 0:
        raise WeightsError(
            f"{path}: MTP module {k}'s {what} differs from the target's (max |diff| {diff:.3g}): "
            f"specjax's MTP modules share the target's LM head and embedding, as DeepSeek-V3's do")


# ----------------------------------------------------------------------------- the forward


def medusa_hidden(params, hidden: jax.Array) -> jax.Array:
  """The residual blocks of every head: hidden [...,E] -> [...,K,E]."""
  w, b = params["w"], params["b"]  # [K,L,E,E], [K,L,E]
  x = jnp.broadcast_to(hidden[..., None, :], hidden.shape[:-1] + (w.shape[0], w.shape[-1]))
  for l in range(w.shape[1]):
    y = jnp.einsum("...ke,kef->...kf", x, w[:, l]) + b[:, l]
    x = x + jax.nn.silu(y)
  return x


def top_k_ids(logits: jax.Array, k: int) -> jax.Array:
  """The k largest entries' indices [...,k] of logits [...,V], best first (the lower index first
  on ties). lax.top_k: XLA's CPU runtime selects per row without sorting it, 18-30x faster here
  than k argmax passes (0.15 vs 2.8 ms for EAGLE-2's 8 frontier rows of 16384)."""
  return jax.lax.top_k(logits, k)[1].astype(jnp.int32)


# ----------------------------------------------------------------------------- EAGLE / MTP modules
#
# Module k reads (the embedding of a token, a feature) at one position i and writes a feature:
#
#   EAGLE (Li et al. 2024):   x = [emb(x_{i+1}), f_i] W_fc + b_fc  -> one decoder layer -> f^_{i+1}
#   MTP (DeepSeek-V3):        x = [RMSNorm_e(emb(x_{i+k+1})), RMSNorm_h(h^k_i)] W_fc + b_fc
#                             -> one decoder layer -> h^{k+1}_i
#
# f_i is the target's feature at position i: its last hidden state after the final norm (what
# its LM head reads, HF's `last_hidden_state`: the tensor EAGLE-1's released code regresses and
# feeds its heads). EAGLE's output is a predicted feature, read by the target's LM head as it is;
# an MTP module's output is a residual stream, read through the target's final norm and LM head.
# The layer is the target's own `Block` type (same shapes, its own static KV cache). Embedding,
# final norm and LM head are the target's, frozen and shared: heads hold none of them.


@functools.lru_cache(maxsize=32)
def layer_template(config, dtype_name: str = "float32"):
  """(graphdef, abstract state) of one target `Block` for a ModelConfig (cached: hashable)."""
  from flax import nnx

  from specjax.model import Block

  abstract = nnx.eval_shape(lambda: Block(config, jnp.dtype(dtype_name), nnx.Rngs(0)))
  return nnx.split(abstract)


def _layer_keys(config) -> dict:
  """{"layer.attn.wqkv": shape, ...} for one target Block."""
  from specjax.model import path_key

  _, abstract = layer_template(config)
  return {"layer." + ".".join(map(str, path_key(p))): tuple(x.shape)
          for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}


def feature_shapes(kind: str, num_heads: int, target, taps=(), input_norm: bool = True,
                   draft_vocab: int | None = None, own_embed: bool = False,
                   out_norm: bool = False) -> dict:
  """The flat tensor shapes of EAGLE / MTP heads with K = num_heads modules for `target`
  (input_norm False: without the layer's input norm, see HeadsConfig); EAGLE-3: its draft
  vocabulary's size (default V) and whether it holds its own embedding; out_norm: MTP modules
  with their own output norm "norm_o" [K,E] in place of the target's final norm, as DeepSeek-V3's
  published MTP layers have."""
  c = target.config
  e, k = c.hidden_size, num_heads
  if kind == "eagle3":
    out = {"fuse_w": (1, 3 * e, e), "norm_emb": (1, e), "norm_hid": (1, e), "norm": (1, e),
           "lm": (1, draft_vocab or c.vocab_size, e)}
    if own_embed:
      out["embed"] = (1, c.vocab_size, e)
    for name, shape in _layer_keys(midlayer_config(c)).items():
      if not name.startswith("layer.attn_norm."):
        out[name] = (1, 2 * e) + shape[1:] if name == "layer.attn.wqkv" else (1,) + shape
    return out
  out = {"fc_w": (k, 2 * e, e), "fc_b": (k, e)}
  if taps:
    out.update(fuse_w=(k, (len(taps) + 1) * e, e), fuse_b=(k, e))
  if kind == "mtp":
    out.update(norm_e=(k, e), norm_h=(k, e))
    if out_norm:
      out.update(norm_o=(k, e))
  out.update({name: (k,) + shape for name, shape in _layer_keys(c).items()
              if input_norm or not name.startswith("layer.attn_norm.")})
  return out


def midlayer_config(config):
  """The target's ModelConfig made a plain Llama layer's (EAGLE-3's midlayer: no biases, no
  qk-norms or post-norms, RMSNorm, SiLU-gated MLP, global attention), same shapes and rope."""
  return dataclasses.replace(config, qkv_bias=False, out_bias=False, qk_norm=False,
                             post_norms=False, norm="rms", activation="silu", gated_mlp=True,
                             attn_softcap=0.0, attn_scale=0.0, sliding_window=0, layer_windows=())


def check_taps(taps, num_layers: int | None = None) -> tuple:
  """taps -> a tuple of distinct increasing ints in [1, num_layers): the target layers whose outputs
  an EAGLE head fuses ("after the first i layers"); "auto" = (2, num_layers // 2), a low and a
  middle layer beside the last (EAGLE-3's choice)."""
  if isinstance(taps, str):
    if taps != "auto":
      try:
        taps = tuple(int(x) for x in taps.split(",") if x.strip())
      except ValueError:
        raise InputError(f"taps={taps!r} is invalid: give layer counts such as '2,15' or 'auto'")
    elif num_layers is None:
      raise InputError("taps='auto' needs the target's layer count")
    else:
      taps = (min(2, num_layers - 1), num_layers // 2)
  try:
    taps = tuple(taps)
  except TypeError:
    raise InputError(f"taps={taps!r} is invalid: a sequence of layer counts such as (2, 15)")
  if any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in taps):
    raise InputError(f"taps={taps!r} is invalid: layer counts must be integers")
  taps = tuple(int(i) for i in taps)
  hi = num_layers - 1 if num_layers is not None else None
  if (any(i < 1 for i in taps) or list(taps) != sorted(set(taps))
      or (hi is not None and any(i > hi for i in taps))):
    raise InputError(f"taps={taps!r} is invalid: distinct increasing layer counts in [1, "
                     f"{hi if hi is not None else 'num_layers - 1'}] (the residual stream after "
                     f"that many of the target's layers; the last layer's feature is always read)")
  return taps


def _fuse_identity(e: int, n: int, key=None, mult: float = 0.0) -> jax.Array:
  """fuse_w [(n+1)E,E]: zero on the n taps and the identity on the final feature; mult > 0 adds a
  N(0, mult^2 / ((n+1)E)) draw everywhere (tests: taps that matter)."""
  w = jnp.concatenate([jnp.zeros((n * e, e), jnp.float32), jnp.eye(e, dtype=jnp.float32)])
  if mult:
    w = w + mult * jax.random.normal(key, w.shape, jnp.float32) / np.sqrt((n + 1) * e)
  return w


def add_taps(heads: "Heads", taps, target) -> "Heads":
  """An unfused EAGLE head -> the same head reading fused features from `taps`, with fuse_w the
  identity on the final feature (so its drafts are unchanged until the fuse is trained)."""
  c = heads.config
  if c.kind != "eagle":
    raise InputError(f"taps: fused features are for EAGLE heads, not {c.kind}")
  taps = check_taps(taps, target.config.num_layers)
  if c.taps:
    if c.taps == taps:
      return heads
    raise InputError(f"these EAGLE heads already fuse taps {list(c.taps)}; asked for {list(taps)}")
  if not taps:
    return heads
  e = c.hidden_size
  dtype = heads.params["fc_w"].dtype
  params = dict(heads.params, fuse_w=_fuse_identity(e, len(taps))[None].astype(dtype),
                fuse_b=jnp.zeros((1, e), dtype))
  return dataclasses.replace(heads, config=dataclasses.replace(c, taps=taps), params=params)


def fuse_features(mod: dict, feats: jax.Array) -> jax.Array:
  """feats [...,(n+1)E] (the taps, then the final feature; Decoder(..., taps=)) -> the fused
  feature [...,E] an EAGLE head reads; feats unchanged for heads without taps."""
  if "fuse_w" not in mod:
    return feats
  w = mod["fuse_w"]
  if "fuse_b" not in mod:  # EAGLE-3's fc: the taps only (not the final feature), no bias
    return jnp.dot(feats[..., :w.shape[0]].astype(w.dtype), w).astype(feats.dtype)
  return (jnp.dot(feats.astype(w.dtype), w) + mod["fuse_b"]).astype(feats.dtype)


def init_feature_heads(target, kind: str, *, num_heads: int | None = None, num_layers: int = 1,
                       seed: int = 0, scale: float = 0.0, vocab=None, taps=(),
                       input_norm: bool = True) -> Heads:
  """EAGLE (num_heads 1) or MTP (num_heads modules, default 2) heads for `target`: fc ~
  N(0, 1 / 2E), the layer as a fresh target Block (N(0, 0.02^2) weights, unit norms), MTP norms at
  one; EAGLE with taps: fuse_w the identity on the final feature (`add_taps`). scale > 0
  multiplies every random weight by scale / 0.02 (tests), and then also draws fuse_w's taps."""
  from flax import nnx

  from specjax.model import Block, path_key

  if kind == "eagle":
    num_heads = 1 if num_heads is None else num_heads
    check_int("num_heads", num_heads, 1, 1, " (an EAGLE head is one module)")
  else:
    num_heads = 2 if num_heads is None else num_heads
    check_int("num_heads", num_heads, 1, 16)
  check_int("num_layers", num_layers, 1, 1, f" ({kind} modules have one decoder layer)")
  taps = check_taps(taps, target.config.num_layers)  # (EAGLE only: init_heads checked)
  if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale < 0:
    raise InputError(f"scale={scale!r} is invalid: must be a number >= 0")
  c = target.config
  e = c.hidden_size
  ids = _check_vocab_ids(vocab, c.vocab_size)
  mult = scale / 0.02 if scale > 0 else 1.0
  dtype = getattr(target, "dtype", jnp.float32)
  mods = []
  for k in range(num_heads):
    block = Block(c, jnp.float32, nnx.Rngs(seed * 1000 + k))
    _, st = nnx.split(block)
    layer = {"layer." + ".".join(map(str, path_key(p))): x
             for p, x in jax.tree_util.tree_flatten_with_path(st)[0]}
    layer = {n: (x if n.endswith("scale") or n.endswith("bias") or ".b" in n else x * mult)
             for n, x in layer.items() if input_norm or not n.startswith("layer.attn_norm.")}
    kf = jax.random.fold_in(jax.random.PRNGKey(seed), k)
    mod = {"fc_w": mult * jax.random.normal(kf, (2 * e, e), jnp.float32) / np.sqrt(2 * e),
           "fc_b": jnp.zeros((e,), jnp.float32)}
    if kind == "mtp":
      mod.update(norm_e=jnp.ones((e,), jnp.float32), norm_h=jnp.ones((e,), jnp.float32))
    if taps:
      mod.update(fuse_w=_fuse_identity(e, len(taps), jax.random.fold_in(kf, 1),
                                       mult if scale > 0 else 0.0),
                 fuse_b=jnp.zeros((e,), jnp.float32))
    mod.update(layer)
    mods.append(mod)
  params = {n: jnp.stack([m[n] for m in mods]).astype(dtype) for n in mods[0]}
  cfg = HeadsConfig(kind, num_heads, 1, e, c.vocab_size, getattr(target, "name", ""),
                    0 if ids is None else int(ids.size), taps, input_norm)
  return Heads(cfg, params, ids)


def module_arrays(params: dict, k: int) -> dict:
  """Module k of flat feature-head params -> a nested dict {"fc_w", "fc_b", ("norm_e",
  "norm_h"), "layer": {"attn": {"wqkv": ...}, ...}} (nested so sharding rules see
  ".../layer/attn/wqkv" and split the layer as they split the target's)."""
  out: dict = {}
  for name, x in params.items():
    parts = name.split(".")
    d = out
    for p in parts[:-1]:
      d = d.setdefault(p, {})
    d[parts[-1]] = x[k]
  return out


# The dense weights of one feature module, as (path in `module_arrays`' nested dict, weight -> the
# [K, N] matrix `dense` multiplies by): its fc, then its layer's products, which are the target's.
_DENSE = ((("fc_w",), lambda w, e: w),) + tuple((("layer",) + p, f) for p, f in LAYER_SITES)


def _at(d: dict, path: tuple):
  for p in path:
    d = d[p]
  return d


def _at_attr(obj, names):
  for n in names:
    obj = getattr(obj, n)
  return obj


def pack_module(mod: dict) -> dict:
  """`mod` (module_arrays) plus "packed": {path: packed copy} of its dense weights for
  specjax.kernels, so the module's few-row products (EAGLE-2's frontier, a catch-up over the
  accepted tokens) take the kernel's bandwidth path instead of XLA's 2-16-row GEMM path, as the
  target's own layers do. Call only for a packed target (the kernel available, float32)."""
  from specjax import kernels

  e = mod["fc_w"].shape[-1]
  packed = {".".join(path): jnp.asarray(kernels.pack_weight(np.asarray(f(_at(mod, path), e))))
            for path, f in _DENSE}
  return dict(mod, packed=packed)


def _identity(x):
  return x


def _rms(x, scale, eps):
  from specjax.model import rms_unit

  return (scale * rms_unit(x, eps)).astype(x.dtype)


def module_out(config, mod: dict, h: jax.Array):
  """An MTP module's output h [...,E] -> what the LM head reads: its own output norm ("norm_o",
  published DeepSeek-V3 layers), else None (the caller applies the target's final norm)."""
  return _rms(h, mod["norm_o"], config.norm_eps) if "norm_o" in mod else None


def feature_module(config, mod: dict, emb: jax.Array, feat: jax.Array, positions: jax.Array,
                   layer_cache: dict, start: jax.Array, mask: jax.Array):
  """One EAGLE / MTP module (kind read from `mod`: MTP modules have norms).

  config: the target's ModelConfig; mod: `module_arrays(...)`; emb [B,T,E] token embeddings;
  feat [B,T,E] features (EAGLE) or the previous module's outputs (MTP); positions [B,T];
  layer_cache {k,v: [B,Kv,S,D]}; start [B]: the slot of the first new entry; mask [B,T,S].
  Returns (out [B,T,E], layer_cache).
  """
  from flax import nnx

  from specjax.kernels import dense
  from specjax.model import path_key, rope_inv_freq
  from specjax.packing import PREFIX, Packed

  if "norm_hid" in mod:
    return _midlayer(config, mod, emb, feat, positions, layer_cache, start, mask)
  if "norm_e" in mod:
    emb = _rms(emb, mod["norm_e"], config.norm_eps)
    feat = _rms(feat, mod["norm_h"], config.norm_eps)
  packed = mod.get("packed", {})  # pack_module's copies, if the target runs on the kernel
  x = dense(jnp.concatenate([emb, feat.astype(emb.dtype)], axis=-1), mod["fc_w"],
            packed.get("fc_w")) + mod["fc_b"]
  graphdef, abstract = layer_template(config, jnp.dtype(mod["fc_w"].dtype).name)
  raw = "attn_norm" not in mod["layer"]  # no input norm (published EAGLE-1/2 layers)

  def leaf(path, x):
    d = mod["layer"]
    for p in path_key(path):
      if raw and p == "attn_norm":
        return jnp.ones(x.shape, x.dtype)  # a placeholder; replaced by the identity below
      d = d[p]
    return d

  block = nnx.merge(graphdef, jax.tree_util.tree_map_with_path(leaf, abstract))
  if raw:
    block.attn_norm = _identity
  for name, arr in packed.items():  # "layer.attn.wqkv" -> block.attn.packed_wqkv
    parts = name.split(".")
    if parts[0] == "layer":
      setattr(_at_attr(block, parts[1:-1]), PREFIX + parts[-1], Packed(arr))
  rope = None
  if config.position == "rope":
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(rope_inv_freq(config))
    rope = (jnp.cos(angles), jnp.sin(angles))
  return block(x, rope, layer_cache, start, mask)


def _midlayer(config, mod: dict, emb, h, positions, layer_cache, start, mask):
  """EAGLE-3's layer (see the module docstring): h [B,T,E] is the fc output or a previous depth's
  output, emb [B,T,E]. x = cat(norm_emb(emb), norm_hid(h)) [B,T,2E] enters attention; h is the
  residual. Returns (out [B,T,E], layer_cache)."""
  from flax import nnx

  from specjax.model import path_key, rope_inv_freq

  cfg = midlayer_config(config)
  graphdef, abstract = layer_template(cfg, jnp.dtype(mod["fuse_w"].dtype).name)

  def leaf(path, x):
    d = mod["layer"]
    for p in path_key(path):
      if p == "attn_norm":
        return jnp.ones(x.shape, x.dtype)  # unused: the layer's inputs are normed here
      d = d[p]
    return d

  block = nnx.merge(graphdef, jax.tree_util.tree_map_with_path(leaf, abstract))
  h = h.astype(emb.dtype)
  x = jnp.concatenate([_rms(emb, mod["norm_emb"], cfg.norm_eps),
                       _rms(h, mod["norm_hid"], cfg.norm_eps)], axis=-1)  # [B,T,2E]
  angles = positions[..., None].astype(jnp.float32) * jnp.asarray(rope_inv_freq(cfg))
  y, layer_cache = block.attn(x, (jnp.cos(angles), jnp.sin(angles)), layer_cache, start, mask)
  h = h + y
  return h + block.mlp(block.mlp_norm(h)), layer_cache


def eagle3_logits(mod: dict, h: jax.Array, eps: float) -> jax.Array:
  """An EAGLE-3 head's draft logits over its draft vocabulary: h [...,E] -> [...,Vd] float32."""
  return jnp.dot(_rms(h, mod["norm"], eps), mod["lm"].T).astype(jnp.float32)


def init_eagle3_heads(target, *, seed: int = 0, scale: float = 0.0, vocab=None) -> Heads:
  """A fresh EAGLE-3 head for `target` (at least 7 layers): fc ~ N(0, 1 / 3E), the layer's
  weights N(0, 0.02^2) (q/k/v over 2E inputs), norms at one, the LM head the target's own rows
  for the draft vocabulary `vocab` (default: the whole vocabulary). scale > 0 multiplies every
  random weight by scale / 0.02 (tests)."""
  from flax import nnx

  from specjax.model import Block, path_key

  from specjax.drafters.layouts import eagle3_taps

  c = target.config
  taps = eagle3_taps(c.num_layers)
  if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale < 0:
    raise InputError(f"scale={scale!r} is invalid: must be a number >= 0")
  e = c.hidden_size
  ids = _check_vocab_ids(vocab, c.vocab_size)
  mult = scale / 0.02 if scale > 0 else 1.0
  mc = midlayer_config(c)
  key = jax.random.PRNGKey(seed)
  _, st = nnx.split(Block(mc, jnp.float32, nnx.Rngs(seed)))
  mod = {}
  for p, x in jax.tree_util.tree_flatten_with_path(st)[0]:
    name = "layer." + ".".join(map(str, path_key(p)))
    if name.startswith("layer.attn_norm."):
      continue
    if name == "layer.attn.wqkv":  # [2E,Kv,G+2,D]: the layer reads 2E inputs
      x = 0.02 * jax.random.normal(jax.random.fold_in(key, 2), (2 * e,) + x.shape[1:])
    mod[name] = x if name.endswith("scale") else x * mult
  # [V,E], read where the target's weights are (a target sharded over processes: on its devices)
  lm = target.params["lm_head"][...].T if not c.tie_word_embeddings else target.params["embed"][...]
  lm = lm if ids is None else lm[jnp.asarray(ids)]
  mod.update(fuse_w=mult * jax.random.normal(jax.random.fold_in(key, 1), (3 * e, e), jnp.float32)
             / np.sqrt(3 * e), norm_emb=jnp.ones((e,)), norm_hid=jnp.ones((e,)),
             norm=jnp.ones((e,)), lm=jnp.asarray(lm, jnp.float32))
  dtype = getattr(target, "dtype", jnp.float32)
  params = {n: jnp.asarray(x)[None].astype(dtype) for n, x in mod.items()}
  cfg = HeadsConfig("eagle3", 1, 1, e, c.vocab_size, getattr(target, "name", ""),
                    0 if ids is None else int(ids.size), taps)
  return Heads(cfg, params, ids)
