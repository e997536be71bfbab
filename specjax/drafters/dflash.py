"""DFlash: a block-diffusion drafter drafts a whole block in one forward (Chen, Liang, Liu 2026).

The drafter reads the target's residual stream after several of its layers (`target_layer_ids`,
shallow to deep: id i is the state after the target's first i + 1 layers, raw), concatenated
[..., nE], projected by `fc` [nE,E] (no bias) and normed by `hidden_norm`: the context feature
c_t of every committed position t. Each drafter layer is a Qwen3-style layer (RMSNorm, q/k norms
over the head dimension, rope, SwiGLU MLP) whose attention takes its keys and values from
[c_0 .. c_{L-1}, block] and its queries from the block alone; the context is not normed by the
layer's input norm. The block is the last verified token x_L followed by block_size - 1 copies of
`mask_token_id` at positions L .. L + block_size - 1, embedded by the target's own (frozen)
embedding; the block attends to itself in both directions. The drafter's final `norm` then the
target's own LM head give, at block offset j >= 1, the distribution of token x_{L+j}.

Since the context's keys and values depend on c alone (not on a layer's input), each layer's
context K/V are written once per committed position into the drafter's own static KV cache
(`context_kv`), and a draft forward attends to that cache beside the block (`DFlashDrafter`).

Heads of kind "dflash" (the heads API: `sj.init_heads(target, "dflash", ...)`, `sj.load_heads`)
hold a `DFlashConfig` and the module's params flat: "fc" [nE,E], "hidden_norm" [E], "norm" [E]
and per layer i "layers.i.attn_norm" [E], "wq" [E,H,D], "wk", "wv" [E,K,D], "wo" [H,D,E],
"q_norm", "k_norm" [D], "mlp_norm" [E], "w_gate", "w_up" [E,F], "w_down" [F,E].

The published layout (z-lab's DFlashDraftModel: a Qwen3 config.json with `dflash_config`
{target_layer_ids, block_size, mask_token_id}, and model.safetensors with fc.weight,
hidden_norm.weight, norm.weight, layers.i.{input_layernorm, post_attention_layernorm,
self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, mlp.{gate,up,down}_proj}.weight) converts both
ways here (`from_published`, `to_published`); specjax.drafters.layouts recognises and writes it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import kernels
from specjax.errors import InputError, WeightsError, check_int
from specjax.model import apply_rope, path_key, rms_unit


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
  """A DFlash drafter's static shape. The first fields are those every heads config has (one
  drafter: num_heads 1; num_layers its decoder layers); then the drafter's own."""
  kind: str = "dflash"
  num_heads: int = 1
  num_layers: int = 1
  hidden_size: int = 0  # E, the target's width
  vocab_size: int = 0  # V, the target's vocabulary
  target: str = ""
  vocab_subset: int = 0
  block_size: int = 16  # the block it was trained for: the last verified token + block_size - 1
  mask_token_id: int = -1
  target_layer_ids: tuple = ()  # 0-based target layers whose outputs form the context
  attn_heads: int = 0  # H
  kv_heads: int = 0  # K
  head_dim: int = 0  # D
  intermediate_size: int = 0  # F
  norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  num_target_layers: int = 0

  @property
  def taps(self) -> tuple:
    """The target layer counts whose raw outputs the target's forwards return (Decoder taps)."""
    return tuple(i + 1 for i in self.target_layer_ids)

  @property
  def input_norm(self) -> bool:
    return True

  def describe(self) -> str:
    return (f"Heads(dflash: {self.num_layers} layer(s), block {self.block_size}, mask token "
            f"{self.mask_token_id}, target layers {list(self.target_layer_ids)}, "
            f"E={self.hidden_size}, V={self.vocab_size}"
            f"{', for ' + self.target if self.target else ''})")


def default_layer_ids(num_target_layers: int, n: int) -> tuple:
  """The published choice of n context layers: one in the middle, or n spread evenly from layer 1
  to layer L - 3; here clipped to [0, L - 2] (a tiny target)."""
  lo, hi = 1, num_target_layers - 3
  ids = [num_target_layers // 2] if n == 1 else [
      int(round(lo + i * (hi - lo) / (n - 1))) for i in range(n)]
  return tuple(sorted({min(max(i, 0), num_target_layers - 2) for i in ids}))


