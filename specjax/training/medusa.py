"""Medusa-1 heads: the training loss on a frozen target, and the teacher hidden states it reads.

Head k (k = 0..K-1) reads the target's final-normed hidden state h_t (the tensor the target's LM
head reads; Medusa's heads read the same one, HF's `outputs[0]` after the model's final norm)
and predicts token t + k + 2: the target's own head predicts t + 1, so head 0 is the first
token past it. The loss is cross-entropy per head, weighted 0.8^k (Medusa's decay), averaged
over the positions that have a label; the target stays frozen (only the heads' params get
gradients). Train on text the target wrote itself (self-distillation, Medusa-2's recipe) so the
heads learn the target's continuations rather than the corpus's.

    hidden = teacher_hidden(target, tokens)                    # [B,T,E], no gradients
    loss, metrics = medusa_loss(heads.params, heads.config, hidden, tokens, lm_head_matrix(target))
    loss_fn = make_loss(target, heads)                   # the shared trainer's loss_fn

`metrics` has the loss per head and top-1 / top-5 accuracy per head (the held-out table's
columns). The shared optax/orbax loop lives in specjax/training/trainer.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax import compile_options
from specjax.drafters.heads_file import HeadsConfig
from specjax.drafters.medusa import medusa_hidden
from specjax.model import head_rows
from specjax.training.features import features_jit, target_features

DECAY = 0.8


def lm_head_matrix(target, vocab=None) -> jax.Array:
  """The target's LM head as [V,E] rows (or the rows [Vs,E] of token ids `vocab`), frozen."""
  ids = jnp.arange(target.config.vocab_size) if vocab is None else jnp.asarray(vocab)
  return head_rows(target.config, target.params, ids)


def teacher_hidden(target, tokens) -> jax.Array:
  """tokens [B,T] int32 (whole windows from position 0) -> the target's final-normed hidden
  states [B,T,E] (one causal forward without the full-vocabulary logits: the same features EAGLE
  and MTP train on, training/features.py)."""
  return features_jit(target.graphdef, target.params, jnp.asarray(tokens, jnp.int32), ())


def medusa_loss(params, cfg: HeadsConfig, hidden: jax.Array, tokens: jax.Array, head: jax.Array,
                vocab: jax.Array | None = None, valid: jax.Array | None = None,
                decay: float = DECAY):
  """params {"w", "b"}; hidden [B,T,E] (teacher_hidden); tokens [B,T]; head [V,E] or [Vs,E]
  (lm_head_matrix; with `vocab` [Vs] the ids of its rows: labels outside it are skipped);
  valid [B,T] bool (False = padding). Returns (loss, metrics): per head k, cross-entropy of
  predicting tokens[:, t + k + 2] from hidden[:, t], weighted decay^k and summed over heads."""
  b, t, _ = hidden.shape
  k = cfg.num_heads
  valid = jnp.ones((b, t), bool) if valid is None else valid
  if vocab is None:
    labels, in_vocab = tokens, jnp.ones_like(tokens, bool)
  else:  # the position of each token in the (any order) subset, and whether it is there
    match = tokens[..., None] == vocab  # [B,T,Vs]
    labels, in_vocab = jnp.argmax(match, axis=-1), jnp.any(match, axis=-1)
  z = medusa_hidden(params, hidden)  # [B,T,K,E]
  logits = jnp.einsum("btke,ve->btkv", z, head).astype(jnp.float32)  # [B,T,K,V]
  logp = jax.nn.log_softmax(logits, axis=-1)
  sg = jax.lax.stop_gradient(logits)
  total = 0.0
  metrics = {}
  for i in range(k):
    s = i + 2  # head i at t predicts t + i + 2
    if s >= t:
      break
    lab = labels[:, s:]  # [B,T-s]
    ok = valid[:, :t - s] & valid[:, s:] & in_vocab[:, s:]
    lp = jnp.take_along_axis(logp[:, :t - s, i], lab[..., None], axis=-1)[..., 0]
    n = jnp.maximum(jnp.sum(ok), 1)
    ce = -jnp.sum(jnp.where(ok, lp, 0.0)) / n
    rank = label_rank(sg[:, :t - s, i], lab)  # [B,T-s]: top-1 is rank 0, top-5 rank < 5
    total = total + decay ** i * ce
    metrics[f"loss_{i}"] = ce
    metrics[f"top1_{i}"] = jnp.sum(ok & (rank == 0)) / n
    metrics[f"top5_{i}"] = jnp.sum(ok & (rank < 5)) / n
  metrics["loss"] = total
  return total, metrics


