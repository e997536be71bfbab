"""Temperature / top-k / top-p -> probabilities, and sampling with explicit keys.

Sampling parameters are arrays with one value per row, so greedy and sampling share one compiled
program: temperature == 0 means greedy, and its "distribution" is the one-hot argmax. The
acceptance rules see the same one-hot, so greedy verification is the temperature-0 case of exact
rejection sampling.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


# Temperatures below this are greedy. Sampling divides the logits by the temperature: at 1e-38
# a logit of 10 overflows float32 (max 3.4e38) to inf, softmax turns the row into NaN and every
# token came out as the last vocabulary id. Long before that the result is greedy anyway: at
# T < 1e-5 a runner-up 1e-3 below the top logit gets probability exp(-100), zero in float32, so
# only exact ties (which greedy breaks by the lowest id) could differ.
MIN_TEMPERATURE = 1e-5


@flax.struct.dataclass
class SamplingParams:
  temperature: jax.Array  # [B] float32; 0 = greedy (make() maps T < MIN_TEMPERATURE to 0)
  top_k: jax.Array  # [B] int32; 0 = off
  top_p: jax.Array  # [B] float32; 1 = off

  @classmethod
  def make(cls, batch: int, temperature=0.0, top_k=0, top_p=1.0) -> "SamplingParams":
    """One value (or [B] values) of each setting -> [B] arrays. Temperatures below
    MIN_TEMPERATURE become 0, so those rows take the greedy path everywhere (sampling,
    acceptance and the all-greedy shortcuts test temperature == 0)."""
    t = jnp.asarray(temperature, jnp.float32)
    return cls(
        temperature=jnp.broadcast_to(jnp.where(t < MIN_TEMPERATURE, 0.0, t), (batch,)),
        top_k=jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (batch,)),
        top_p=jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (batch,)),
    )


ARGMAX_BLOCK = 128  # argmax's first level: the maximum of every block of this many entries


def argmax(x: jax.Array) -> jax.Array:
  """jnp.argmax over the last axis (the first maximum), in two levels: the maxima of blocks of
  ARGMAX_BLOCK entries (one pass over the row), the first block that holds the row's maximum, and
  the first index of the maximum inside that block. XLA's CPU argmax is one scalar loop per row,
  and a max followed by a min over a where() of every index writes a vocabulary-wide int32 array
  per row: on SmolLM2's 49152 ids, 4 rows took 155 us that way and 52 us so (docs/performance.md).
  A NaN row (no element equals its maximum) gives the last index. int32 [...]."""
  n = x.shape[-1]
  nb = -(-n // ARGMAX_BLOCK)
  if nb * ARGMAX_BLOCK != n:  # pad to whole blocks with entries that never win
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, nb * ARGMAX_BLOCK - n)],
                constant_values=-jnp.inf)
  blocks = x.reshape(x.shape[:-1] + (nb, ARGMAX_BLOCK))
  block_max = jnp.max(blocks, axis=-1)  # [..., nb]
  m = jnp.max(block_max, axis=-1, keepdims=True)  # [..., 1]
  b = jnp.min(jnp.where(block_max == m, jnp.arange(nb, dtype=jnp.int32), nb), axis=-1)
  b = jnp.minimum(b, nb - 1)
  row = jnp.take_along_axis(blocks, b[..., None, None], axis=-2)[..., 0, :]  # [..., BLOCK]
  j = jnp.min(jnp.where(row == m, jnp.arange(ARGMAX_BLOCK, dtype=jnp.int32), ARGMAX_BLOCK),
              axis=-1)
  return jnp.minimum(b * ARGMAX_BLOCK + j, n - 1)


def top_k_ids(logits: jax.Array, k: int) -> jax.Array:
  """The k largest entries' indices [...,k] of logits [...,V], best first (the lower index first
  on ties). lax.top_k: XLA's CPU runtime selects per row without sorting it, far faster here
  than k argmax passes (measured: docs/performance.md)."""
  return jax.lax.top_k(logits, k)[1].astype(jnp.int32)


def _rows(x: jax.Array, ndim: int) -> jax.Array:
  """[B] -> [B, 1, ..., 1] to broadcast against an ndim-dimensional [B, ..., V] array."""
  return x.reshape(x.shape + (1,) * (ndim - 1))


def _filter(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Masks (to -inf) tokens outside top-k and outside the top-p nucleus. logits [B,...,V]."""
  v = logits.shape[-1]
  srt = jnp.sort(logits, axis=-1)[..., ::-1]  # descending
  k = _rows(top_k, logits.ndim)
  k = jnp.where(k > 0, jnp.minimum(k, v), v)
  kth = jnp.take_along_axis(srt, jnp.broadcast_to(k - 1, srt.shape[:-1] + (1,)), axis=-1)
  logits = jnp.where(logits < kth, -jnp.inf, logits)
  # Nucleus over what top-k kept: the smallest prefix of the sorted tokens with mass >= top_p.
  srt = jnp.where(jnp.arange(v) < k, srt, -jnp.inf)
  p = jax.nn.softmax(srt, axis=-1)
  before = jnp.cumsum(p, axis=-1) - p  # mass strictly before each sorted token
  keep = before < _rows(top_p, logits.ndim)
  n_keep = jnp.maximum(jnp.sum(keep, axis=-1, keepdims=True), 1)
  cut = jnp.take_along_axis(srt, n_keep - 1, axis=-1)
  return jnp.where(logits < cut, -jnp.inf, logits)


