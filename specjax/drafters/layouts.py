"""Published drafter layouts: recognised from the files' contents, read into specjax heads.

    fields, params, vocab, meta = read(path, target_config)   # -> heads.HeadsConfig(**fields), ...
    (writing them back: specjax.drafters.writers; the files they come in: drafters.files)

A layout is recognised from its tensor names (and config fields), never from a file name: the file
names only tell which files to open, and a file's first bytes tell its container (safetensors, a
torch zip / legacy pickle, numpy .npz). Pickles (.pt / .bin) are read with
`torch.load(weights_only=True)` only, and refused unless they hold a flat {name: tensor} dict.

The layouts (tensors [out, in] as torch's nn.Linear stores them; ours are [in, out]):

  medusa-1      FasterDecoding's Medusa-1: config.json {medusa_num_heads, medusa_num_layers,
                base_model_name_or_path}; medusa_lm_head.safetensors / .pt. Head i is
                nn.Sequential(ResBlock x L, Linear(E, V, bias=False)): "{i}.{j}.linear.weight" [E,E]
                and ".bias" [E] for the blocks x <- x + SiLU(W x + b), j < L, then "{i}.{L}.weight"
                [V,E], the head's own LM head (newer files leave it out: the target's LM head). The
                heads read the target's final-normed hidden state. The count of heads and layers
                follows the tensors present (the original loader forces 5 heads); a head built as
                [ResBlock] * L shares one block's weights, and a deduplicated safetensors file then
                keeps only one of them: the missing blocks are that one.
  medusa-vllm   vLLM's Medusa: config.json {num_heads, num_hidden_layers, vocab_size,
                truncated_vocab_size}; "blocks.{i}.layers.{j}.weight" [E,E] (".bias" with
                medusa_fc_bias), "lm_heads.{i}.weight" [Vt,E] (or one shared "lm_head.weight"),
                "token_map" [Vt] (target ids of a truncated vocabulary, Vt < V).
  eagle         SafeAILab's EAGLE-1/2: a Llama config.json (num_hidden_layers 1, bias, qkv_bias);
                pytorch_model.bin / model.safetensors: "fc.weight" [E,2E] (+ "fc.bias") over
                cat(embedding of token t+1, the target's final-normed hidden state at t), then one
                Llama decoder layer "layers.0.*" that applies NO input norm (its
                input_layernorm, if stored, is unused), no final norm, and the target's LM head
                and embedding ("embed_tokens.weight", if stored, is a copy of the target's).
  eagle3        SafeAILab's EAGLE-3: a Llama config.json (num_hidden_layers 1, vocab_size V (the
                target's), draft_vocab_size Vd); pytorch_model.bin / model.safetensors:
                "fc.weight" [E,3E] (no bias) over cat(h_2, h_{L//2}, h_{L-3}), the target's
                hidden states ENTERING those layers (L: the target's layer count); "midlayer.*",
                one Llama layer whose attention reads cat(input_layernorm(embedding of token
                t+1), hidden_norm(h)) ("midlayer.self_attn.{q,k,v}_proj.weight" [.., 2E]) with h
                (the fc output; at later draft steps the layer's previous output, no fc) as its
                residual, then "midlayer.post_attention_layernorm" and the SiLU-gated MLP;
                "norm.weight", "lm_head.weight" [Vd,E]; "d2t" [Vd] int64 (target id = draft id +
                d2t[draft id]) and "t2d" [V] bool; optionally "embed_tokens.weight" [V,E] (else
                the target's embedding). specjax.drafters.eagle3 runs it as kind "eagle3".

This module depends on nothing above the config: it returns plain fields and arrays, and
specjax.drafters.heads_file builds the Heads.
"""

from __future__ import annotations

import dataclasses
import os
import re

import numpy as np

from specjax.arch.common import mtp_layers
from specjax.drafters.files import (  # noqa: F401 (LAYOUTS, container, is_published: re-exported)
    LAYOUTS, _layout_list, config_json, container, is_published,
                                    tensors)
from specjax.errors import InputError, WeightsError

# ----------------------------------------------------------------------------- recognising