def make_loss(target, heads, *, decay: float = DECAY):
  """loss_fn(params, batch, rng, frozen) -> (loss, metrics) for Medusa heads on `target`, the
  shared trainer's signature (as training/eagle.py and mtp.py give it).

  batch: {"tokens" [B,T] int32, optional "valid" [B,T] bool (positions that are real text to
  learn from and to predict: training/heads.py `response_valid`), optional "feats" [B,T,E] (the
  target's final-normed hidden states; computed here when absent)}. frozen: training/features.py
  `frozen_arrays` (the target's params, the LM-head rows the heads score and their ids "vocab"). See
  `medusa_loss` for the loss and metrics.
  """
  graphdef, hcfg = target.graphdef, heads.config

  def loss_fn(params, batch, rng, frozen):
    del rng  # deterministic
    feats = batch.get("feats")
    if feats is None:
      feats = target_features(graphdef, frozen["target"], batch["tokens"])
    return medusa_loss(params, hcfg, feats, batch["tokens"], frozen["head"], frozen.get("vocab"),
                       batch.get("valid"), decay)

  return loss_fn


def label_rank(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """logits [...,V], labels [...] -> the label's rank [...] int32 in the order top_k_ids gives
  (larger first, the lower index first on ties): top-1 is rank 0, top-5 is rank < 5.

  Counting is two comparisons per entry. lax.top_k inside the training step (over the heads'
  [B,T,K,Vs] logits) had made a joint heads step several times slower on this CPU, though the
  same top_k alone is fast (measured: docs/performance.md)."""
  lab_logit = jnp.take_along_axis(logits, labels[..., None], axis=-1)
  before = (logits > lab_logit) | ((logits == lab_logit)
                                   & (jnp.arange(logits.shape[-1]) < labels[..., None]))
  return jnp.sum(before, axis=-1, dtype=jnp.int32)


def accuracy_table(metrics: dict, num_heads: int) -> np.ndarray:
  """[K,2] top-1 / top-5 accuracy per head from `medusa_loss` metrics (for tables and trees)."""
  return np.array([[float(metrics.get(f"top1_{i}", 0.0)), float(metrics.get(f"top5_{i}", 0.0))]
                   for i in range(num_heads)])


def fit(target, heads, tokens, *, steps: int = 200, lr: float = 1e-2, batch_size: int = 0,
        seed: int = 0):
  """A plain Adam loop on fixed token windows [N,T] (tests and quick experiments; real runs use
  the shared trainer). Returns (heads with trained params, losses per step)."""
  import dataclasses

  import optax

  tokens = jnp.asarray(tokens, jnp.int32)
  hidden = teacher_hidden(target, tokens)
  vocab = None if heads.vocab is None else jnp.asarray(heads.vocab)
  head = lm_head_matrix(target, vocab)
  opt = optax.adam(lr)
  params = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), heads.params)
  state = opt.init(params)

  @functools.partial(jax.jit, compiler_options=compile_options.options())
  def update(params, state, idx):
    def loss_fn(p):
      return medusa_loss(p, heads.config, hidden[idx], tokens[idx], head, vocab)[0]
    loss, g = jax.value_and_grad(loss_fn)(params)
    upd, state = opt.update(g, state, params)
    return optax.apply_updates(params, upd), state, loss

  n = tokens.shape[0]
  bs = batch_size or n
  rng = np.random.default_rng(seed)
  losses = []
  for _ in range(steps):
    idx = jnp.asarray(rng.choice(n, bs, replace=False) if bs < n else np.arange(n))
    params, state, loss = update(params, state, idx)
    losses.append(float(loss))
  params = jax.tree_util.tree_map(lambda x, y: x.astype(y.dtype), params, heads.params)
  return dataclasses.replace(heads, params=params), losses