def probs(logits: jax.Array, sp: SamplingParams) -> jax.Array:
  """logits [B,...,V] -> the distribution to sample from [B,...,V] (float32).

  Temperature is applied first, then top-k, then top-p (HF's order). Rows with temperature 0
  (or below MIN_TEMPERATURE, for params not built by make) get the one-hot argmax.
  """
  logits = logits.astype(jnp.float32)
  t = _rows(sp.temperature, logits.ndim)
  t = jnp.where(t < MIN_TEMPERATURE, 0.0, t)
  scaled = logits / jnp.where(t > 0, t, 1.0)
  needs_filter = jnp.any((sp.top_k > 0) | (sp.top_p < 1.0))
  scaled = jax.lax.cond(needs_filter, lambda x: _filter(x, sp.top_k, sp.top_p), lambda x: x, scaled)
  p = jax.nn.softmax(scaled, axis=-1)
  greedy = jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=jnp.float32)
  return jnp.where(t > 0, p, greedy)


_BLOCK = 128  # tokens per block of the two-level inverse-CDF search in sample_probs


def _first(mask: jax.Array, fallback: jax.Array) -> jax.Array:
  """Index of the first True along the last axis of mask [N,M]; `fallback` [N] where none is."""
  return jnp.where(jnp.any(mask, axis=-1), jnp.argmax(mask, axis=-1), fallback)


def _last(mask: jax.Array) -> jax.Array:
  """Index of the last True along the last axis of mask [N,M] (M - 1 where none is)."""
  m = mask.shape[-1]
  return m - 1 - jnp.argmax(mask[:, ::-1], axis=-1)


def sample_probs(key: jax.Array, p: jax.Array) -> jax.Array:
  """Draws one token per distribution: p [B,...,V] (non-negative, any positive total) ->
  [B,...] int32.

  Inverse-CDF sampling with one uniform draw per distribution: the vocabulary is cut into blocks
  of 128 tokens, the block is found on the cumulative block masses and the token on the chosen
  block's own cumulative sum. Gumbel-max (jax.random.categorical) needs a random number per
  token: over a vocabulary-wide row generating them takes a large share of a decode step on the
  CPU (measured: docs/performance.md). A token with probability 0 is never returned: at float
  rounding edges the search falls back to the nearest block / token that has mass.
  """
  lead, v = p.shape[:-1], p.shape[-1]
  c = min(_BLOCK, v)
  nb = -(-v // c)
  x = p.reshape(-1, v).astype(jnp.float32)
  n = x.shape[0]
  if nb * c != v:
    x = jnp.pad(x, ((0, 0), (0, nb * c - v)))
  blocks = x.reshape(n, nb, c)
  mass = jnp.sum(blocks, axis=-1)  # [N,nb]
  cum = jnp.cumsum(mass, axis=-1)
  t = jax.random.uniform(key, (n,), jnp.float32) * cum[:, -1]
  has = mass > 0
  j = _first((cum > t[:, None]) & has, _last(has))  # the block holding the t-th unit of mass
  before = jnp.take_along_axis(cum, jnp.maximum(j - 1, 0)[:, None], axis=1)[:, 0]
  base = jnp.where(j > 0, before, 0.0)  # the mass of the blocks ahead of j
  blk = jnp.take_along_axis(blocks, j[:, None, None], axis=1)[:, 0]  # [N,c]
  pos = blk > 0
  k = _first((jnp.cumsum(blk, axis=-1) > (t - base)[:, None]) & pos, _last(pos))
  return (j * c + k).astype(jnp.int32).reshape(lead)


def sample(key: jax.Array, logits: jax.Array, sp: SamplingParams,
           p: jax.Array | None = None) -> jax.Array:
  """logits [B,...,V] -> tokens [B,...] int32. All-greedy batches skip the random draw. p: the
  caller's probs(logits, sp), where it has them already (a drafter that keeps its q)."""
  greedy = argmax(logits)
  return jax.lax.cond(
      jnp.all(sp.temperature == 0),
      lambda: greedy,
      lambda: jnp.where(_rows(sp.temperature, greedy.ndim) >= MIN_TEMPERATURE,
                        sample_probs(key, probs(logits, sp) if p is None else p), greedy),
  )
