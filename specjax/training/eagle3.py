"""EAGLE-3 head training: the loss on a frozen target, for heads of kind "eagle3"
(specjax/drafters/eagle3.py).

The head reads, at position i, the embedding of token x_{i+1} and h_i = fc(cat of the target's raw
hidden states entering layers 2, L // 2 and L - 3 at i), and scores token x_{i+2} over its draft
vocabulary through its own norm and LM head. EAGLE-3's recipe (Li et al. 2025; no feature
regression): the cross-entropy of the head's draft distribution against the target's next-token
distribution restricted to the draft vocabulary, with the training-time test: the head also drafts
d = 2..unroll steps ahead on its own layer outputs (fed back without the fc, as at inference;
training/eagle.py `run_unrolled`), pass d weighted 0.8^(d-1). The target, its embedding and the
LM-head rows of the target's distribution stay frozen; the head's own LM head is trained.

    loss_fn = make_loss(target, heads, unroll=3)       # loss_fn(params, batch, rng, frozen)
    frozen = frozen_arrays(target, heads)              # target params, its LM-head rows [Vd,E]
    loss, metrics = loss_fn(heads.params, {"tokens": tok, "mask": mask}, rng, frozen)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.drafters.heads_file import Heads
from specjax.drafters.kinds import drafter
from specjax.drafters.layer import module_arrays
from specjax.errors import InputError, check_int
from specjax.training.eagle import UNROLL_DECAY, pad_for_unroll, run_unrolled
from specjax.training.features import target_features


def make_loss(target, heads: Heads, *, unroll: int = 1, unroll_decay: float = UNROLL_DECAY):
  """loss_fn(params, batch, rng, frozen) -> (loss, metrics) for an EAGLE-3 head on `target`.

  batch: {"tokens" [B,T] int32 (windows from position 0), optional "mask" [B,T] bool (True:
  position t's next token counts)}. Entry i (i = 0..T-2) of pass d (d = 0..unroll-1) scores
  x_{i+2+d}; it counts where mask[:, i + 1 + d]. frozen: `frozen_arrays(target, heads)` (its
  "head" [Vd,E]: the target's LM-head rows of the draft vocabulary). metrics: loss, ploss, top1
  (the head's argmax is the target's among the draft vocabulary), their _d for d >= 2, count."""
  if not isinstance(heads, Heads) or heads.config.kind != "eagle3":
    raise InputError(f"heads={heads!r}: EAGLE-3 training needs heads of kind 'eagle3'")
  check_int("unroll", unroll, 1)
  if not unroll_decay > 0:
    raise InputError(f"unroll_decay={unroll_decay!r} must be > 0")
  cfg, graphdef = target.config, target.graphdef
  taps = tuple(heads.config.taps)
  e = cfg.hidden_size

  def loss_fn(params, batch, rng, frozen):
    del rng  # no feature noise in EAGLE-3's recipe
    tokens = batch["tokens"]
    b, t = tokens.shape
    feats = target_features(graphdef, frozen["target"], tokens, taps, raw_taps=True)  # [B,T,4E]
    valid = jnp.ones((b, t), bool) if batch.get("mask") is None else batch["mask"]
    tokens, feats, valid = pad_for_unroll(tokens, feats, valid, unroll)
    mod = drafter(heads.config, cfg, module_arrays(params, 0))  # an Eagle3Head
    embed = frozen["target"]["embed"][...]
    embs = [embed[tokens[:, 1 + d:t + d]] for d in range(unroll)]  # [B,T-1,E] each
    preds = run_unrolled(cfg, mod, embs, mod.fuse(feats[:, :t - 1]))
    # The target's next-token distribution over the draft vocabulary, at every position.
    p_all = jnp.einsum("bte,ve->btv", feats[:, 1:, -e:], frozen["head"]).astype(jnp.float32)
    p_prob = jax.nn.softmax(p_all, axis=-1)  # [B,T-1+extra,Vd]
    p_top = jnp.argmax(p_all, -1)
    loss, wsum, metrics = 0.0, 0.0, {}
    for d, pred in enumerate(preds):
      ok = valid[:, 1 + d:t + d]
      n = jnp.maximum(jnp.sum(ok), 1)
      q = mod.logits(pred)  # [B,T-1,Vd]
      ce = -jnp.sum(p_prob[:, d:d + t - 1] * jax.nn.log_softmax(q, axis=-1), axis=-1)
      ploss = jnp.sum(jnp.where(ok, ce, 0.0)) / n
      top1 = jnp.sum(ok & (jnp.argmax(q, -1) == p_top[:, d:d + t - 1])) / n
      w = unroll_decay ** d
      loss, wsum = loss + w * ploss, wsum + w
      sfx = "" if d == 0 else f"_{d + 1}"
      metrics.update({f"ploss{sfx}": ploss, f"top1{sfx}": top1})
    loss = loss / wsum
    metrics.update(loss=loss, count=jnp.sum(valid[:, 1:t]))
    return loss, metrics

  return loss_fn
