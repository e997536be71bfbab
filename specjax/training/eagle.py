"""EAGLE head training: the loss on a frozen target, and the teacher features it reads.

The head (specjax/drafters/eagle.py, kind "eagle") reads, at position i, the embedding of token
x_{i+1} and the target's feature f_i (its final-normed last hidden state) and predicts f_{i+1}.
EAGLE's recipe (Li et al. 2024; its released trainer): regression of the next feature with
smooth-L1, plus 0.1 x the cross-entropy of the head's next-token distribution (the target's LM head
on the predicted feature) against the target's own (the LM head on the true feature), with uniform
noise on the input features (their trainer: U(-0.1, 0.1) at its reference length) so the head learns
to draft from its own slightly wrong features. The target, its embedding and LM head stay frozen.

    loss_fn = make_loss(target, heads)                   # loss_fn(params, batch, rng, frozen)
    frozen = frozen_arrays(target, heads)                # the target's params (+ LM-head rows)
    loss, metrics = loss_fn(heads.params, {"tokens": tok, "mask": mask}, rng, frozen)

`batch["tokens"]` [B,T] are whole windows from position 0 (corpus.load(dir).windows(T) gives
them with `mask` [B,T]: True where the next token is a response token); the target's features
are computed on the fly inside the loss (or passed as batch["feats"] [B,T,E], see
training/features.py `teacher_features`). The signature is the shared trainer's (specjax/training/trainer.py):
loss_fn(params, batch, rng, frozen) -> (loss, metrics).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from specjax import cache as kv
from specjax import compile_options
from specjax.drafters.heads_file import Heads
from specjax.drafters.kinds import drafter
from specjax.drafters.layer import module_arrays
from specjax.errors import InputError, check_int
from specjax.training.features import (frozen_arrays, target_features,  # noqa: F401 (re-exported)
                                       teacher_features)

CE_WEIGHT = 0.1
NOISE = 0.1
UNROLL_DECAY = 0.8  # training-time test: pass d weighs 0.8^(d-1) (SpecForge / EAGLE-3 use 0.8^i)


def _smooth_l1(d: jax.Array) -> jax.Array:
  a = jnp.abs(d)
  return jnp.where(a < 1.0, 0.5 * d * d, a - 0.5)


def run_head(config, mod, emb: jax.Array, feat: jax.Array) -> jax.Array:
  """A module (specjax.drafters.kinds.drafter) over whole windows: emb, feat [B,T,E] at positions
  0..T-1, causal -> [B,T,E]."""
  return run_unrolled(config, mod, [emb], feat)[0]


def unroll_masks(t: int, steps: int, window: int = 0) -> list[jax.Array]:
  """The attention masks [T, steps*T] of each pass of `run_unrolled` over the cache slots
  (pass d writes slots [d*T, (d+1)*T)). Pass 0's query i sees pass 0's entries j <= i (the
  prefix, built from true features); pass d's query i sees those and, of every later pass, only
  its own column i: entry i of pass e is the depth-e draft that hangs off prefix position i,
  which is exactly what a depth-d draft attends at inference. window > 0 (sliding-window
  attention): pass d's query sits at position i + d, so it sees prefix j > i + d - window."""
  i = jnp.arange(t)
  diag = i[:, None] == i[None, :]
  none = jnp.zeros((t, t), bool)
  out = []
  for d in range(steps):
    prefix = i[:, None] >= i[None, :]
    if window:
      prefix &= i[None, :] > i[:, None] + d - window
    out.append(jnp.concatenate([prefix] + [diag] * d + [none] * (steps - 1 - d), axis=1))
  return out


def run_unrolled(config, mod, embs: list, feat: jax.Array) -> list[jax.Array]:
  """Training-time test: the module `mod` (specjax.drafters.kinds.drafter) drafting len(embs)
  steps ahead from every position at once.

  embs: [B,T,E] per pass (pass d at index i reads the embedding of token x_{i+1+d}); feat [B,T,E]
  the input features of pass 0 (the target's, f_i). Pass d >= 1 reads pass d-1's outputs (its
  own predicted features) at positions i + d, and attends as at inference (`unroll_masks`).
  Returns each pass's outputs [B,T,E]: pass d's entry i predicts f_{i+1+d}."""
  b, t, _ = feat.shape
  steps = len(embs)
  cache = kv.init(1, b, steps * t, config.num_kv_heads, config.head_dim, embs[0].dtype)
  layer = cache.layers[0]
  masks = unroll_masks(t, steps, config.sliding_window)
  outs, x = [], feat
  for d in range(steps):
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + d, (b, t))
    start = jnp.full((b,), d * t, jnp.int32)
    mask = jnp.broadcast_to(masks[d], (b, t, steps * t))
    x, layer = mod(embs[d], x, pos, layer, start, mask)
    outs.append(x)
  return outs


