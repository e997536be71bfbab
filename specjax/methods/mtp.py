"""MTP: multi-token-prediction modules (DeepSeek-V3) draft a chain; the target verifies it at once.

Gloeckle et al. 2024; DeepSeek-V3 (2024), section 2.2. Module k (k = 0..K-1,
specjax/drafters/mtp.py, kind "mtp") reads at position i RMSNorm(emb(x_{i+k+1})) and RMSNorm(h^k_i),
where h^0 is the target's feature (its final-normed hidden state) and h^k the previous module's
output, through a linear 2E -> E and one decoder layer of the target's type; the target's final norm
and LM head turn h^{k+1}_i into the distribution of x_{i+k+2}. Each module attends over its own
sequence (its own static KV cache), as in training. One step, all rows at once, all shapes static:

  catch up + draft   every module re-reads the last W = 2K positions [L - W, L) (L: the committed
            target length, x_L pending), module k reading token x_{i+k+1}; where that token is not
            committed yet (i + k + 1 > L) it reads the chain drafted this round, d_{i+k+1-L}.
            Module k's output at L - 1 drafts d_{k+1} (its argmax), which module k + 1 reads.
            W = 2K keeps every cache entry below L - W teacher-forced: an entry at i is exact once
            i + k + 1 <= L, and L grows by at most K + 1 per round.
  verify    the shared chain step (`verify.chain`): the target scores [x_L, d_1 .. d_K] causally
            (greedy, or exact rejection sampling with the deterministic draft q = one-hot(d):
            exact) and keeps the accepted prefix.
  update    the target's hidden states there are the true features of the new positions and
            enter the rolling buffer.

Statistics: the accepted-depth histogram and per depth k the acceptance rate given depth k - 1
was accepted (DeepSeek-V3 reports 85-90% for its second token).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax import cache as kv
from specjax import sampling
from specjax.decode import DRAFT, DecodeState, Method, Program, phase
from specjax.drafters.kinds import check_fits
from specjax.errors import InputError, check_int
from specjax.methods import sizing, verify
from specjax.methods.features import (catch_up, check_heads, feature_buffer, head_arrays,
                                      modules, mtp_logits, prompt_pass, shift_in, to_tokens)

RULES = ("exact",)


@dataclasses.dataclass(frozen=True)
class MTP(verify.ChainSizes, Method):
  """MTP decoding with `heads` (sj.init_heads(target, "mtp", num_heads=K) / sj.load_heads(...)).

  gamma: how many modules draft (default all K; the chain's length); acceptance: "exact" (greedy
  at temperature 0, exact rejection sampling otherwise).
  """
  heads: Any = dataclasses.field(default=None, compare=False, repr=False)
  gamma: int | None = None
  acceptance: str = "exact"
  key: tuple = dataclasses.field(default=(), init=False, repr=False)
  left_out: tuple = dataclasses.field(default=(), init=False, compare=False, repr=False)

  name = "mtp"

  def __post_init__(self):
    check_heads(self.heads, "mtp", "MTP")
    c = self.heads.config
    if self.acceptance not in RULES:
      raise InputError(f"acceptance={self.acceptance!r} is invalid: must be one of "
                       f"{', '.join(RULES)} (a chain is verified exactly; greedy at temperature 0)")
    sizing.left_out(self, {"gamma": c.num_heads})
    check_int("gamma", self.gamma, 1, c.num_heads, f" (the heads have {c.num_heads} modules)")
    object.__setattr__(self, "key", (c, None if self.heads.vocab is None
                                     else self.heads.vocab.tobytes()))

  lossless = True

  def prepare(self, model) -> "MTP":
    """gamma, if left out, from the cost curve and each module's held-out top-1 (sizing)."""
    return sizing.prepare(self, "mtp", model, self.heads)

  @property
  def window(self) -> int:
    return 2 * self.gamma

  def validate(self, model) -> None:
    check_fits(self.heads, model)

  def arrays(self, model):
    out = head_arrays(self.heads, model)
    out["mods"] = out["mods"][:self.gamma]
    return out

  def init(self, prog, arrays, state, hidden):
    b = state.seq.shape[0]
    c = prog.config
    cache = kv.init(self.gamma, b, prog.max_len + self.window, c.num_kv_heads, c.head_dim,
                    hidden.dtype)
    cache = prompt_pass(prog, modules(self.heads.config, prog, arrays), arrays, state.seq, hidden,
                        cache)
    return {"hcache": cache, "feats": feature_buffer(hidden, state.prompt_len, self.window),
            **verify.depth_counts(b, self.gamma)}

  def step(self, prog: Program, params, arrays, state: DecodeState) -> DecodeState:
    m = state.method
    active = ~state.done
    key, k_acc = jax.random.split(state.key)
    lengths = state.cache.lengths
    mods = modules(self.heads.config, prog, arrays)

    def draft_fn(out, k):  # module k's output at L - 1 -> d_{k+1}
      return to_tokens(arrays, sampling.argmax(mtp_logits(prog, params, arrays, mods[k],
                                                          out)))

    with phase(DRAFT):
      hcache, _, draft = catch_up(prog, mods, arrays, state.seq, m["feats"], lengths, m["hcache"],
                                  self.gamma, draft_fn)  # draft [B,G]
    state, n, hidden = verify.chain(prog, params, state.replace(key=key), k_acc, draft)

    feats = shift_in(m["feats"], hidden, jnp.where(active, n + 1, 0))
    return state.replace(method=verify.count(dict(m, hcache=hcache, feats=feats), active, n))

  def stats(self, state) -> dict:
    return dict(verify.depth_stats(state.method), gamma=self.gamma)