_MEDUSA1 = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")
_MTP_LAYER = re.compile(r"^model\.layers\.(\d+)\.eh_proj\.weight$")
_VLLM = re.compile(r"^(blocks\.\d+\.layers\.\d+\.(weight|bias)|lm_heads\.\d+\.weight|"
                   r"lm_head\.weight|token_map)$")


def detect(names, cfg: dict) -> str:
  """The layout of a set of tensor names (and config fields); WeightsError listing the recognised
  layouts otherwise."""
  names = set(names)
  if names and all(_MEDUSA1.match(n) for n in names):
    return "medusa-1"
  if names and all(_VLLM.match(n) for n in names) and any(n.startswith("blocks.") for n in names):
    return "medusa-vllm"
  if "fc.weight" in names and ("hidden_norm.weight" in names or "dflash_config" in cfg):
    return "dflash"
  if "fc.weight" in names and any(n.startswith("layers.0.") for n in names):
    return "eagle"
  if any(_MTP_LAYER.match(n) for n in names):
    return "mtp-deepseek"
  if any(n.startswith("midlayer.") for n in names) or "d2t" in names:
    return "eagle3"
  shown = sorted(names)[:6]
  raise WeightsError(f"not a recognised drafter layout (tensors {shown}"
                     f"{' ...' if len(names) > 6 else ''}; config fields "
                     f"{sorted(cfg)[:6]}); recognised layouts: {_layout_list()}")


def read(path: str, target_config=None):
  """A published drafter -> (HeadsConfig fields, params {name: array}, vocab ids or None, meta).
  target_config (a ModelConfig, optional) fills what the files leave out (EAGLE's layer shapes,
  vocabulary size) and is checked against what they state."""
  cfg = config_json(path)
  ts = tensors(path, mtp_layers(cfg))
  for prefix in ("medusa_head.", "medusa_heads."):  # whole-model saves keep the heads under these
    if ts and all(n.startswith(prefix) for n in ts):
      ts = {k[len(prefix):]: v for k, v in ts.items()}
  try:
    layout = detect(ts, cfg)
  except WeightsError as e:
    raise WeightsError(f"{path}: {e}") from None
  from specjax.drafters.dflash import from_published

  reader = {"medusa-1": _medusa1, "medusa-vllm": _medusa_vllm, "eagle": _eagle,
            "mtp-deepseek": _mtp_deepseek, "eagle3": _eagle3, "dflash": from_published}[layout]
  fields, params, vocab, meta = reader(path, ts, cfg, target_config)
  name = cfg.get("base_model_name_or_path") or ""
  fields.setdefault("target", name if isinstance(name, str) else "")
  return fields, params, vocab, dict(meta, layout=layout, source=os.path.basename(
      os.path.normpath(path)))


def _need(ts: dict, name: str, path: str, shape=None) -> np.ndarray:
  if name not in ts:
    raise WeightsError(f"{path}: missing tensor {name!r}")
  arr = ts[name]
  if shape is not None and tuple(arr.shape) != tuple(shape):
    raise WeightsError(f"{path}: tensor {name!r} has shape {tuple(arr.shape)}, expected "
                       f"{tuple(shape)}")
  return arr


# ----------------------------------------------------------------------------- Medusa


