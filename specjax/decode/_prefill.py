"""The prefill: the prompt through the target (in one forward, or in chunks on a CPU), then the
first new token sampled; its result is the loop's first state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax import cache as kv
from specjax import kernels
from specjax import sampling
from specjax.decode._method import Program
from specjax.decode._state import DecodeState, emit
from specjax.model import forward_sequence


def prefill(prog: Program, params, prompt, prompt_len, max_new, sp, key, eos, max_emit):
  """Runs the prompt through the target and samples the first new token.

  prompt [B,P] int32 (right-padded); prompt_len, max_new [B]. Returns (state, hidden [B,P,E]).

  The forward is the one training reads the frozen target's features with
  (model.forward_sequence); a prefill differs only in what it passes: its own cache of max_len
  slots (sharded, and kept for decoding, where training drops a T-slot one), each row's prompt
  length (rows are right-padded), logits at each row's last prompt token only, empty_cache (no
  [S]-wide read of the empty cache), and the Program's forward, which adds the method's taps.
  On a CPU a long prompt runs in chunks instead (prefill_chunk, _prefill_chunks).
  """
  b, p = prompt.shape
  s = prog.max_len
  cfg = prog.config
  cache = kv.init(cfg.num_layers, b, s, cfg.num_kv_heads, cfg.head_dim,
                  jax.tree_util.tree_leaves(params)[0].dtype)
  cache = prog.constrain(cache, b)
  chunk = prefill_chunk(p, b)
  if chunk == p:
    logits, hidden, cache = forward_sequence(
        cfg, lambda *a, **kw: prog.forward(params, *a, **kw), prompt, cache=cache,
        lengths=prompt_len, logits_at=(prompt_len - 1)[:, None], empty_cache=True)
  else:
    logits, hidden, cache = _prefill_chunks(prog, params, prompt, prompt_len, cache, chunk)
  cache = kv.rollback(cache, prompt_len)
  key, sub = jax.random.split(key)
  first = sampling.sample(sub, logits[:, 0], sp)
  seq = jnp.zeros((b, s), jnp.int32).at[:, :p].set(prompt)
  state = DecodeState(
      seq=seq, seq_len=prompt_len.astype(jnp.int32), prompt_len=prompt_len.astype(jnp.int32),
      max_new=max_new.astype(jnp.int32), done=jnp.zeros((b,), bool), cache=cache, key=key, sp=sp,
      eos=eos, steps=jnp.int32(0), calls=jnp.zeros((b,), jnp.int32),
      hist=jnp.zeros((b, max_emit + 1), jnp.int32))
  return emit(state, first[:, None], jnp.ones((b,), jnp.int32)), hidden


def prefill_chunk(p: int, batch: int) -> int:
  """Prompt rows per prefill forward for B = batch rows padded to P: P (one forward), or on a CPU
  for P > 64 chunks of min(P / 4, 64 / B) rows (at least 16), which keep every product on the
  CPU kernels (kernels.MAX_ROWS = 64 rows of B x rows). A chunked prefill stops after the chunk
  that holds the longest row's last prompt token, so the bucket's padding (up to half of P) costs
  at most a chunk; every chunk reads the weights once more, which a CPU's products at 16-64 rows
  hide behind their arithmetic: chunks are faster than one forward where the bucket pads much,
  and about even where it pads little (measured: docs/performance.md). Accelerators keep one
  forward: large products are what they do best."""
  rows = kernels.MAX_ROWS // batch
  if p <= kernels.MAX_ROWS or rows < 16 or jax.default_backend() != "cpu":
    return p
  chunk = min(p // 4, rows)
  return chunk if p % chunk == 0 else p


def _prefill_chunks(prog: Program, params, prompt, prompt_len, cache, chunk: int):
  """The prefill's forward as a loop over chunks of `chunk` prompt rows, each written to the
  cache after the ones before it and attending to them there, as a decoding step attends to
  the tokens before it; it stops after the chunk holding the longest row's last prompt token.
  Returns what forward_sequence does: (logits [B,1,V] at each row's last prompt token, hidden
  [B,P,E] (zero past the last chunk run: padding, which no method reads), cache)."""
  b, p = prompt.shape
  last = prompt_len - 1
  in_prompt = (jnp.arange(prog.max_len)[None, :] < prompt_len[:, None])[:, None, :]  # [B,1,S]

  def forward(i, cache):
    start = i * chunk
    cache = cache.replace(lengths=jnp.full((b,), start, jnp.int32))
    tokens = jax.lax.dynamic_slice_in_dim(prompt, start, chunk, axis=1)
    positions = start + jnp.broadcast_to(jnp.arange(chunk, dtype=jnp.int32), (b, chunk))
    mask = prog.causal_mask(cache.lengths, chunk) & in_prompt
    return prog.forward(params, tokens, positions, cache, mask,
                        logits_at=jnp.clip(last - start, 0, chunk - 1)[:, None])

  shapes = jax.eval_shape(forward, jnp.int32(0), cache)
  logits = jnp.zeros(shapes[0].shape, shapes[0].dtype)
  hidden = jnp.zeros((b, p) + shapes[1].shape[2:], shapes[1].dtype)

  def body(carry):
    i, logits, hidden, cache = carry
    lg, h, cache = forward(i, cache)
    here = (last >= i * chunk) & (last < (i + 1) * chunk)
    logits = jnp.where(here[:, None, None], lg, logits)
    hidden = jax.lax.dynamic_update_slice_in_dim(hidden, h, i * chunk, axis=1)
    return i + 1, logits, hidden, prog.constrain(cache, b)

  todo = (jnp.max(prompt_len) + chunk - 1) // chunk
  _, logits, hidden, cache = jax.lax.while_loop(lambda c: c[0] < todo, body,
                                                (jnp.int32(0), logits, hidden, cache))
  return logits, hidden, cache
