"""MTP module training: per-depth cross-entropy on a frozen target (DeepSeek-V3's MTP objective).

Module k (specjax/drafters/mtp.py, kind "mtp") at position i reads RMSNorm(emb(x_{i+k+1})) and
RMSNorm(h^k_i) (h^0 = the target's feature f_i) and predicts x_{i+k+2} through the target's final
norm and LM head. Teacher forcing: every module reads the true tokens, and module k + 1 reads
module k's outputs, all causal over the window, exactly as decoding's catch-up does. The loss is
sum_k weight_k * CE_k (DeepSeek-V3 averages its modules with one lambda; a decaying per-depth
weight favours the first drafts, which every later one depends on). On the target's own text
(the self-distillation corpus) the labels are what the target wrote.

    loss_fn = make_loss(target, heads)                   # loss_fn(params, batch, rng, frozen)
    loss, metrics = loss_fn(heads.params, {"tokens": tok, "mask": mask}, rng,
                            frozen_arrays(target, heads))

metrics: loss_k and top1_k per depth (the held-out acceptance estimate of depth k), count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.drafters.heads_file import Heads
from specjax.drafters.kinds import drafter
from specjax.drafters.layer import module_arrays
from specjax.training.eagle import fit as _fit, run_head
from specjax.training.features import frozen_arrays, target_features, teacher_features

__all__ = ["make_loss", "frozen_arrays", "teacher_features", "fit", "DECAY"]

DECAY = 0.8


def make_loss(target, heads: Heads, *, weights=None):
  """loss_fn(params, batch, rng, frozen) -> (loss, metrics) for MTP modules on `target`.

  batch: {"tokens" [B,T], optional "mask" [B,T] (True: position t's next token counts), optional
  "feats" [B,T,E]}; weights: per-module loss weights (default DECAY^k). Module k's label at i is
  tokens[:, i + k + 2], counted where it is inside the window and mask[:, i + k + 1]; labels
  outside a vocabulary subset are skipped.
  """
  from flax import nnx

  cfg, graphdef = target.config, target.graphdef
  num = heads.config.num_heads
  w = [DECAY ** k for k in range(num)] if weights is None else [float(x) for x in weights]

  def loss_fn(params, batch, rng, frozen):
    del rng  # deterministic
    tokens = batch["tokens"]
    b, t = tokens.shape
    feats = batch.get("feats")
    if feats is None:
      feats = target_features(graphdef, frozen["target"], tokens)
    h = jax.lax.stop_gradient(feats)[:, :-1]  # h^0 at positions 0..T-2
    valid = jnp.ones((b, t), bool) if batch.get("mask") is None else batch["mask"]
    model = nnx.merge(graphdef, frozen["target"])
    table = frozen["target"]["embed"][...]
    vocab = frozen.get("vocab")
    if vocab is None:
      labels, in_vocab = tokens, jnp.ones_like(tokens, bool)
    else:
      match = tokens[..., None] == vocab
      labels, in_vocab = jnp.argmax(match, axis=-1), jnp.any(match, axis=-1)
    i = jnp.arange(t - 1)
    total, metrics, count = 0.0, {}, 0
    for k in range(num):
      j = jnp.minimum(i + k + 1, t - 1)  # the token module k reads at each position
      mod = drafter(heads.config, cfg, module_arrays(params, k))  # an MtpModule
      h = run_head(cfg, mod, table[tokens[:, j]], h)  # [B,T-1,E]
      logits = jnp.einsum("bte,ve->btv", model.final_norm(h), frozen["head"]).astype(jnp.float32)
      lab_i = jnp.minimum(i + k + 2, t - 1)
      ok = ((i + k + 2 < t)[None, :] & valid[:, j] & in_vocab[:, lab_i])  # [B,T-1]
      lab = labels[:, lab_i]
      lp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), lab[..., None], axis=-1)[..., 0]
      n = jnp.maximum(jnp.sum(ok), 1)
      ce = -jnp.sum(jnp.where(ok, lp, 0.0)) / n
      total = total + w[k] * ce
      metrics[f"loss_{k}"] = ce
      metrics[f"top1_{k}"] = jnp.sum(ok & (jnp.argmax(logits, -1) == lab)) / n
      count = jnp.sum(ok) if k == 0 else count
    metrics.update(loss=total, count=count)
    return total, metrics

  return loss_fn


def fit(target, heads: Heads, tokens, *, steps: int = 200, lr: float = 3e-3, seed: int = 0,
        **loss_kw):
  """A plain Adam loop on fixed windows (tests, quick runs). Returns (heads, losses per step)."""
  return _fit(target, heads, tokens, steps=steps, lr=lr, seed=seed, make=make_loss, **loss_kw)
