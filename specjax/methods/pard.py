"""A parallel draft model drafts a whole chain in one forward (PARD, An et al. 2025).

The draft is a small causal LM of the target's tokenizer taught to fill mask tokens
(training/pard.py, `specjax train pard`): fed [.., x_L, m, .., m] (x_L the pending token, then
gamma - 1 masks at positions L + 1 .. L + gamma - 1), its output at x_L is q_1 and at the j-th
mask q_{j+1}, so one draft forward proposes the whole chain, where a plain draft model runs gamma
forwards. Target-independent, unlike DFlash's drafter: it reads only tokens, never the target's
states. One step, all rows at once, all shapes static:

  draft     one forward over the last gamma + 1 committed tokens and gamma - 1 masks: the real
            tokens rewrite their slots of the draft's cache (a round commits at most gamma + 1
            tokens, and the previous round left masks' K/V past its pending token), the masks'
            entries past the pending token are rewritten next round. Each d_j is drawn from q_j
            (argmax at temperature 0).
  verify    the shared chain step (`verify.chain`) with DraftModel's rule: greedy token matching
            at temperature 0, else exact rejection sampling with the draft's q_j. Exact: each q_j
            depends on the committed tokens alone (the block's other inputs are masks), so d_j ~
            q_j is a draw fixed before the target's coins, as in DFlash.

Its options are DraftModel's: adaptive gamma and `threshold` (a row drafts up to its first
position whose confidence falls under it) cut the chain after the one forward.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax import cache as kv
from specjax import sampling
from specjax.decode import DecodeState
from specjax.errors import InputError, check_int
from specjax.methods import sizing
from specjax.methods.draft import DraftModel
from specjax.methods.features import to_tokens
from specjax.model import subset_logits
from specjax.shipped import parallel_settings


@dataclasses.dataclass(frozen=True)
class ParallelDraft(DraftModel):
  """A parallel draft model (`draft`: a Model trained by `specjax train pard`, e.g.
  sj.load_model("smollm2-135m-pard")) drafting gamma tokens in one forward. gamma: at most the
  block its asset was trained for (left out: from the cost curve and the asset's held-out
  per-offset agreement, methods/sizing.py). mask_token_id: the masks' token id (left out: the
  asset's). vocab, adaptive, min_gamma, threshold: as DraftModel's."""
  mask_token_id: int | None = None

  name = "pard"

  def __post_init__(self):
    super().__post_init__()
    block = parallel_settings(self.draft)
    if self.mask_token_id is None:
      if "mask_token_id" not in block:
        raise InputError("a parallel draft needs mask_token_id: this draft's asset records none "
                         "(train one with `specjax train pard`, or pass mask_token_id=)")
      object.__setattr__(self, "mask_token_id", block["mask_token_id"])
    check_int("mask_token_id", self.mask_token_id, 0, self.draft.config.vocab_size - 1,
              f" (the draft's vocabulary has {self.draft.config.vocab_size} ids)")
    if "block_size" in block:
      if "gamma" in self.left_out:  # (the class's own size, within the trained block)
        object.__setattr__(self, "gamma", min(self.gamma, int(block["block_size"])))
      check_int("gamma", self.gamma, 1, int(block["block_size"]),
                f" (this draft was trained to draft blocks of {block['block_size']})")

  def prepare(self, model) -> "ParallelDraft":
    """gamma, if left out, from the cost curve and the asset's held-out top-1 per offset."""
    return sizing.prepare(self, "pard", model, self.draft)

  @property
  def refeed_len(self) -> int:
    """Committed tokens each round's forward feeds: all that a round can commit (gamma + 1)."""
    return self.gamma + 1

  @property
  def extra_room(self) -> int:
    """Draft cache slots past the sequence's: a short sequence's window starts at slot 0 and
    reaches slot 2 gamma - 1."""
    return self.gamma

  def block_logits(self, arrays, dcache, seq, seq_len):
    """One draft forward: the last gamma + 1 committed tokens of each row (fewer where the
    sequence is shorter: the window then starts at slot 0), then masks. Returns (logits [B,G,Vs]
    of q_1 .. q_gamma, dcache)."""
    from flax import nnx

    d, g = self.draft.config, self.gamma
    r = self.refeed_len
    width = r + g - 1
    start = jnp.maximum(seq_len - r, 0)
    real = seq_len - start  # [B] committed tokens in the window, the pending one last
    i = jnp.arange(width)[None, :]
    toks = jnp.take_along_axis(seq, jnp.minimum(start[:, None] + i, seq.shape[1] - 1), axis=1)
    toks = jnp.where(i < real[:, None], toks, self.mask_token_id)
    dcache = kv.rollback(dcache, start)
    mask = kv.causal_mask(start, width, dcache.max_len, d.sliding_window)
    at = real[:, None] - 1 + jnp.arange(g)[None, :]  # [B,G]: the pending token, then the masks
    model = nnx.merge(self.draft.graphdef, arrays["draft"])
    logits, hidden, dcache = model(toks, start[:, None] + i, dcache, mask, logits_at=at)
    if "head" in arrays:  # the full-vocabulary logits above are dead code and compiled away
      return subset_logits(jnp.take_along_axis(hidden, at[..., None], axis=1), arrays), dcache
    return logits, dcache

  def _propose(self, prog, params, arrays, state: DecodeState, key):
    """All gamma drafts from one forward; a row's chain ends at its budget (adaptive g) or at
    its first position (after the first) whose confidence is under `threshold`."""
    g = self.gamma
    logits, dcache = self.block_logits(arrays, state.method["cache"], state.seq, state.seq_len)
    q = sampling.probs(logits, state.sp)  # [B,G,Vs] (one-hot for greedy rows)
    toks = to_tokens(arrays, sampling.sample(key, logits, state.sp, p=q))
    budget = jnp.where(self.adaptive, state.method["g"], g)  # [B]
    keep = (jnp.arange(g)[None, :] < budget[:, None]) & ~state.done[:, None]
    if self.threshold > 0:
      conf = jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1)  # [B,G]
      sure = (conf >= self.threshold) | (jnp.arange(g) == 0)[None, :]
      keep &= jnp.cumprod(sure, axis=1).astype(bool)
    toks = jnp.where(keep, toks, -1)
    q = jnp.where(keep[..., None], q, 0.0)
    state = self._with_draft_cache(state, dcache)
    return state, toks, q, jnp.sum(keep, axis=1, dtype=jnp.int32)

  def stats(self, state) -> dict:
    return dict(super().stats(state), mask_token_id=self.mask_token_id)