def check_config(c: DFlashConfig, num_target_layers: int | None = None, where: str = "") -> None:
  """InputError naming the field unless c describes a drafter (and fits a target of that many
  layers: context ids in [0, L - 2], the raw states a published drafter reads)."""
  check_int("block_size", c.block_size, 2, 64, where)
  if not (0 <= c.mask_token_id < c.vocab_size) or isinstance(c.mask_token_id, bool):
    raise InputError(f"mask_token_id={c.mask_token_id!r} is invalid{where}: DFlash fills its "
                     f"block with a mask token; give a token id in [0, {c.vocab_size})")
  ids = c.target_layer_ids
  hi = (num_target_layers or c.num_target_layers) - 2
  if (not ids or any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in ids)
      or list(ids) != sorted(set(ids)) or ids[0] < 0 or ids[-1] > hi):
    raise InputError(f"target_layer_ids={list(ids)!r} are out of range{where}: distinct "
                     f"increasing target layers in [0, {hi}] (a target of {hi + 2} layers)")


# ----------------------------------------------------------------------------- the module


def _param(rng: np.random.Generator, shape, dtype, scale):
  # numpy draws: one jax.random call per shape would compile a program per tensor.
  return nnx.Param(jnp.asarray(scale * rng.standard_normal(shape, np.float32), dtype))


def _ones(n, dtype):
  return nnx.Param(jnp.ones((n,), dtype))


def _norm(x, w, eps):
  return (w * rms_unit(x, eps).astype(x.dtype)).astype(x.dtype)