def _medusa_stack(path, blocks, lms, bias_name=None):
  """blocks {(i, j): (weight [E,E] or None, bias [E] or None)}, lms {i: [V,E]} -> w [K,L,E,E]
  (ours, [in, out]), b [K,L,E], lm [K,V,E] or None, with the checks every Medusa layout shares.
  bias_name(i, j): the name of a block's bias when the layout requires one."""
  heads = sorted({i for i, _ in blocks} | set(lms))
  k = len(heads)
  if heads != list(range(k)):
    missing = next(i for i in range(k + 1) if i not in heads)
    raise WeightsError(f"{path}: Medusa heads {heads}: head {missing} has no tensors")
  depth = {i: 1 + max([j for (h, j) in blocks if h == i], default=-1) for i in heads}
  if len(set(depth.values())) != 1 or not depth[0]:
    raise WeightsError(f"{path}: Medusa heads have different numbers of residual blocks "
                       f"{depth} (every head needs the same, at least one)")
  layers = depth[0]
  e = next(w.shape[0] for w, _ in blocks.values() if w is not None)
  w = np.zeros((k, layers, e, e), np.float32)
  b = np.zeros((k, layers, e), np.float32)
  for i in heads:
    present = [j for j in range(layers) if blocks.get((i, j), (None, None))[0] is not None]
    if not present:
      raise WeightsError(f"{path}: Medusa head {i} has no residual block weights")
    for j in range(layers):  # a head of [ResBlock] * L shares one block: files may keep one copy
      wij, bij = blocks.get((i, j), (None, None))
      if wij is None:
        wij, bij = blocks[(i, present[0])]
      if tuple(wij.shape) != (e, e):
        raise WeightsError(f"{path}: Medusa head {i} block {j} weight has shape "
                           f"{tuple(wij.shape)}, expected {(e, e)}")
      if bij is None and bias_name is not None:
        raise WeightsError(f"{path}: missing tensor {bias_name(i, j)!r}")
      w[i, j] = np.asarray(wij, np.float32).T
      if bij is not None:
        b[i, j] = np.asarray(bij, np.float32).reshape(e)
  lm = None
  if lms:
    if sorted(lms) != heads:
      raise WeightsError(f"{path}: only heads {sorted(lms)} of {heads} have their own LM head")
    shapes = {tuple(x.shape) for x in lms.values()}
    if len(shapes) != 1 or next(iter(shapes))[1] != e:
      raise WeightsError(f"{path}: Medusa LM heads have shapes {sorted(shapes)}, expected [V, {e}]")
    lm = np.stack([np.asarray(lms[i], np.float32) for i in heads])
  return w, b, lm


def _medusa1(path, ts, cfg, tc):
  blocks, lms, lm_at = {}, {}, {}
  for n, arr in ts.items():
    i, j, what = _MEDUSA1.match(n).groups()
    i, j = int(i), int(j)
    if what == "weight":  # "{i}.{L}.weight": the head's LM head, after its L blocks
      lms[i], lm_at[i] = arr, j
    else:
      blocks.setdefault((i, j), [None, None])[what == "linear.bias"] = arr
  for (i, j), (wij, _) in blocks.items():
    if wij is None:
      raise WeightsError(f"{path}: missing tensor '{i}.{j}.linear.weight'")
    if j >= lm_at.get(i, j + 1):
      raise WeightsError(f"{path}: head {i} has a residual block {j} after its LM head "
                         f"'{i}.{lm_at[i]}.weight'")
  # Blocks a deduplicated file left out (shared weights): up to the LM head, or, in files
  # without LM heads, up to the config's medusa_num_layers.
  want = cfg.get("medusa_num_layers") if isinstance(cfg.get("medusa_num_layers"), int) else 0
  for i in {i for i, _ in blocks} | set(lm_at):
    for j in range(lm_at.get(i, want)):
      blocks.setdefault((i, j), (None, None))
  w, b, lm = _medusa_stack(path, blocks, lms, lambda i, j: f"{i}.{j}.linear.bias")
  return _medusa_fields(path, w, b, lm, None, cfg, tc,
                        {"medusa_num_heads": cfg.get("medusa_num_heads"),
                         "medusa_num_layers": cfg.get("medusa_num_layers")})


