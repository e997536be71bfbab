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
  On a CPU a long prompt runs in chunks instead (prefill_chunk, _prefill_chunks), and several
  prompts run packed end to end (packs, _prefill_packed).
  """
  b, p = prompt.shape
  s = prog.max_len
  cfg = prog.config
  cache = kv.init(cfg.num_layers, b, s, cfg.num_kv_heads, cfg.head_dim,
                  jax.tree_util.tree_leaves(params)[0].dtype)
  cache = prog.constrain(cache, b)
  logits, hidden, cache = prompt_forward(prog, params, prompt, prompt_len, cache)
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


def prompt_forward(prog: Program, params, prompt, prompt_len, cache):
  """The prefill's forward over right-padded prompts [B,P] into an empty cache, the way this
  batch runs it (packed, in chunks, or one forward). Returns (logits [B,1,V] at each row's last
  prompt token, hidden [B,P,E'], cache with each row's prompt written at slots [0, its length))."""
  b, p = prompt.shape
  chunk = prefill_chunk(p, b)
  if packs(prog, b, p):
    return _prefill_packed(prog, params, prompt, prompt_len, cache)
  if chunk == p:
    return forward_sequence(
        prog.config, lambda *a, **kw: prog.forward(params, *a, **kw), prompt, cache=cache,
        lengths=prompt_len, logits_at=(prompt_len - 1)[:, None], empty_cache=True)
  return _prefill_chunks(prog, params, prompt, prompt_len, cache, chunk)


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


PACK_CHUNK = 64  # packed prompt tokens per forward: one pass of the CPU kernels (kernels.MAX_ROWS)
# The stream's most slots (B x P): each chunk's mask and attention scan them, so a very large
# batch of short prompts (a sampling test's thousands of rows) keeps the padded forward.
PACK_MAX_SLOTS = 8192


def packs(prog: Program, batch: int, p: int) -> bool:
  """Whether a prefill of `batch` rows padded to P runs packed (_prefill_packed): on a CPU, one
  device, several rows, more than one chunk of them and at most PACK_MAX_SLOTS, and every
  layer's sliding window (if any) at least P (the packed cache's slots are not positions, so
  the band comes from the mask, which one window can give for all layers only where no prompt
  is longer than it)."""
  cfg = prog.config
  windows = [w for w in (cfg.layer_windows or (cfg.sliding_window,)) if w]
  return (jax.default_backend() == "cpu" and prog.mesh is None and batch > 1
          and PACK_CHUNK < batch * p <= PACK_MAX_SLOTS
          and all(w >= p for w in windows))


def rows_computed(prog: Program, lengths, p: int) -> int:
  """Prompt rows a prefill of prompts of these lengths, padded to P, runs through the target:
  packed, the stream's chunks; chunked, each row's chunks up to the longest prompt's; else
  B x P."""
  b, chunk = len(lengths), prefill_chunk(p, len(lengths))
  if packs(prog, b, p):
    return -(-sum(lengths) // PACK_CHUNK) * PACK_CHUNK
  return b * (p if chunk == p else -(-max(lengths) // chunk) * chunk)


def _packed_index(prompt_len, n: int):
  """The packed stream of n slots holding every row's prompt end to end: (row [n], position [n]
  of each slot, B where the slot is past the last prompt; offsets [B] of each row's first)."""
  b = prompt_len.shape[0]
  ends = jnp.cumsum(prompt_len)
  offsets = ends - prompt_len
  j = jnp.arange(n, dtype=jnp.int32)
  row = jnp.searchsorted(ends, j, side="right").astype(jnp.int32)  # B past the end
  pos = j - offsets[jnp.minimum(row, b - 1)]
  return row, jnp.where(row < b, pos, 0), offsets


def _prefill_packed(prog: Program, params, prompt, prompt_len, cache):
  """The prefill of B right-padded prompts as one stream of their tokens end to end, run in
  chunks of PACK_CHUNK as _prefill_chunks runs one prompt, so the forwards compute about
  sum(prompt_len) rows instead of B x P (a batch of prompts of mixed lengths pads each to the
  longest one's bucket). Token j of the stream sits at its own row's position and sees the
  earlier slots of its own row only, so its visible keys are, in order, the ones it sees in a
  prefill of its prompt alone; every product and norm is row-invariant and attention.cc sums
  over the visible list by rank, so each row gets the bits of its own prefill (tested:
  tests/decode/test_prefill.py). The stream's cache is then gathered into the rows' caches.
  Returns what forward_sequence does."""
  b, p = prompt.shape
  c = PACK_CHUNK
  n = -(-b * p // c) * c
  row, pos, offsets = _packed_index(prompt_len, n)
  tokens = prompt[jnp.minimum(row, b - 1), pos]
  cfg = prog.config
  stream = kv.init(cfg.num_layers, 1, n, cfg.num_kv_heads, cfg.head_dim,
                   cache.layers[0]["k"].dtype)

  def forward(i, stream):
    start = i * c
    stream = stream.replace(lengths=jnp.full((1,), start, jnp.int32))
    mask = _stream_mask(row, start, c)
    return prog.forward(params, jax.lax.dynamic_slice_in_dim(tokens, start, c)[None],
                        jax.lax.dynamic_slice_in_dim(pos, start, c)[None], stream, mask,
                        logits_at=jnp.zeros((1, 1), jnp.int32))

  shapes = jax.eval_shape(forward, jnp.int32(0), stream)
  hidden = jnp.zeros((1, n) + shapes[1].shape[2:], shapes[1].dtype)

  def body(carry):
    i, hidden, stream = carry
    _, h, stream = forward(i, stream)
    return i + 1, jax.lax.dynamic_update_slice_in_dim(hidden, h, i * c, axis=1), stream

  todo = (jnp.sum(prompt_len) + c - 1) // c
  _, hidden, stream = jax.lax.while_loop(lambda x: x[0] < todo, body,
                                         (jnp.int32(0), hidden, stream))
  at = offsets[:, None] + jnp.arange(p)[None, :]  # [B,P] each row's slots in the stream
  ok = jnp.arange(p)[None, :] < prompt_len[:, None]
  at = jnp.where(ok, at, 0)
  rows_hidden = jnp.where(ok[..., None], hidden[0][at], 0)  # [B,P,E']
  e = cfg.hidden_size
  last = jnp.take_along_axis(rows_hidden[..., -e:], (prompt_len - 1)[:, None, None], axis=1)
  logits = prog.head(params, last)  # [B,1,V]
  layers = tuple({name: _gathered(buf[0], at, ok, cache.max_len) for name, buf in layer.items()}
                 for layer in stream.layers)
  return logits, rows_hidden, prog.constrain(cache.replace(layers=layers), b)


def _stream_mask(row, start, c: int):
  """[1,C,N]: stream token start + t sees the stream's slots up to itself that hold its row."""
  n = row.shape[0]
  here = jax.lax.dynamic_slice_in_dim(row, start, c)
  causal = kv.causal_mask(jnp.full((1,), start, jnp.int32), c, n)
  return causal & (row[None, None, :] == here[None, :, None])


def _gathered(buf, at, ok, s: int):
  """The stream's cache buffer [K,N,D] -> the rows' [B,K,S,D]: row r's slots [0, P) from the
  stream's slots `at` [B,P] (zero where not `ok`), the rest zero."""
  rows = jnp.where(ok[:, None, :, None], jnp.swapaxes(buf[:, at], 0, 1), 0)  # [B,K,P,D]
  return jnp.pad(rows, ((0, 0), (0, 0), (0, s - rows.shape[2]), (0, 0)))
