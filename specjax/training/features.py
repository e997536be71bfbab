"""The frozen target's features over whole windows, the one input every heads kind trains on.

    feats = target_features(target.graphdef, frozen["target"], tokens)      # [B,T,E], traceable
    feats = teacher_features(target, tokens)                                # [N,T,E] numpy, batched

The forward itself is `model.forward_sequence` (the same one a prefill runs); here it reads the
final-normed hidden states (the tensor the LM head reads: Medusa's heads, EAGLE's feature and
MTP's h^0) and, for fused EAGLE heads, the normalised outputs of chosen layers (taps), with the
logits computed at one position only. `frozen_arrays` is what a heads loss reads but never
trains: the target's params and the LM-head rows its heads score.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.model import forward_sequence, head_rows


def target_features(graphdef, params, tokens: jax.Array, taps: tuple = (),
                    raw_taps: bool = False) -> jax.Array:
  """tokens [B,T] (from position 0) -> the target's features [B,T,E] (final-normed hidden states;
  with taps [B,T,(n+1)E]: those layers' normalised outputs (raw_taps: as they are, EAGLE-3's), then
  the feature), one causal forward with no LM head; no gradients flow into the target."""
  from flax import nnx

  b, _ = tokens.shape
  model = nnx.merge(graphdef, params)
  _, hidden, _ = forward_sequence(model.cfg, model, tokens,
                                  dtype=jax.tree_util.tree_leaves(params)[0].dtype,
                                  logits_at=jnp.zeros((b, 1), jnp.int32), taps=tuple(taps),
                                  raw_taps=raw_taps)
  return jax.lax.stop_gradient(hidden)


@functools.partial(jax.jit, static_argnums=(0, 3))
def features_jit(graphdef, params, tokens, taps):
  """`target_features` compiled once per (target, window shape, taps)."""
  return target_features(graphdef, params, tokens, taps)


def teacher_features(target, tokens, batch_size: int = 8, taps: tuple = ()) -> np.ndarray:
  """tokens [N,T] -> features [N,T,E] (with taps [N,T,(n+1)E], see `target_features`; numpy,
  float32), computed `batch_size` windows at a time (the last batch padded, so one compiled
  forward serves every batch)."""
  tokens = np.asarray(tokens, np.int32)
  n, t = tokens.shape
  out = []
  for i in range(0, n, batch_size):
    x = tokens[i:i + batch_size]
    pad = batch_size - len(x)
    if pad:
      x = np.concatenate([x, np.zeros((pad, t), np.int32)])
    f = np.asarray(features_jit(target.graphdef, target.params, jnp.asarray(x), tuple(taps)),
                   np.float32)
    out.append(f[:batch_size - pad])
  width = (len(taps) + 1) * target.config.hidden_size
  return np.concatenate(out) if out else np.zeros((0, t, width), np.float32)


def frozen_arrays(target, heads) -> dict:
  """What a heads loss reads but does not train: the target's params (embedding, layers, final
  norm) and the LM-head rows the heads score ([V,E], or [Vs,E] for a vocabulary subset, whose
  ids [Vs] are then under "vocab")."""
  ids = (jnp.arange(target.config.vocab_size) if heads.vocab is None
         else jnp.asarray(heads.vocab))
  out = {"target": target.params, "head": head_rows(target.config, target.params, ids)}
  if heads.vocab is not None:
    out["vocab"] = ids
  return out
