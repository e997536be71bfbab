"""Medusa-1 heads (Cai et al. 2024) as an nnx module, and their init.

Head k (k = 0..K-1) reads the target's final-normed hidden state h_t (what the target's LM head
reads; Medusa applies its heads to the same tensor, the base model's last hidden state after its
final norm) and predicts token t + k + 2 (the target itself predicts t + 1, the pending token).
Each head is `num_layers` residual blocks x <- x + SiLU(x W + b) followed by an LM head. W starts
at zero (and b at zero here), so an untrained head is the target's LM head. The LM head is the
target's own, frozen and shared (no copy of the [V,E] matrix), scored either over the whole
vocabulary or over a subset `vocab` [Vs] of token ids (the matching rows of the target's head: on
a CPU the 49152 x 576 head of SmolLM2 is a fifth of the model's bytes, and K heads read it once
per step in one [B*K,E] x [E,V] matmul); published Medusa-1 heads may bring their own ("lm"
[K,V or Vs,E]).

Params: "w" [K,L,E,E], "b" [K,L,E], optionally "lm".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.drafters import layer as ly
from specjax.drafters.heads_file import Heads, HeadsConfig
from specjax.errors import check_int


def medusa_hidden(params, hidden: jax.Array) -> jax.Array:
  """The residual blocks of every head: hidden [...,E] -> [...,K,E]."""
  w, b = params["w"], params["b"]  # [K,L,E,E], [K,L,E]
  x = jnp.broadcast_to(hidden[..., None, :], hidden.shape[:-1] + (w.shape[0], w.shape[-1]))
  for l in range(w.shape[1]):
    y = jnp.einsum("...ke,kef->...kf", x, w[:, l]) + b[:, l]
    x = x + jax.nn.silu(y)
  return x


class MedusaHeads(nnx.Module):
  """The K heads over their arrays {"w", "b", ("lm")}."""

  raw_taps = False  # (it reads no taps: the target's final-normed hidden state)

  def __init__(self, heads_config, config, params: dict):
    del heads_config, config  # (their shapes are the arrays')
    self.w, self.b = nnx.Param(params["w"]), nnx.Param(params["b"])
    own = params.get("lm")  # published Medusa-1 heads' own LM heads
    self.lm = None if own is None else nnx.Param(own)

  def __call__(self, hidden):
    """hidden [...,E] -> every head's output [...,K,E] (what an LM head reads)."""
    return medusa_hidden({"w": self.w[...], "b": self.b[...]}, hidden)

  @property
  def own_vocab(self) -> bool:
    """Whether `logits` are over the heads' vocabulary (its own LM heads' rows)."""
    return self.lm is not None

  def logits(self, z, target_logits):
    """z [...,K,E] -> float32 logits [...,K,V or Vs]: each head's own LM head where it has one,
    else the target's (`target_logits`)."""
    if self.lm is None:
      return target_logits(z)
    return jnp.einsum("...ke,kve->...kv", z, self.lm[...]).astype(jnp.float32)


def init_medusa(target, *, num_heads: int | None = None, num_layers: int = 1, seed: int = 0,
                scale: float = 0.0, vocab=None) -> Heads:
  """Medusa heads for `target` (num_heads default 4): scale 0 (Medusa's init) makes every head
  the target's LM head; scale > 0 draws W ~ N(0, scale^2 / E) and b ~ N(0, scale^2) (tests)."""
  num_heads = 4 if num_heads is None else num_heads
  check_int("num_heads", num_heads, 1, 16)
  check_int("num_layers", num_layers, 1, 8)
  ly.check_scale(scale)
  c = target.config
  e = c.hidden_size
  ids = ly.check_vocab_ids(vocab, c.vocab_size)
  kw, kb = jax.random.split(jax.random.PRNGKey(seed))
  w = scale / np.sqrt(e) * jax.random.normal(kw, (num_heads, num_layers, e, e), jnp.float32)
  b = scale * jax.random.normal(kb, (num_heads, num_layers, e), jnp.float32)
  cfg = HeadsConfig("medusa", num_heads, num_layers, e, c.vocab_size, getattr(target, "name", ""),
                    0 if ids is None else int(ids.size))
  dtype = getattr(target, "dtype", jnp.float32)
  return Heads(cfg, {"w": w.astype(dtype), "b": b.astype(dtype)}, ids)