def _batch_features(batch: dict, graphdef, frozen: dict, taps: tuple, e: int) -> jax.Array:
  """The batch's precomputed features when they are the ones this head reads (with taps: "full"
  [B,T,(n+1)E], else "feats" [B,T,E]), otherwise the target's, computed here; never trained."""
  feats = batch.get("full") if taps else None
  if feats is None:
    feats = batch.get("feats")
  if feats is None or feats.shape[-1] != (len(taps) + 1) * e:
    feats = target_features(graphdef, frozen["target"], batch["tokens"], taps)
  return jax.lax.stop_gradient(feats)


def _pass_loss(pred, tgt, ok, head, p_prob, p_top):
  """One drafting pass: pred, tgt [B,T-1,E] (predicted and true next features), ok [B,T-1] (the
  entries that count), head [V,E], the target's next-token p_prob [B,T-1,V] and argmax p_top
  [B,T-1] -> (vloss: smooth-L1 averaged over E, ploss: CE(p_target, q_head), top1: agreement)."""
  n = jnp.maximum(jnp.sum(ok), 1)
  vloss = jnp.sum(jnp.where(ok, jnp.mean(_smooth_l1(pred - tgt), axis=-1), 0.0)) / n
  q_logits = jnp.einsum("bte,ve->btv", pred, head).astype(jnp.float32)  # [B,T-1,V]
  ce = -jnp.sum(p_prob * jax.nn.log_softmax(q_logits, axis=-1), axis=-1)
  ploss = jnp.sum(jnp.where(ok, ce, 0.0)) / n
  top1 = jnp.sum(ok & (jnp.argmax(q_logits, -1) == p_top)) / n
  return vloss, ploss, top1


def pad_for_unroll(tokens, feats, valid, unroll: int):
  """tokens [B,T], feats [B,T,F], valid [B,T] padded at the far end by unroll - 1 positions, so
  every pass of the training-time test has T - 1 entries (the padding is never valid)."""
  extra = unroll - 1
  if not extra:
    return tokens, feats, valid
  b = tokens.shape[0]
  return (jnp.concatenate([tokens, jnp.zeros((b, extra), tokens.dtype)], axis=1),
          jnp.concatenate([feats, jnp.zeros((b, extra, feats.shape[-1]), feats.dtype)], 1),
          jnp.concatenate([valid, jnp.zeros((b, extra), bool)], axis=1))