def _medusa_vllm(path, ts, cfg, tc):
  blocks, lms = {}, {}
  for n in ts:
    m = re.match(r"blocks\.(\d+)\.layers\.(\d+)\.weight$", n)
    if m:
      i, j = int(m.group(1)), int(m.group(2))
      blocks[(i, j)] = (ts[n], ts.get(f"blocks.{i}.layers.{j}.bias"))
    m = re.match(r"lm_heads\.(\d+)\.weight$", n)
    if m:
      lms[int(m.group(1))] = ts[n]
  for n in ts:
    m = re.match(r"blocks\.(\d+)\.layers\.(\d+)\.bias$", n)
    if m and (int(m.group(1)), int(m.group(2))) not in blocks:
      raise WeightsError(f"{path}: missing tensor 'blocks.{m.group(1)}.layers.{m.group(2)}.weight'")
  if "lm_head.weight" in ts:  # original_lm_head: one LM head for every head
    if lms:
      raise WeightsError(f"{path}: both lm_head.weight and lm_heads.* are stored")
    lms = {i: ts["lm_head.weight"] for i in {i for i, _ in blocks}}
  w, b, lm = _medusa_stack(path, blocks, lms)
  vocab = None
  full = cfg.get("vocab_size") or (tc.vocab_size if tc is not None else None)
  trunc = cfg.get("truncated_vocab_size")
  if "token_map" in ts:
    vocab = np.asarray(ts["token_map"]).astype(np.int64).reshape(-1)
    if lm is not None and lm.shape[1] != vocab.size:
      raise WeightsError(f"{path}: token_map has {vocab.size} ids but the LM heads score "
                         f"{lm.shape[1]} tokens")
  elif lm is not None and ((trunc and full and trunc < full) or (full and lm.shape[1] < full)):
    raise WeightsError(f"{path}: the LM heads score a truncated vocabulary ({lm.shape[1]} of "
                       f"{full} tokens) but there is no 'token_map' tensor to map it to the "
                       f"target's token ids")
  return _medusa_fields(path, w, b, lm, vocab, cfg, tc, {
      "num_heads": cfg.get("num_heads"), "truncated_vocab_size": trunc})


def _medusa_fields(path, w, b, lm, vocab, cfg, tc, meta):
  k, layers, e, _ = w.shape
  if vocab is not None:
    v = int(cfg.get("vocab_size") or (tc.vocab_size if tc is not None else vocab.max() + 1))
  elif lm is not None:
    v = lm.shape[1]
  elif tc is not None:
    v = tc.vocab_size
  else:
    v = int(cfg.get("vocab_size") or 0)
  if not v:
    raise InputError(f"{path}: these Medusa heads use the target's LM head and state no "
                     f"vocabulary size: pass target= to load_heads")
  if vocab is not None and (vocab.size != len(np.unique(vocab)) or vocab.min() < 0
                            or vocab.max() >= v):
    raise WeightsError(f"{path}: token_map must hold distinct token ids in [0, {v})")
  params = {"w": w, "b": b}
  if lm is not None:
    params["lm"] = lm
  fields = dict(kind="medusa", num_heads=k, num_layers=layers, hidden_size=e, vocab_size=v,
                vocab_subset=0 if vocab is None else int(vocab.size))
  meta = {m: x for m, x in meta.items() if x is not None}
  return fields, params, None if vocab is None else vocab.astype(np.int32), meta


# ----------------------------------------------------------------------------- EAGLE-1/2

# One Llama decoder layer, HF names under "layers.0." -> ours under "layer." (eagle.EagleLayer
# runs it as the target's Block, with its input norm removed).
_EAGLE_IGNORED = ("embed_tokens.weight", "layers.0.input_layernorm.weight")


