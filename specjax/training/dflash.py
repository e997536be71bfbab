"""DFlash drafter training: block-wise cross-entropy at random anchors on a frozen target.

As the paper trains its drafter (Chen, Liang, Liu 2026): each window gets A random anchor
positions a (where the next token is the target's own text); the block at a is x_a followed by
bs - 1 mask tokens, sees the context features of positions < a and the whole block (the same
mask the decoding step uses, specjax/drafters/dflash.py `anchored_hidden`), and offset j >= 1 is
scored against x_{a+j}, the token the target wrote there (the self-distillation corpus). All A
blocks of a window run in one drafter forward over the window's context, and the target runs
once per batch with the drafter's taps (the raw residual stream after its target layers).
Offset j's cross-entropy weighs exp(-(j - 1) / gamma), as the paper weighs it: an early offset's
miss ends the accepted prefix, so the early offsets matter most (`default_decay`: the paper's
gamma for the block size; 0 weighs every offset alike).

    loss_fn = make_loss(target, heads, decay=None)   # loss_fn(params, batch, rng, frozen)

metrics: loss (weighted), ce_k the mean cross-entropy at offset k + 1, top1 (every offset), top1_k
per offset k + 1 given offsets 1 .. k were all right
(the chain's per-position acceptance, which methods/defaults.py sizes the block from), top5_k
the same for the label among offset k + 1's top five (a candidate tree's ranks), count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.drafters.dflash import anchored_hidden, drafter
from specjax.training.features import target_features
from specjax.training.medusa import label_rank


def default_decay(block_size: int) -> float:
  """The paper's loss decay gamma for a block size: 4 at 8, 5 at 10, 7 at 16 (Chen, Liang, Liu
  2026), linear through those values between and beyond them (block_size / 2 up to 10)."""
  return block_size / 2 if block_size <= 10 else 5.0 + (block_size - 10) / 3


def resolved_decay(block_size: int, decay: float | None) -> float:
  """The loss decay gamma a run uses: `decay`, or the paper's for the block size when None."""
  return default_decay(block_size) if decay is None else float(decay)


def offset_weights(block_size: int, decay: float) -> jnp.ndarray:
  """[block_size - 1] float32 weights of offsets 1 .. block_size - 1: exp(-(j - 1) / decay), or
  all one for decay 0."""
  j = jnp.arange(block_size - 1, dtype=jnp.float32)
  return jnp.exp(-j / decay) if decay > 0 else jnp.ones_like(j)


def anchors_per_window(seq_len: int, block_size: int) -> int:
  """A: blocks per window, about one per block_size positions (at least one)."""
  return max(1, seq_len // block_size)


def sample_anchors(rng, mask, num: int):
  """num anchors per row, drawn without replacement among positions a <= T - 2 whose next token
  counts (mask [B,T]). Returns (anchors [B,A] int32, ok [B,A]: False where a row had fewer)."""
  b, t = mask.shape
  allowed = mask & (jnp.arange(t) <= t - 2)[None, :]
  score = jnp.where(allowed, jax.random.gumbel(rng, (b, t)), -jnp.inf)
  top, idx = jax.lax.top_k(score, num)
  return idx.astype(jnp.int32), jnp.isfinite(top)


def make_loss(target, heads, decay: float | None = None, anchors: int = 0):
  """loss_fn(params, batch, rng, frozen) -> (loss, metrics) for a DFlash drafter on `target`.

  decay: the offsets' loss decay gamma (None: `default_decay` of the block size; 0: uniform).
  anchors: blocks per window (0: `anchors_per_window`, about one per block length). More anchors
  cost LM-head rows, not target forwards (the target runs once per window whatever the count).
  batch: {"tokens" [B,T], "mask" [B,T] (True where the next token is the target's text)}.
  frozen: training/features.frozen_arrays (the target's params, its LM head's rows)."""
  c = heads.config
  graphdef = target.graphdef
  bs, g = c.block_size, c.block_size - 1
  n_feats = len(c.target_layer_ids) * c.hidden_size
  w = offset_weights(bs, resolved_decay(bs, decay))

  def loss_fn(params, batch, rng, frozen):
    tokens, mask = batch["tokens"], batch["mask"]
    b, t = tokens.shape
    feats = target_features(graphdef, frozen["target"], tokens, c.taps, raw_taps=True)
    starts, ok = sample_anchors(rng, mask, min(anchors, t - 1) or anchors_per_window(t, bs))
    h = anchored_hidden(drafter(c, params), frozen["target"]["embed"][...], tokens,
                        feats[..., :n_feats], starts, bs, c.mask_token_id)  # [B,A,bs,E]
    logits = jnp.einsum("bage,ve->bagv", h[:, :, 1:], frozen["head"]).astype(jnp.float32)
    at = starts[:, :, None] + jnp.arange(1, bs)[None, None, :]  # [B,A,G] label positions
    inside = at < t
    at = jnp.minimum(at, t - 1)
    labels = jnp.take_along_axis(tokens, at.reshape(b, -1), axis=1).reshape(at.shape)
    counted = jnp.take_along_axis(mask, (at - 1).reshape(b, -1), axis=1).reshape(at.shape)
    valid = ok[:, :, None] & inside & counted  # [B,A,G]
    lp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), labels[..., None], -1)[..., 0]
    n = jnp.maximum(jnp.sum(valid), 1)
    weight = jnp.where(valid, w, 0.0)
    loss = -jnp.sum(weight * lp) / jnp.maximum(jnp.sum(weight), 1e-6)
    rank = label_rank(logits, labels)  # [B,A,G]: 0 where the label is the argmax
    right, in5 = (rank == 0) & valid, (rank < 5) & valid
    metrics = {"loss": loss, "top1": jnp.sum(right) / n, "count": jnp.sum(valid)}
    prefix = jnp.cumprod(right | ~valid, axis=-1).astype(bool)  # offsets 1 .. k all right
    reached = valid[:, :, 0]
    ce = jnp.sum(jnp.where(valid, -lp, 0.0), axis=(0, 1)) / jnp.maximum(
        jnp.sum(valid, axis=(0, 1)), 1)  # [G] mean cross-entropy per offset
    for k in range(g):
      metrics[f"ce_{k}"] = ce[k]
      hit = prefix[:, :, k] & valid[:, :, k]
      metrics[f"top1_{k}"] = jnp.sum(hit & reached) / jnp.maximum(jnp.sum(reached), 1)
      metrics[f"top5_{k}"] = jnp.sum(in5[:, :, k] & reached) / jnp.maximum(jnp.sum(reached), 1)
      if k + 1 < g:
        reached = hit & valid[:, :, k + 1]
    return loss, metrics

  return loss_fn