# A drafter's dense products, by flat parameter name (the layers' under "layers.i."): each weight
# as the [K, N] matrix its product multiplies by.
DENSE = ("fc", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def _dense(x, w, packed, name):
  """x [..., K] @ w [K, *out] (`kernels.dense`): on the CPU kernel where `packed` holds a copy
  of w (packed_copies), else XLA's product."""
  return kernels.dense(x, w, None if packed is None else packed.get(name))


def packed_copies(params: dict, qtype: str | None) -> tuple[dict, dict]:
  """(params, {flat name: kernel copy}) for a drafter beside a target whose products run on the
  CPU kernel (packing.on_kernel), as EAGLE's modules get (drafters/layer.pack_module): each dense
  weight packed for the kernel, or, with qtype (packing.drafter_qtype, beside a target on GGUF
  blocks), rounded to blocks of that type, params then holding the blocks' values so that its
  products past the kernel's rows (XLA) compute the same numbers. A weight whose K is not whole
  blocks stays float32 (fp32 kernel layout)."""
  from specjax.packing import kernel_copy
  out, packed = dict(params), {}
  for name, w in params.items():
    if name.split(".")[-1] not in DENSE:
      continue
    shape = np.shape(w)  # wo [H,D,E] multiplies [..., H*D]; the others' K is their first axis
    mat = np.asarray(w, np.float32).reshape((-1, shape[-1]) if name.endswith("wo")
                                            else (shape[0], -1))  # [K, N]
    values, packed[name] = kernel_copy(mat, qtype)
    if values is not None:
      out[name] = jnp.asarray(values.reshape(shape), jnp.asarray(w).dtype)
  return out, packed


def _layer_copies(packed, i: int):
  if not packed:
    return None
  prefix = f"layers.{i}."
  return {k[len(prefix):]: v for k, v in packed.items() if k.startswith(prefix)}


class DFlashLayer(nnx.Module):
  """One drafter layer: attention over [context, block] with queries from the block, then MLP."""

  def __init__(self, c: DFlashConfig, dtype, rng: np.random.Generator, scale: float = 0.02):
    e, h, k, d, f = c.hidden_size, c.attn_heads, c.kv_heads, c.head_dim, c.intermediate_size
    self.eps = c.norm_eps
    self.attn_norm, self.mlp_norm = _ones(e, dtype), _ones(e, dtype)
    self.wq = _param(rng, (e, h, d), dtype, scale)
    self.wk = _param(rng, (e, k, d), dtype, scale)
    self.wv = _param(rng, (e, k, d), dtype, scale)
    self.wo = _param(rng, (h, d, e), dtype, scale)
    self.q_norm, self.k_norm = _ones(d, dtype), _ones(d, dtype)
    self.w_gate = _param(rng, (e, f), dtype, scale)
    self.w_up = _param(rng, (e, f), dtype, scale)
    self.w_down = _param(rng, (f, e), dtype, scale)

  def kv(self, x, rope, packed=None):
    """x [B,T,E] (the context feature, or the normed block) -> k, v [B,T,K,D] (k normed, roped).
    packed: this layer's kernel copies ({} or None: XLA's products)."""
    k = _norm(_dense(x, self.wk[...], packed, "wk"), self.k_norm[...], self.eps)
    return apply_rope(k, *rope), _dense(x, self.wv[...], packed, "wv")

  def __call__(self, x, rope, ctx_k, ctx_v, mask, packed=None):
    """x [B,N,E] the block; rope (cos, sin) [B,N,D/2]; ctx_k, ctx_v [B,K,S,D] the context's
    (a cache: slot s); mask [B,N,S+N] over the context slots, then the N block entries."""
    b, n, _ = x.shape
    kh, d = self.wk.shape[1], self.wk.shape[2]
    g = self.wq.shape[1] // kh
    hn = _norm(x, self.attn_norm[...], self.eps)
    q = _norm(_dense(hn, self.wq[...], packed, "wq"), self.q_norm[...], self.eps)
    q = apply_rope(q, *rope).reshape(b, n, kh, g, d)  # head h = k * G + g
    kb, vb = self.kv(hn, rope, packed)  # [B,N,K,D]
    s = jnp.concatenate([jnp.einsum("bnkgd,bksd->bkgns", q, ctx_k.astype(q.dtype)),
                         jnp.einsum("bnkgd,bmkd->bkgnm", q, kb)], axis=-1)  # [B,K,G,N,S+N]
    s = jnp.where(mask[:, None, None], s.astype(jnp.float32) * d ** -0.5, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(x.dtype)
    slots = ctx_k.shape[2]
    o = (jnp.einsum("bkgns,bksd->bnkgd", p[..., :slots], ctx_v.astype(x.dtype))
         + jnp.einsum("bkgnm,bmkd->bnkgd", p[..., slots:], vb)).reshape(b, n, kh * g, d)
    wo = self.wo[...]
    x = x + _dense(o.reshape(b, n, kh * g * d), wo.reshape(-1, wo.shape[-1]), packed, "wo")
    y = _norm(x, self.mlp_norm[...], self.eps)
    y = (jax.nn.silu(_dense(y, self.w_gate[...], packed, "w_gate"))
         * _dense(y, self.w_up[...], packed, "w_up"))
    return x + _dense(y, self.w_down[...], packed, "w_down")


class DFlashDrafter(nnx.Module):
  """The drafter: `context_kv` turns target features into every layer's context K/V; calling it
  runs the block over them. Built from flat params with `drafter(config, params)`."""

  raw_taps = True  # its context is the raw residual stream (Decoder(..., raw_taps=True))
  own_vocab = False  # the target's LM head reads its output

  def __init__(self, c: DFlashConfig, dtype=jnp.float32, *, seed: int = 0, scale: float = 0.02):
    n, e = len(c.target_layer_ids), c.hidden_size
    rng = np.random.default_rng(seed)
    self.eps, self.theta, self.head_dim = c.norm_eps, c.rope_theta, c.head_dim
    self.fc = _param(rng, (n * e, e), dtype, scale / 0.02 / np.sqrt(n * e))
    self.hidden_norm, self.norm = _ones(e, dtype), _ones(e, dtype)
    self.layers = nnx.List([DFlashLayer(c, dtype, rng, scale) for _ in range(c.num_layers)])

  def rope(self, positions):
    """positions [B,T] -> (cos, sin) [B,T,D/2]."""
    d = self.head_dim
    inv = 1.0 / self.theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = positions[..., None].astype(jnp.float32) * jnp.asarray(inv, jnp.float32)
    return jnp.cos(ang), jnp.sin(ang)

  def context_kv(self, feats, positions, packed=None):
    """feats [B,C,nE] the target's tapped states at positions [B,C] -> per layer (k, v)
    [B,C,K,D]. packed: packed_copies' kernel copies (None: XLA's products)."""
    c = _norm(_dense(feats.astype(self.fc.dtype), self.fc[...], packed, "fc"),
              self.hidden_norm[...], self.eps)
    rope = self.rope(positions)
    return [layer.kv(c, rope, _layer_copies(packed, i)) for i, layer in enumerate(self.layers)]

  def __call__(self, emb, positions, ctx, mask, packed=None):
    """emb [B,N,E] the block's embeddings at positions [B,N]; ctx per layer (k, v) [B,K,S,D];
    mask [B,N,S+N]; packed as context_kv's. Returns the normed output [B,N,E] (what the target's
    LM head reads)."""
    rope = self.rope(positions)
    x = emb.astype(self.fc.dtype)
    for i, (layer, (k, v)) in enumerate(zip(self.layers, ctx)):
      x = layer(x, rope, k, v, mask, _layer_copies(packed, i))
    return _norm(x, self.norm[...], self.eps)


@functools.lru_cache(maxsize=16)
def _template(c: DFlashConfig, dtype_name: str):
  abstract = nnx.eval_shape(lambda: DFlashDrafter(c, jnp.dtype(dtype_name)))
  return nnx.split(abstract)


def _name(path) -> str:
  return ".".join(map(str, path_key(path)))


def param_shapes(c: DFlashConfig) -> dict:
  """{flat name: shape} of a drafter of config c."""
  _, abstract = _template(c, "float32")
  return {_name(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}


def drafter(c: DFlashConfig, params: dict) -> DFlashDrafter:
  """The module over flat params (arrays or tracers; their dtype is kept)."""
  graphdef, abstract = _template(c, jnp.dtype(params["fc"].dtype).name)
  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(
      lambda p, _: params[_name(p)], abstract))


def init_params(target, *, block_size: int = 8, mask_token_id: int | None = None,
                num_layers: int = 1, target_layer_ids=None, seed: int = 0,
                scale: float = 0.02, warm: bool = False) -> tuple[DFlashConfig, dict]:
  """A fresh drafter for `target`: the target's attention and MLP shapes, weights N(0, scale^2)
  (fc N(0, (scale / 0.02)^2 / nE)), norms at one. mask_token_id is required (no target has one
  that means "masked" to DFlash until it is trained so); target_layer_ids default to the published
  spread of num_layers layers. warm: start from the target instead (`warm_params`). Returns
  (config, flat params in the target's dtype)."""
  tc = target.config
  if mask_token_id is None:
    raise InputError("mask_token_id is missing: DFlash fills its block with a mask token; give "
                     f"a token id in [0, {tc.vocab_size}) (one the text never uses)")
  check_int("num_layers", num_layers, 1, 16)
  if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
    raise InputError(f"scale={scale!r} is invalid: must be a number > 0")
  ids = default_layer_ids(tc.num_layers, num_layers) if target_layer_ids is None else tuple(
      target_layer_ids)
  c = DFlashConfig(num_layers=num_layers, hidden_size=tc.hidden_size, vocab_size=tc.vocab_size,
                   target=getattr(target, "name", ""), block_size=block_size,
                   mask_token_id=mask_token_id, target_layer_ids=ids, attn_heads=tc.num_heads,
                   kv_heads=tc.num_kv_heads, head_dim=tc.head_dim,
                   intermediate_size=tc.intermediate_size, norm_eps=tc.norm_eps,
                   rope_theta=tc.rope_theta or 10000.0, num_target_layers=tc.num_layers)
  check_config(c)
  module = DFlashDrafter(c, getattr(target, "dtype", jnp.float32), seed=seed, scale=scale)
  _, state = nnx.split(module)
  params = {_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
  return c, (warm_params(c, params, target) if warm else params)


def warm_params(c: DFlashConfig, params: dict, target) -> dict:
  """A drafter that starts as the target's last layers rather than noise: drafter layer i is
  target layer L - n + i (attention, MLP and their norms; q/k norms at one), `norm` the target's
  final norm, and `fc` passes the deepest tapped state through (identity on its slice, zero on
  the other taps: they still get gradients) normed by `hidden_norm` = layer L - n's input norm.
  With the deepest tap at L - n - 1 (the state entering layer L - n), the first drafter layer's
  context values are the ones that target layer computes, its keys too up to the per-head key
  norm. The rest is learned; this only moves the start (docs/training.md, "DFlash")."""
  flat = {path_key(p): x for p, x in jax.tree_util.tree_flatten_with_path(target.params)[0]}
  tl, n, e = c.num_target_layers, c.num_layers, c.hidden_size
  tc = target.config
  if (tc.norm, tc.activation, tc.gated_mlp) != ("rms", "silu", True):
    raise InputError(f"warm=True copies the target's layers into Qwen3-style ones (RMSNorm, "
                     f"SwiGLU); this target has {tc.norm} norms and a {tc.activation} MLP "
                     f"(gated: {tc.gated_mlp}): start the drafter from noise (warm=False)")
  if ("layers", 0, "attn", "wqkv") not in flat or ("layers", 0, "attn", "bqkv") in flat:
    raise InputError("warm=True reads the target's float layers (wqkv, no biases): load the "
                     "target with float weights to start a drafter from it")
  dtype = params["fc"].dtype
  out = dict(params)
  taps = len(c.target_layer_ids)
  fc = np.zeros(np.shape(params["fc"]), np.float32)
  fc[(taps - 1) * e:] = np.eye(e, dtype=np.float32)
  out["fc"] = jnp.asarray(fc, dtype)
  out["norm"] = jnp.asarray(flat[("final_norm", "scale")], dtype)
  out["hidden_norm"] = jnp.asarray(flat[("layers", tl - n, "attn_norm", "scale")], dtype)
  for i in range(n):
    src, o = ("layers", tl - n + i), f"layers.{i}."
    wqkv = np.asarray(flat[src + ("attn", "wqkv")], np.float32)  # [E,K,G+2,D]
    g = wqkv.shape[2] - 2
    w_in = np.asarray(flat[src + ("mlp", "w_in")], np.float32)  # [E,2,F]: gate, up
    qk = {x: flat.get(src + ("attn", x, "scale"), params[o + x]) for x in ("q_norm", "k_norm")}
    for name, x in (("attn_norm", flat[src + ("attn_norm", "scale")]),
                    ("mlp_norm", flat[src + ("mlp_norm", "scale")]),
                    ("wq", wqkv[:, :, :g].reshape(e, -1, wqkv.shape[3])),
                    ("wk", wqkv[:, :, g]), ("wv", wqkv[:, :, g + 1]),
                    ("q_norm", qk["q_norm"]), ("k_norm", qk["k_norm"]),
                    ("wo", flat[src + ("attn", "wo")]), ("w_gate", w_in[:, 0]),
                    ("w_up", w_in[:, 1]), ("w_down", flat[src + ("mlp", "w_out")])):
      out[o + name] = jnp.asarray(np.asarray(x, np.float32), dtype)
  return out


def check_fits(c: DFlashConfig, params: dict, target, what: str) -> None:
  """InputError unless drafter `what` (config c, flat params) fits `target`."""
  t = target.config
  if (c.hidden_size, c.vocab_size) != (t.hidden_size, t.vocab_size):
    raise InputError(f"{what} were made for a target of width {c.hidden_size} and vocabulary "
                     f"{c.vocab_size}, but this target has width {t.hidden_size} and vocabulary "
                     f"{t.vocab_size}: load or train heads for this model")
  check_config(c, t.num_layers, f" (heads {what}, target of {t.num_layers} layers)")
  want = param_shapes(c)
  got = {k: tuple(np.shape(v)) for k, v in params.items()}
  if got != want:
    bad = sorted(set(want) ^ set(got)) or [k for k in want if want[k] != got[k]]
    raise InputError(f"{what}: tensor {bad[0]!r} has shape {got.get(bad[0])}, expected "
                     f"{want.get(bad[0])}")


# ----------------------------------------------------------------------------- blocks


def block_inputs(tokens, anchors, block: int, mask_token_id: int):
  """The blocks at anchors [B,A] of tokens [B,T]: (ids [B,A*bs] the anchor's token then mask
  tokens, positions [B,A*bs])."""
  b, a = anchors.shape
  pos = anchors[:, :, None] + jnp.arange(block)[None, None, :]  # [B,A,bs]
  first = jnp.take_along_axis(tokens, anchors, axis=1)[:, :, None]
  ids = jnp.where(jnp.arange(block)[None, None, :] == 0, first, mask_token_id)
  return ids.reshape(b, a * block).astype(jnp.int32), pos.reshape(b, a * block).astype(jnp.int32)


def anchored_hidden(module: DFlashDrafter, embed, tokens, feats, anchors, block: int,
                    mask_token_id: int):
  """Teacher-forced blocks, as training sees them: tokens [B,T]; feats [B,T,nE] the target's
  tapped states over them; anchors [B,A] block starts (each in [0, T - bs]). The block at a
  attends the context at positions < a and itself. Returns h [B,A,bs,E] (offset j >= 1 scores
  token a + j)."""
  b, t = tokens.shape
  a = anchors.shape[1]
  ids, pos = block_inputs(tokens, anchors, block, mask_token_id)
  ctx = module.context_kv(feats, jnp.broadcast_to(jnp.arange(t), (b, t)))
  ctx = [(jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)) for k, v in ctx]  # [B,K,T,D]
  start = jnp.repeat(anchors, block, axis=1)  # [B,N] each query's anchor
  see_ctx = jnp.arange(t)[None, None, :] < start[:, :, None]  # [B,N,T]
  blk = jnp.repeat(jnp.arange(a), block)
  see_blk = jnp.broadcast_to(blk[:, None] == blk[None, :], (b, a * block, a * block))
  h = module(embed[ids], pos, ctx, jnp.concatenate([see_ctx, see_blk], axis=-1))
  return h.reshape(b, a, block, -1)


# ----------------------------------------------------------------------------- published layout


def _get(ts: dict, name: str, path: str, shape) -> np.ndarray:
  if name not in ts:
    raise WeightsError(f"{path}: missing tensor {name!r}")
  x = np.asarray(ts[name])
  if tuple(x.shape) != tuple(shape):
    raise WeightsError(f"{path}: tensor {name!r} has shape {tuple(x.shape)}, expected "
                       f"{tuple(shape)}")
  return x


def _published_config(path: str, cfg: dict, tc) -> DFlashConfig:
  """The config.json of a published drafter -> DFlashConfig; errors name the missing field."""
  dcfg = cfg.get("dflash_config") or {}

  def field(name, default=None):
    v = dcfg.get(name, cfg.get(name, default))
    if v is None:
      raise WeightsError(f"{path}: config.json has no {name} (nor dflash_config.{name}): a DFlash "
                         f"drafter states its {name}")
    return v

  rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
  if rope.get("rope_type", rope.get("type", "default")) != "default" or cfg.get("is_causal"):
    raise WeightsError(f"{path}: only non-causal DFlash drafters with plain rope are read "
                       f"(rope {rope}, is_causal {cfg.get('is_causal')})")
  e, h = int(field("hidden_size")), int(field("num_attention_heads"))
  return DFlashConfig(
      num_layers=int(field("num_hidden_layers")), hidden_size=e,
      vocab_size=int(field("vocab_size")), block_size=int(field("block_size", 16)),
      mask_token_id=int(field("mask_token_id")),
      target_layer_ids=tuple(int(i) for i in field("target_layer_ids")), attn_heads=h,
      kv_heads=int(field("num_key_value_heads", h)), head_dim=int(cfg.get("head_dim") or e // h),
      intermediate_size=int(field("intermediate_size")),
      norm_eps=float(field("rms_norm_eps", 1e-6)),
      rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
      num_target_layers=int(field("num_target_layers",
                                  tc.num_layers if tc is not None else None)))


def from_published(path: str, ts: dict, cfg: dict, tc=None):
  """z-lab's layout (tensors ts, config.json cfg) -> (config fields, flat params, None, meta)."""
  c = _published_config(path, cfg, tc)
  e, h, k, d, f = c.hidden_size, c.attn_heads, c.kv_heads, c.head_dim, c.intermediate_size
  n = len(c.target_layer_ids)
  p = {"fc": _get(ts, "fc.weight", path, (e, n * e)).T,
       "hidden_norm": _get(ts, "hidden_norm.weight", path, (e,)),
       "norm": _get(ts, "norm.weight", path, (e,))}
  for i in range(c.num_layers):
    a, o = f"layers.{i}.self_attn.", f"layers.{i}."
    p[o + "attn_norm"] = _get(ts, o + "input_layernorm.weight", path, (e,))
    p[o + "mlp_norm"] = _get(ts, o + "post_attention_layernorm.weight", path, (e,))
    p[o + "wq"] = _get(ts, a + "q_proj.weight", path, (h * d, e)).T.reshape(e, h, d)
    p[o + "wk"] = _get(ts, a + "k_proj.weight", path, (k * d, e)).T.reshape(e, k, d)
    p[o + "wv"] = _get(ts, a + "v_proj.weight", path, (k * d, e)).T.reshape(e, k, d)
    p[o + "wo"] = _get(ts, a + "o_proj.weight", path, (e, h * d)).T.reshape(h, d, e)
    p[o + "q_norm"] = _get(ts, a + "q_norm.weight", path, (d,))
    p[o + "k_norm"] = _get(ts, a + "k_norm.weight", path, (d,))
    for ours, theirs, shape in (("w_gate", "gate_proj", (f, e)), ("w_up", "up_proj", (f, e)),
                                ("w_down", "down_proj", (e, f))):
      p[o + ours] = _get(ts, o + f"mlp.{theirs}.weight", path, shape).T
  extra = sorted(set(ts) - set(_published_names(c)))
  if extra:
    raise WeightsError(f"{path}: tensors {extra[:4]} are not DFlash's (a later variant?)")
  fields = {k: v for k, v in dataclasses.asdict(c).items() if k != "target"}  # (from config)
  return fields, p, None, {}


def _published_names(c: DFlashConfig) -> list:
  names = ["fc.weight", "hidden_norm.weight", "norm.weight"]
  for i in range(c.num_layers):
    names += [f"layers.{i}.{n}.weight" for n in (
        "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
        "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
  return names


def to_published(c: DFlashConfig, params: dict) -> tuple[dict, dict]:
  """Our drafter -> (tensors, config.json) in z-lab's layout (the inverse of from_published)."""
  e, h, k, d = c.hidden_size, c.attn_heads, c.kv_heads, c.head_dim
  p = {n: np.asarray(x) for n, x in params.items()}
  ts = {"fc.weight": p["fc"].T, "hidden_norm.weight": p["hidden_norm"], "norm.weight": p["norm"]}
  for i in range(c.num_layers):
    a, o = f"layers.{i}.self_attn.", f"layers.{i}."
    ts[o + "input_layernorm.weight"] = p[o + "attn_norm"]
    ts[o + "post_attention_layernorm.weight"] = p[o + "mlp_norm"]
    ts[a + "q_proj.weight"] = p[o + "wq"].reshape(e, h * d).T
    ts[a + "k_proj.weight"] = p[o + "wk"].reshape(e, k * d).T
    ts[a + "v_proj.weight"] = p[o + "wv"].reshape(e, k * d).T
    ts[a + "o_proj.weight"] = p[o + "wo"].reshape(h * d, e).T
    ts[a + "q_norm.weight"], ts[a + "k_norm.weight"] = p[o + "q_norm"], p[o + "k_norm"]
    ts[o + "mlp.gate_proj.weight"] = p[o + "w_gate"].T
    ts[o + "mlp.up_proj.weight"] = p[o + "w_up"].T
    ts[o + "mlp.down_proj.weight"] = p[o + "w_down"].T
  config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "base_model_name_or_path": c.target, "hidden_size": e,
            "num_hidden_layers": c.num_layers, "num_attention_heads": h,
            "num_key_value_heads": k, "head_dim": d, "intermediate_size": c.intermediate_size,
            "rms_norm_eps": c.norm_eps, "rope_theta": c.rope_theta, "vocab_size": c.vocab_size,
            "attention_bias": False, "hidden_act": "silu", "tie_word_embeddings": False,
            "num_target_layers": c.num_target_layers, "block_size": c.block_size,
            "dflash_config": {"block_size": c.block_size, "mask_token_id": c.mask_token_id,
                              "target_layer_ids": list(c.target_layer_ids)}}
  return {n: np.ascontiguousarray(x) for n, x in ts.items()}, config