def _eagle_shapes(path, cfg, tc, e, fc_in=2):
  """(H, Kv, D) of the head's attention, from its config.json, else the target's; checked against
  the target's where both are known."""
  if tc is not None and e != tc.hidden_size:
    raise InputError(f"{path}: EAGLE heads of width {e} (fc.weight [{e}, {fc_in * e}]) were made "
                     f"for another target: this target has width {tc.hidden_size}")
  pairs = (("num_attention_heads", "num_heads"), ("num_key_value_heads", "num_kv_heads"),
           ("head_dim", "head_dim"), ("intermediate_size", "intermediate_size"),
           ("rope_theta", "rope_theta"), ("rms_norm_eps", "norm_eps"), ("vocab_size", "vocab_size"))
  if tc is not None:
    for theirs, ours in pairs:
      got, want = cfg.get(theirs), getattr(tc, ours)
      if got is not None and theirs != "vocab_size" and not np.isclose(float(got), float(want),
                                                                       rtol=1e-6, atol=0):
        raise InputError(f"{path}: the EAGLE head's {theirs} is {got}, the target's is {want}: "
                         f"these heads were made for another target")
    if cfg.get("hidden_act", "silu") != "silu" or (fc_in == 2 and not tc.gated_mlp):
      raise InputError(f"{path}: the EAGLE head's layer is a SiLU-gated Llama MLP; the target's "
                       f"is not (hidden_act {cfg.get('hidden_act')!r}, gated {tc.gated_mlp})")
  h = cfg.get("num_attention_heads") or (tc.num_heads if tc is not None else None)
  if not h:
    raise InputError(f"{path}: no config.json with num_attention_heads beside the EAGLE weights: "
                     f"pass target= to load_heads")
  kv = cfg.get("num_key_value_heads") or (tc.num_kv_heads if tc is not None else h)
  d = cfg.get("head_dim") or (tc.head_dim if tc is not None else e // h)
  return int(h), int(kv), int(d)


def _eagle(path, ts, cfg, tc):
  fc = _need(ts, "fc.weight", path)
  e = fc.shape[0]
  _need(ts, "fc.weight", path, (e, 2 * e))
  deeper = sorted(n for n in ts if n.startswith("layers.") and not n.startswith("layers.0."))
  if deeper or cfg.get("num_hidden_layers", 1) != 1:
    raise WeightsError(f"{path}: EAGLE heads with {cfg.get('num_hidden_layers')} layers "
                       f"({deeper[:2]}): specjax runs EAGLE-1/2 heads of one decoder layer")
  h, kv, d = _eagle_shapes(path, cfg, tc, e)
  g, p = h // kv, "layers.0."
  f = _need(ts, p + "mlp.gate_proj.weight", path).shape[0]
  get = lambda n, shape: np.asarray(_need(ts, p + n, path, shape), np.float32)  # noqa: E731
  q = get("self_attn.q_proj.weight", (h * d, e)).reshape(kv, g, d, e)
  k = get("self_attn.k_proj.weight", (kv * d, e)).reshape(kv, 1, d, e)
  v = get("self_attn.v_proj.weight", (kv * d, e)).reshape(kv, 1, d, e)
  layer = {
      "layer.attn.wqkv": np.concatenate([q, k, v], 1).transpose(3, 0, 1, 2),  # [E,Kv,G+2,D]
      "layer.attn.wo": get("self_attn.o_proj.weight", (e, h * d)).T.reshape(h, d, e),
      "layer.mlp.w_in": np.stack([get("mlp.gate_proj.weight", (f, e)),
                                  get("mlp.up_proj.weight", (f, e))], 0).transpose(2, 0, 1),
      "layer.mlp.w_out": get("mlp.down_proj.weight", (e, f)).T,
      "layer.mlp_norm.scale": get("post_attention_layernorm.weight", (e,)),
  }
  used = {p + n for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                          "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                          "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                          "post_attention_layernorm.weight")} | {"fc.weight", "fc.bias"}
  if p + "self_attn.q_proj.bias" in ts or (tc is not None and tc.qkv_bias):
    if tc is not None and not tc.qkv_bias:
      raise InputError(f"{path}: the EAGLE head's attention has q/k/v biases; the target's "
                       f"layers have none, so specjax cannot run it as the target's layer type")
    bias = [np.asarray(ts.get(p + f"self_attn.{x}_proj.bias", np.zeros(n * d)), np.float32)
            for x, n in (("q", h), ("k", kv), ("v", kv))]
    used |= {p + f"self_attn.{x}_proj.bias" for x in "qkv"}
    layer["layer.attn.bqkv"] = np.concatenate(
        [bias[0].reshape(kv, g, d), bias[1].reshape(kv, 1, d), bias[2].reshape(kv, 1, d)], 1)
  extra = sorted(n for n in ts if n not in used and n not in _EAGLE_IGNORED
                 and not n.endswith("rotary_emb.inv_freq"))
  if extra:
    raise WeightsError(f"{path}: unexpected tensor(s) {extra[:5]} in an EAGLE-1/2 head")
  vocab = cfg.get("vocab_size") or (ts["embed_tokens.weight"].shape[0]
                                    if "embed_tokens.weight" in ts else None)
  vocab = vocab or (tc.vocab_size if tc is not None else None)
  if not vocab:
    raise InputError(f"{path}: the EAGLE head states no vocabulary size: pass target=")
  fc_b = np.asarray(ts.get("fc.bias", np.zeros(e)), np.float32).reshape(e)
  params = {"fc_w": np.asarray(fc, np.float32).T[None], "fc_b": fc_b[None]}
  params.update({n: x[None] for n, x in layer.items()})
  fields = dict(kind="eagle", num_heads=1, num_layers=1, hidden_size=e, vocab_size=int(vocab),
                input_norm=False)
  meta = {"eagle_config": {k: cfg[k] for k in ("rope_theta", "rms_norm_eps", "rope_scaling",
                                               "max_position_embeddings", "bias", "qkv_bias")
                           if k in cfg}}
  return fields, params, None, meta


