"""Medusa-2 (Cai et al. 2024): the backbone trained together with its Medusa heads.

Medusa-1's heads read a frozen backbone's hidden states; Medusa-2 also adapts the backbone (here
LoRA adapters on its layer matrices, specjax/lora.py) so that its hidden states learn to carry
the future tokens the heads predict, while a self-distillation term keeps the adapted model's own
next-token distribution close to the original's:

    loss = sum_k 0.8^k CE(head k)  +  kl_weight * KL(p_original || p_adapted)     (per position)

on the target's own responses (the self-distillation corpus). Medusa-2's recipe, as its paper
gives it: the heads are warmed up first (the adapters learn from step `warmup_heads` on), and the
backbone learns at a lower rate than the heads (`backbone_lr` x the heads' rate; trainer
`group_lr`).

The adapted model is a different model from the original: decoding with its heads is exact with
respect to the ADAPTED model (every method is lossless for the model it verifies with), not the
original. `closeness(original, adapted, tokens, valid)` measures how far it moved: the mean
per-token KL(original || adapted) over response positions and the fraction of greedy
continuations that stay identical.

    heads, adapters = train_medusa2(target, corpus, out_dir=..., export="medusa2.npz")
    model, heads = load_medusa2("medusa2.npz")      # the adapted target and its heads

Asset (one .npz, format 1): the heads as `save_heads` writes them (header, __vocab__, params),
plus the adapters under "__lora__.<name>.a" / ".b" (float16) and header fields "lora": {"rank",
"alpha", "sites"} and "kind" "medusa" with "medusa2": true.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax import lora
from specjax.errors import InputError, check_int
from specjax.model import forward_sequence
from specjax.training import medusa


def make_loss(target, heads, *, kl_weight: float = 1.0, scale: float = 2.0,
              decay: float = medusa.DECAY):
  """loss_fn(params {"heads", "lora"}, batch (tokens, valid, mask), rng, frozen) for the shared
  trainer: the adapted backbone runs once (its hidden states feed the heads, its logits the KL
  term) and the original once without gradients. scale: LoRA's alpha / rank."""
  hcfg = heads.config

  def loss_fn(params, batch, rng, frozen):
    del rng
    tokens, ok, _ = batch
    base = frozen["target"]
    dt = jax.tree_util.tree_leaves(base)[0].dtype
    orig_logits, _, _ = forward_sequence(target.config, target.module(base), tokens, dtype=dt)
    orig = jax.lax.stop_gradient(jax.nn.log_softmax(orig_logits.astype(jnp.float32), -1))
    adapted = lora.merge(base, params["lora"], scale)
    logits, hidden, _ = forward_sequence(target.config, target.module(adapted), tokens,
                                         dtype=dt)
    new = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    kl_pos = jnp.sum(jnp.exp(orig) * (orig - new), -1)  # [B,T]
    n = jnp.maximum(jnp.sum(ok), 1)
    kl = jnp.sum(jnp.where(ok, kl_pos, 0.0)) / n
    heads_loss, metrics = medusa.medusa_loss(params["heads"], hcfg, hidden, tokens,
                                             frozen["head"], frozen.get("vocab"), ok, decay)
    total = heads_loss + kl_weight * kl
    return total, dict(metrics, heads_loss=heads_loss, kl=kl, loss=total, count=n)

  return loss_fn


def check_args(*, kl_weight, rank, backbone_lr, warmup_heads, steps) -> None:
  """Medusa-2's own settings, checked before anything loads."""
  for name, v in (("kl_weight", kl_weight), ("backbone_lr", backbone_lr)):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v < 0:
      raise InputError(f"{name}={v!r} is invalid: must be a finite number >= 0")
  check_int("rank", rank, 1)
  check_int("warmup_heads", warmup_heads, 0, max(steps - 1, 0),
            f" (fewer than steps={steps}: the backbone must get some steps)")


def closeness(original, adapted, tokens, valid, *, greedy_tokens: int = 0,
              prompts=None) -> dict:
  """How close the adapted model stays to the original: "kl" the mean per-token
  KL(original || adapted) over positions where `valid` [N,T] is True in token windows [N,T]
  (teacher-forced on the original's own responses); with prompts and greedy_tokens > 0 also
  "greedy_identical", the fraction of prompts whose greedy continuation of that length is the same
  token for token."""
  from specjax.decode import generate
  from specjax.methods.autoregressive import Autoregressive

  tokens = jnp.asarray(tokens, jnp.int32)

  @jax.jit
  def kl_sum(p0, p1, toks, ok):
    a, _, _ = forward_sequence(original.config, original.module(p0), toks)
    b, _, _ = forward_sequence(adapted.config, adapted.module(p1), toks)
    la = jax.nn.log_softmax(a.astype(jnp.float32), -1)
    lb = jax.nn.log_softmax(b.astype(jnp.float32), -1)
    per = jnp.sum(jnp.exp(la) * (la - lb), -1)
    return jnp.sum(jnp.where(ok, per, 0.0)), jnp.sum(ok)

  total, count = 0.0, 0
  for i in range(len(tokens)):
    s, c = kl_sum(original.params, adapted.params, tokens[i:i + 1], jnp.asarray(valid[i:i + 1]))
    total, count = total + float(s), count + int(c)
  out = {"kl": total / max(count, 1), "positions": count}
  if prompts and greedy_tokens:
    a = generate(original, prompts, Autoregressive(), max_new_tokens=greedy_tokens,
                 stop_at_eos=False).tokens
    b = generate(adapted, prompts, Autoregressive(), max_new_tokens=greedy_tokens,
                 stop_at_eos=False).tokens
    out["greedy_identical"] = float(np.mean([x == y for x, y in zip(a, b)]))
    out["greedy_tokens"] = greedy_tokens
  return out


def save(heads, adapters: dict, path: str, *, rank: int, alpha: float, sites, meta=None) -> str:
  """The Medusa-2 asset: heads (save_heads' format) + the adapters, in one .npz."""
  from specjax.heads import save_heads

  return save_heads(heads, path, dict(meta or {}, medusa2=True,
                                      lora={"rank": rank, "alpha": alpha, "sites": list(sites)}),
                    extra={lora.LORA_PREFIX + k: np.asarray(v, np.float16)
                           for k, v in lora.flat(adapters).items()})


def load_medusa2(path: str, target=None):
  """(the adapted target, its Medusa heads) from a Medusa-2 asset; target: the original Model
  (default: load the model the asset names)."""
  from specjax.heads import load_heads
  from specjax.weights import load_model

  asset = lora.read_adapters(path)
  if target is None:
    target = load_model(asset[1].get("target") or "smollm2-135m")
  model = lora.adapted_model(path, target, asset=asset)
  return model, load_heads(path, model)