def make_loss(target, heads: Heads, *, noise: float = NOISE, ce_weight: float = CE_WEIGHT,
              unroll: int = 1, unroll_decay: float = UNROLL_DECAY):
  """loss_fn(params, batch, rng, frozen) -> (loss, metrics) for EAGLE heads on `target`.

  batch: {"tokens" [B,T] int32, optional "mask" [B,T] bool (True: position t's next token counts),
  optional "feats" [B,T,E] (heads with taps: [B,T,(n+1)E] as `target_features` gives them, or
  those under "full" beside the plain "feats")}. Entry i (i = 0..T-2) reads (emb(x_{i+1}),
  f_i + U(-noise, noise)) and predicts f_{i+1} (a head with taps reads the fused feature g_i,
  the head's `fuse`, trained with the head, in place of f_i; the targets stay f); it counts
  where mask[:, i + 1] (the token it scores, x_{i+2}, is one to learn).
  loss = smooth-L1(f^, f) averaged over E + ce_weight * CE(p_target, q_head).
  metrics: vloss, ploss, top1 (the head's argmax is the target's), count.

  unroll > 1 (training-time test, as EAGLE-3 and HASS train): the head also drafts d = 2..unroll
  steps ahead on its own predicted features (`run_unrolled`): pass d's entry i reads
  (emb(x_{i+d}), its pass d-1 output) and predicts f_{i+d}, attending the true prefix and its own
  earlier drafts only, as at inference. Each pass's loss is weighted unroll_decay^(d-1) and the
  total divided by the weights' sum (so one pass or several keep one scale). metrics add
  top1_d / ploss_d for d >= 2: held-out top1_d estimates the acceptance at depth d given the
  draft so far was right (tokens are teacher-forced).
  """
  check_int("unroll", unroll, 1)
  if not unroll_decay > 0:
    raise InputError(f"unroll_decay={unroll_decay!r} must be > 0")
  cfg, graphdef = target.config, target.graphdef
  taps = tuple(heads.config.taps)

  def loss_fn(params, batch, rng, frozen):
    tokens = batch["tokens"]
    b, t = tokens.shape
    e = cfg.hidden_size
    feats = _batch_features(batch, graphdef, frozen, taps, e)  # [B,T,(n+1)E]: taps, then f
    valid = jnp.ones((b, t), bool) if batch.get("mask") is None else batch["mask"]
    tokens, feats, valid = pad_for_unroll(tokens, feats, valid, unroll)
    embed = frozen["target"]["embed"][...]
    embs = [embed[tokens[:, 1 + d:t + d]] for d in range(unroll)]  # [B,T-1,E] each
    mod = drafter(heads.config, cfg, module_arrays(params, 0))
    inp = mod.fuse(feats[:, :t - 1])  # g_i (f_i for a head without taps)
    feats = feats[..., -e:]  # f: the targets
    if noise:
      inp = inp + jax.random.uniform(rng, inp.shape, inp.dtype, -noise, noise)
    preds = run_unrolled(cfg, mod, embs, inp)  # pass d: f^_{i+1+d}
    head = frozen["head"]
    p_all = jnp.einsum("bte,ve->btv", feats[:, 1:], head).astype(jnp.float32)  # [B,T-1+extra,V]
    p_prob = jax.nn.softmax(p_all, axis=-1)
    p_top = jnp.argmax(p_all, -1)
    loss, wsum, metrics = 0.0, 0.0, {}
    for d, pred in enumerate(preds):
      vloss, ploss, top1 = _pass_loss(pred, feats[:, 1 + d:t + d], valid[:, 1 + d:t + d], head,
                                      p_prob[:, d:d + t - 1], p_top[:, d:d + t - 1])
      w = unroll_decay ** d
      loss, wsum = loss + w * (vloss + ce_weight * ploss), wsum + w
      sfx = "" if d == 0 else f"_{d + 1}"
      metrics.update({f"vloss{sfx}": vloss, f"ploss{sfx}": ploss, f"top1{sfx}": top1})
    loss = loss / wsum
    metrics.update(loss=loss, count=jnp.sum(valid[:, 1:t]))
    return loss, metrics

  return loss_fn


def fit(target, heads: Heads, tokens, *, steps: int = 200, lr: float = 3e-3, seed: int = 0,
        make=make_loss, **loss_kw):
  """A plain Adam loop on fixed windows [N,T] with precomputed features (tests, quick runs; real
  runs use the shared trainer). Returns (heads with trained params, losses per step)."""
  import optax

  tokens = jnp.asarray(tokens, jnp.int32)
  batch = {"tokens": tokens,
           "feats": jnp.asarray(teacher_features(target, tokens, taps=heads.config.taps))}
  loss_fn = make(target, heads, **loss_kw)
  frozen = frozen_arrays(target, heads)
  opt = optax.adam(lr)
  params = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), heads.params)
  state = opt.init(params)

  @functools.partial(jax.jit, compiler_options=compile_options.options())
  def update(params, state, frozen, rng):
    (loss, _), g = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, rng, frozen)
    upd, state = opt.update(g, state, params)
    return optax.apply_updates(params, upd), state, loss

  losses = []
  key = jax.random.PRNGKey(seed)
  for s in range(steps):
    params, state, loss = update(params, state, frozen, jax.random.fold_in(key, s))
    losses.append(float(loss))
  params = jax.tree_util.tree_map(lambda x, y: x.astype(y.dtype), params, heads.params)
  return dataclasses.replace(heads, params=params), losses