# ----------------------------------------------------------------------------- DeepSeek MTP layers


class _MTPLayerSource:
  """Module n's tensors under the names a family's converter asks for: layer 0 of the family ->
  "model.layers.{n}.", the final norm -> its shared_head.norm; the embedding (a copy of the
  target's, checked apart) reads as zeros when the file leaves it out."""

  def __init__(self, ts: dict, n: int, path: str):
    self.ts, self.n, self.path, self.used = ts, n, path, set()

  def _name(self, name: str) -> str:
    if name.startswith("model.layers.0."):
      return f"model.layers.{self.n}." + name[len("model.layers.0."):]
    return {"model.embed_tokens.weight": f"model.layers.{self.n}.embed_tokens.weight",
            "model.norm.weight": f"model.layers.{self.n}.shared_head.norm.weight"}.get(
                name, "(not in an MTP layer) " + name)

  def has(self, name: str) -> bool:
    return self._name(name) in self.ts

  def get(self, name: str, shape) -> np.ndarray:
    real = self._name(name)
    if name == "model.embed_tokens.weight" and real not in self.ts:
      return np.zeros((1, 1), np.float32)  # the target's own embedding is used
    self.used.add(real)
    return np.asarray(_need(self.ts, real, self.path, shape), np.float32)


def _mtp_deepseek(path, ts, cfg, tc):
  """DeepSeek-V3-style MTP layers (see the module docstring) -> our MTP heads with the modules'
  output norms ("norm_o"). The layer is converted by the target family's own converter."""
  from specjax import arch  # the families' converters (config level: no model code)

  if tc is None:
    raise InputError(f"{path}: MTP layers are decoder layers of the target's type: pass target= "
                     f"to load_heads")
  k, n = cfg.get("num_nextn_predict_layers"), cfg.get("num_hidden_layers")
  found = sorted(int(_MTP_LAYER.match(x).group(1)) for x in ts if _MTP_LAYER.match(x))
  if not isinstance(k, int) or not isinstance(n, int) or k < 1:
    raise WeightsError(f"{path}: MTP layers {found} but config.json states no "
                       f"num_nextn_predict_layers / num_hidden_layers")
  if n != tc.num_layers or cfg.get("hidden_size", tc.hidden_size) != tc.hidden_size:
    raise InputError(f"{path}: MTP layers of a checkpoint with {n} layers of width "
                     f"{cfg.get('hidden_size')}, but this target has {tc.num_layers} layers of "
                     f"width {tc.hidden_size}: these heads were made for another target")
  if found != list(range(n, n + k)):
    raise WeightsError(f"{path}: num_nextn_predict_layers is {k}, so MTP layers "
                       f"{list(range(n, n + k))} are expected; found {found}")
  fam = arch.of(tc)
  if not hasattr(fam, "params_from_hf") or tc.arch == "gpt2":
    raise InputError(f"{path}: MTP layers for a {tc.arch} target are not supported (decoder "
                     f"layers named model.layers.*: Llama, Qwen, Mistral, Gemma, Phi-3)")
  e, v = tc.hidden_size, tc.vocab_size
  one = dataclasses.replace(tc, num_layers=1, tie_word_embeddings=True)
  mods, shared = [], []
  for i in range(k):
    p = f"model.layers.{n + i}."
    src = _MTPLayerSource(ts, n + i, path)
    converted = fam.params_from_hf(one, src)
    mod = {"fc_w": np.asarray(_need(ts, p + "eh_proj.weight", path, (e, 2 * e)), np.float32).T,
           "fc_b": np.zeros((e,), np.float32),
           "norm_e": np.asarray(_need(ts, p + "enorm.weight", path, (e,)), np.float32),
           "norm_h": np.asarray(_need(ts, p + "hnorm.weight", path, (e,)), np.float32),
           "norm_o": converted[("final_norm", "scale")]}
    mod.update({"layer." + ".".join(map(str, key[2:])): x for key, x in converted.items()
                if key[:2] == ("layers", 0)})
    head = np.asarray(_need(ts, p + "shared_head.head.weight", path, (v, e)), np.float32)
    emb = ts.get(p + "embed_tokens.weight")
    if emb is not None:
      emb = np.asarray(_need(ts, p + "embed_tokens.weight", path, (v, e)), np.float32)
    src.used |= {p + x for x in ("eh_proj.weight", "enorm.weight", "hnorm.weight",
                                 "shared_head.head.weight", "embed_tokens.weight")}
    extra = sorted(x for x in ts if x.startswith(p) and x not in src.used
                   and not x.endswith("rotary_emb.inv_freq"))
    if extra:
      raise WeightsError(f"{path}: unexpected tensor(s) {extra[:5]} in MTP layer {n + i}")
    mods.append(mod)
    shared.append((head, emb))
  params = {name: np.stack([m[name] for m in mods]) for name in mods[0]}
  fields = dict(kind="mtp", num_heads=k, num_layers=1, hidden_size=e, vocab_size=v)
  return fields, params, None, {"shared_with_target": shared}


