"""Static-shape KV cache as plain pytree data.

Per layer a dict {"k": [B,K,S,D], "v": [B,K,S,D]}; one `lengths` [B] for all layers: row b holds
valid entries in slots [0, lengths[b]). Slot s holds the token at position s, so rolling back is
length arithmetic and nothing is erased: slots past `lengths` are garbage that the attention mask
never reads and the next write overwrites.

Slots are the third axis, not the second: the attention scores are then a batched matmul over
(row, kv head) with no transposition of the cache. With slots second XLA copied both buffers into
that order on every step, which cost more than the step's weight reads at 64 rows x 512 slots
(measured 8x slower attention) and ~10% of a one-row step.

A forward writes its T new entries at slots [lengths, lengths + T) (see `write`) without moving
`lengths`; the decoding method then decides what to keep: `advance` for a chain it accepted a
prefix of, `commit` for an arbitrary subset (the accepted path of a candidate tree).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class KVCache:
  layers: tuple  # L x {"k": [B,K,S,D], "v": [B,K,S,D]}
  lengths: jax.Array  # [B] int32

  @property
  def max_len(self) -> int:
    """S, the static capacity."""
    return self.layers[0]["k"].shape[2]

  @property
  def batch(self) -> int:
    return self.lengths.shape[0]


def init(num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
         dtype=jnp.float32) -> KVCache:
  shape = (batch, num_kv_heads, max_len, head_dim)
  layers = tuple(
      {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(num_layers)
  )
  return KVCache(layers=layers, lengths=jnp.zeros((batch,), jnp.int32))


def write_layer(layer: dict, k: jax.Array, v: jax.Array, start: jax.Array) -> dict:
  """Writes k, v [B,T,K,D] at slots [start[b], start[b] + T) of each row; start [B]."""

  def one(buf, new, s):  # buf [K,S,D], new [T,K,D]
    return jax.lax.dynamic_update_slice(buf, jnp.swapaxes(new, 0, 1).astype(buf.dtype), (0, s, 0))

  return {
      "k": jax.vmap(one)(layer["k"], k, start),
      "v": jax.vmap(one)(layer["v"], v, start),
  }


@flax.struct.dataclass
class NewEntries:
  """A forward's new entries, not yet written (`Decoder(..., write_cache=False)`): per layer run
  {"k": [B,T,K,D], "v": [B,T,K,D]}, token t's for slot start + t."""
  layers: tuple

  def pad(self, t: int) -> "NewEntries":
    """The entries padded with zeros to T = t tokens: the slots past a short forward's own are
    garbage slots (past `lengths`) either way, so branches of different widths return one
    shape."""
    def one(a):
      return jnp.pad(a, ((0, 0), (0, t - a.shape[1]), (0, 0), (0, 0)))
    return NewEntries(layers=tuple({"k": one(x["k"]), "v": one(x["v"])} for x in self.layers))


def write_new(cache: KVCache, new: NewEntries) -> KVCache:
  """The cache with `new` written at slots [lengths, lengths + T) of its first layers (`lengths`
  unchanged, as a forward leaves it)."""
  layers = list(cache.layers)
  for i, x in enumerate(new.layers):
    layers[i] = write_layer(layers[i], x["k"], x["v"], cache.lengths)
  return cache.replace(layers=tuple(layers))


def advance(cache: KVCache, n: jax.Array) -> KVCache:
  """Keeps the first n[b] freshly written entries of each row (n [B])."""
  return cache.replace(lengths=cache.lengths + n.astype(jnp.int32))


def rollback(cache: KVCache, lengths: jax.Array) -> KVCache:
  """Forgets everything at slots >= lengths[b] (lengths [B])."""
  return cache.replace(lengths=lengths.astype(jnp.int32))


def commit(cache: KVCache, idx: jax.Array, n: jax.Array) -> KVCache:
  """Keeps a chosen subset of the freshly written entries.

  idx [B,N]: offsets (from lengths[b]) of the entries to keep, in order; n [B]: how many of them are
  real. Entry lengths + idx[b, j] moves to slot lengths + j; then lengths += n. Used after tree
  verification, where the accepted path is scattered through the written block.
  """
  start = cache.lengths
  src = start[:, None] + idx  # [B,N]
  dst = start[:, None] + jnp.arange(idx.shape[1])[None, :]  # [B,N]
  valid = jnp.arange(idx.shape[1])[None, :] < n[:, None]
  s = cache.max_len
  # Invalid entries write back what is already at their (in-range) destination: a no-op.
  src = jnp.where(valid, src, jnp.minimum(dst, s - 1))
  dst = jnp.minimum(dst, s - 1)

  def move(buf):  # [B,K,S,D]
    rows = jnp.take_along_axis(buf, src[:, None, :, None], axis=2)  # [B,K,N,D]
    return jax.vmap(lambda b, d, r: b.at[:, d].set(r))(buf, dst, rows)

  layers = tuple({"k": move(l["k"]), "v": move(l["v"])} for l in cache.layers)
  return KVCache(layers=layers, lengths=start + n.astype(jnp.int32))


def causal_mask(lengths: jax.Array, num_new: int, max_len: int, window: int = 0) -> jax.Array:
  """Mask [B,T,S] for T new tokens written at slots [lengths, lengths + T), each attending to
  the cache and to the new tokens up to itself. window > 0 restricts to the last `window` slots."""
  s = jnp.arange(max_len)[None, None, :]
  q = lengths[:, None, None] + jnp.arange(num_new)[None, :, None]  # slot of each query
  mask = s <= q
  if window:
    mask &= s > q - window
  return mask


def tree_mask(lengths: jax.Array, tree: jax.Array, max_len: int, window: int = 0) -> jax.Array:
  """Mask [B,N,S] for N tree nodes written at slots [lengths, lengths + N).

  tree [N,N] (or [B,N,N]) bool: node i may attend node j (its ancestors and itself). Every node
  also attends the whole committed cache.
  """
  n = tree.shape[-1]
  s = jnp.arange(max_len)[None, None, :]
  lengths = lengths[:, None, None]
  in_cache = s < lengths
  off = s - lengths  # offset into the freshly written block
  tree = jnp.broadcast_to(tree, (lengths.shape[0], n, n))
  in_block = (off >= 0) & (off < n)
  from_tree = jnp.take_along_axis(
      tree, jnp.broadcast_to(jnp.clip(off, 0, n - 1), (tree.shape[0], n, max_len)), axis=2
  )
  mask = in_cache | (in_block & from_tree)
  if window:
    mask &= s > lengths - window
  return mask
