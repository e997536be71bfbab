"""A parallel draft model (PARD, An et al. 2025): a draft taught to fill mask tokens in one forward.

The draft reads [.., x_a, m, .., m] (x_a the last real token, m the mask token at positions a + 1
.. a + k - 1): its output at x_a predicts x_{a+1} as any draft's does, and its output at the j-th
mask predicts x_{a+j+1}, so one forward drafts k tokens (methods/pard.py). It stays a causal
language model of the target's tokenizer; only its inputs gain the mask token.

Training, on the self-distillation corpus like `train draft` (training/draft.py): each window of
T tokens gets A random anchors a among its labelled positions, and k - 1 masks per anchor are
appended after the window, all in one forward of T + A (k - 1) tokens. A real token attends the
real tokens up to itself (the plain draft's loss, so offset 1 keeps what the draft knew); the
j-th mask of anchor a sits at position a + j and attends the real tokens up to a and its own
block's masks up to itself, the mask decoding uses (kv.causal_mask over [x_a, m, .., m]). Every
real position and every mask is scored by cross-entropy against the corpus's next token, over
the draft's vocabulary subset, each with weight one.

Held-out metrics, per anchor: top1_k, offset k + 1's agreement with the target's greedy token
given offsets 1 .. k agreed (offset 1 is the real token's output at a), the per-position
acceptance a chain drafts with (methods/defaults.py sizes gamma from it); top1, the real
positions' agreement, which `train draft` reports too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax import cache as kv
from specjax.model import head_rows, subset_index
from specjax.shipped import with_params


def blocks_layout(tokens, anchors, block_size: int, mask_token: int):
  """The extended window: tokens [B,T] and anchors [B,A] -> (tokens [B,T'], positions [B,T'],
  mask [B,T',T'] bool), T' = T + A (block_size - 1): the window, then each anchor's masks."""
  b, t = tokens.shape
  a, g = anchors.shape[1], block_size - 1
  j = jnp.arange(1, block_size, dtype=jnp.int32)
  mpos = (anchors[:, :, None] + j[None, None, :]).reshape(b, a * g)  # [B,AG]
  ext = jnp.concatenate([tokens, jnp.full((b, a * g), mask_token, tokens.dtype)], axis=1)
  pos = jnp.concatenate([jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), mpos], axis=1)
  real = jnp.arange(t)
  causal = real[:, None] >= real[None, :]  # [T,T]
  owner = jnp.repeat(jnp.arange(a), g)  # [AG] the anchor each mask belongs to
  step = jnp.tile(jnp.arange(g), a)  # [AG] its index in the block
  blockwise = (owner[:, None] == owner[None, :]) & (step[:, None] >= step[None, :])  # [AG,AG]
  sees_real = real[None, None, :] <= jnp.repeat(anchors, g, axis=1)[:, :, None]  # [B,AG,T]
  top = jnp.concatenate([jnp.broadcast_to(causal, (b, t, t)),
                         jnp.zeros((b, t, a * g), bool)], axis=2)
  bottom = jnp.concatenate([sees_real, jnp.broadcast_to(blockwise, (b, a * g, a * g))], axis=2)
  return ext, pos, jnp.concatenate([top, bottom], axis=1)


def block_labels(labels, anchors, block_size: int):
  """labels [B,T] (the next token after each position, -1: none) -> [B,A,k] the labels of each
  anchor's offsets 1 .. k: offset j + 1 is the label at position a + j (-1 past the window)."""
  t = labels.shape[1]
  at = anchors[:, :, None] + jnp.arange(block_size)[None, None, :]
  got = jnp.take_along_axis(labels, jnp.minimum(at, t - 1).reshape(labels.shape[0], -1), axis=1)
  return jnp.where(at < t, got.reshape(at.shape), -1)


def pard_loss(draft, own: dict, vocab, tokens, labels, anchors, block_size: int, mask_token: int,
              params=None, greedy=None):
  """The mean cross-entropy of the draft's subset logits at every real position and every mask,
  against labels [B,T] (the corpus's next tokens, -1: none; labels outside the subset skipped).
  anchors [B,A] int32 (positions whose label is set). greedy [B,T]: the target's greedy next
  tokens, which the per-offset metrics are measured against (default: labels).
  Returns (loss, metrics: top1 of the real positions (against greedy), top1_k per offset given the earlier ones
  right, coverage, count)."""
  params = with_params(draft, own, params)
  cfg = draft.config
  b, t = tokens.shape
  a, g = anchors.shape[1], block_size - 1
  ext, pos, mask = blocks_layout(tokens, anchors, block_size, mask_token)
  cache = kv.init(cfg.num_layers, b, ext.shape[1], cfg.num_kv_heads, cfg.head_dim, draft.dtype)
  _, hidden, _ = draft.module(params)(ext, pos, cache, mask, empty_cache=True,
                                      logits_at=jnp.zeros((b, 1), jnp.int32))
  logits = (hidden @ head_rows(cfg, params, vocab).T).astype(jnp.float32)  # [B,T',Vs]
  blocks = block_labels(labels, anchors, block_size)  # [B,A,k]
  ext_labels = jnp.concatenate([labels, blocks[:, :, 1:].reshape(b, a * g)], axis=1)

  idx, m = subset_index(vocab, ext_labels)
  lp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), idx[..., None], axis=-1)[..., 0]
  count = jnp.maximum(jnp.sum(m), 1)
  loss = -jnp.sum(jnp.where(m, lp, 0.0)) / count
  best = jnp.argmax(logits, axis=-1)  # [B,T']
  # Per anchor, offsets 1 .. k: the real output at a, then the block's masks.
  at_anchor = jnp.take_along_axis(best[:, :t], anchors, axis=1)[:, :, None]  # [B,A,1]
  guesses = jnp.concatenate([at_anchor, best[:, t:].reshape(b, a, g)], axis=2)  # [B,A,k]
  want = blocks if greedy is None else block_labels(greedy, anchors, block_size)
  widx, wm = subset_index(vocab, want)
  right = (guesses == widx) & wm
  gidx, real = (idx[:, :t], m[:, :t]) if greedy is None else subset_index(vocab, greedy)
  metrics = {"loss": loss, "count": count.astype(jnp.float32),
             "top1": jnp.sum((best[:, :t] == gidx) & real) / jnp.maximum(jnp.sum(real), 1),
             "coverage": jnp.sum(m) / jnp.maximum(jnp.sum(ext_labels >= 0), 1)}
  reached = want[:, :, 0] >= 0  # [B,A]
  for k in range(block_size):
    hit = reached & right[:, :, k]
    metrics[f"top1_{k}"] = jnp.sum(hit) / jnp.maximum(jnp.sum(reached), 1)
    if k + 1 < block_size:
      reached = hit & (want[:, :, k + 1] >= 0)
  return loss, metrics