# ----------------------------------------------------------------------------- EAGLE-3

def eagle3_taps(num_layers: int) -> tuple:
  """The target layers whose entering hidden states EAGLE-3 fuses: (2, L // 2, L - 3) (SafeAILab's
  choice; they must be three distinct layers, so L >= 7)."""
  taps = (2, num_layers // 2, num_layers - 3)
  if not taps[0] < taps[1] < taps[2]:
    raise InputError(f"EAGLE-3 fuses the hidden states entering target layers 2, L // 2 and "
                     f"L - 3, three distinct layers; a target of {num_layers} layers has "
                     f"{sorted(set(taps))} (EAGLE-3 needs at least 7 layers)")
  return taps


_EAGLE3_LAYER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                 "mlp.down_proj.weight", "post_attention_layernorm.weight",
                 "input_layernorm.weight", "hidden_norm.weight")


def _eagle3(path, ts, cfg, tc):
  fc = _need(ts, "fc.weight", path)
  e = fc.shape[0]
  _need(ts, "fc.weight", path, (e, 3 * e))
  if cfg.get("num_hidden_layers", 1) != 1:
    raise WeightsError(f"{path}: EAGLE-3 heads with num_hidden_layers "
                       f"{cfg.get('num_hidden_layers')}: specjax runs EAGLE-3 heads of one layer")
  h, kv, d = _eagle_shapes(path, cfg, tc, e, fc_in=3)
  if tc is None:
    raise InputError(f"{path}: an EAGLE-3 head reads target layers 2, L // 2 and L - 3: pass "
                     f"target= to load_heads")
  taps = eagle3_taps(tc.num_layers)
  v = int(cfg.get("vocab_size") or tc.vocab_size)
  if v != tc.vocab_size:
    raise InputError(f"{path}: the EAGLE-3 head's vocabulary is {v} tokens (config vocab_size), "
                     f"the target's is {tc.vocab_size}: these heads were made for another target")
  g, p = h // kv, "midlayer."
  f = _need(ts, p + "mlp.gate_proj.weight", path).shape[0]
  get = lambda n, shape: np.asarray(_need(ts, p + n, path, shape), np.float32)  # noqa: E731
  q = get("self_attn.q_proj.weight", (h * d, 2 * e)).reshape(kv, g, d, 2 * e)
  k = get("self_attn.k_proj.weight", (kv * d, 2 * e)).reshape(kv, 1, d, 2 * e)
  vv = get("self_attn.v_proj.weight", (kv * d, 2 * e)).reshape(kv, 1, d, 2 * e)
  lm = _need(ts, "lm_head.weight", path)
  vd = lm.shape[0]
  lm = np.asarray(_need(ts, "lm_head.weight", path, (vd, e)), np.float32)
  if cfg.get("draft_vocab_size") not in (None, vd):
    raise WeightsError(f"{path}: lm_head.weight scores {vd} tokens but config.json says "
                       f"draft_vocab_size {cfg['draft_vocab_size']}")
  d2t = np.asarray(_need(ts, "d2t", path))
  if d2t.shape != (vd,) or not np.issubdtype(d2t.dtype, np.integer):
    raise WeightsError(f"{path}: d2t has shape {d2t.shape} dtype {d2t.dtype}, expected [{vd}] "
                       f"integers (one offset per draft token)")
  ids = np.arange(vd, dtype=np.int64) + d2t.astype(np.int64)  # target id of each draft id
  if ids.min() < 0 or ids.max() >= v or len(np.unique(ids)) != vd:
    bad = int(np.flatnonzero((ids < 0) | (ids >= v))[0]) if (ids.min() < 0 or ids.max() >= v) \
        else None
    what = (f"draft id {bad} maps to target id {ids[bad]}, outside [0, {v})" if bad is not None
            else "two draft ids map to the same target id")
    raise WeightsError(f"{path}: d2t out of range: {what} (target id = draft id + d2t[draft id])")
  if "t2d" in ts:
    t2d = np.asarray(ts["t2d"]).astype(bool).reshape(-1)
    want = np.zeros(v, bool)
    want[ids] = True
    if t2d.shape != (v,) or not np.array_equal(t2d, want):
      raise WeightsError(f"{path}: t2d (shape {t2d.shape}) does not mark exactly the {vd} target "
                         f"ids that d2t maps the draft vocabulary to")
  params = {
      "fuse_w": np.asarray(fc, np.float32).T,  # [3E,E]
      "norm_emb": get("input_layernorm.weight", (e,)),
      "norm_hid": get("hidden_norm.weight", (e,)),
      "layer.attn.wqkv": np.concatenate([q, k, vv], 1).transpose(3, 0, 1, 2),  # [2E,Kv,G+2,D]
      "layer.attn.wo": get("self_attn.o_proj.weight", (e, h * d)).T.reshape(h, d, e),
      "layer.mlp.w_in": np.stack([get("mlp.gate_proj.weight", (f, e)),
                                  get("mlp.up_proj.weight", (f, e))], 0).transpose(2, 0, 1),
      "layer.mlp.w_out": get("mlp.down_proj.weight", (e, f)).T,
      "layer.mlp_norm.scale": get("post_attention_layernorm.weight", (e,)),
      "norm": np.asarray(_need(ts, "norm.weight", path, (e,)), np.float32),
      "lm": lm,
  }
  if "embed_tokens.weight" in ts:
    params["embed"] = np.asarray(_need(ts, "embed_tokens.weight", path, (v, e)), np.float32)
  used = {p + n for n in _EAGLE3_LAYER} | {"fc.weight", "norm.weight", "lm_head.weight", "d2t",
                                            "t2d", "embed_tokens.weight"}
  extra = sorted(n for n in ts if n not in used and not n.endswith("rotary_emb.inv_freq"))
  if extra:
    raise WeightsError(f"{path}: unexpected tensor(s) {extra[:5]} in an EAGLE-3 head")
  vocab = None if vd == v and np.array_equal(ids, np.arange(v)) else ids.astype(np.int32)
  fields = dict(kind="eagle3", num_heads=1, num_layers=1, hidden_size=e, vocab_size=v,
                vocab_subset=0 if vocab is None else vd, taps=taps)
  meta = {"eagle_config": {k: cfg[k] for k in ("rope_theta", "rms_norm_eps", "rope_scaling",
                                               "max_position_embeddings", "draft_vocab_size")
                           if k in cfg}}
  return fields, {n: x[None] for n, x in params.items()}, vocab, meta
