"""A verification inside a lax.cond or lax.switch (nobody drafted: a one-token forward; a chain
whose width follows the round) only reads the KV cache; its new entries are written after the
branch. A branch that wrote the cache itself made XLA copy every layer's K and V into and out of
the branch on every step (methods/verify.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax import packing
from specjax import cache as kv

from tests.helpers.models import random_prompts, tiny_model
from tests.helpers.programs import cache_copies_in_loop


@pytest.mark.parametrize("packed", [False, True], ids=["xla", "kernels"])
@pytest.mark.parametrize("num_layers", [None, 1], ids=["all-layers", "layer-skip"])
def test_forward_that_only_reads_returns_what_it_would_write(packed, num_layers):
  """write_cache=False gives the same logits and hidden states, bit for bit, and its new entries,
  written by kv.write_new, give the cache the writing forward leaves (of the layers it ran)."""
  model = tiny_model(seed=3)
  if packed:
    model = packing.pack(model)
  cache = model.init_cache(2, 32)
  rng = np.random.default_rng(0)
  for layer in cache.layers:  # garbage where a real cache has earlier entries
    for name in ("k", "v"):
      layer[name] = jnp.asarray(rng.standard_normal(layer[name].shape).astype(np.float32))
  cache = kv.rollback(cache, jnp.array([5, 9]))
  t = 4
  toks = jnp.asarray(rng.integers(0, model.config.vocab_size, (2, t)), jnp.int32)
  pos = cache.lengths[:, None] + jnp.arange(t)[None]
  mask = kv.causal_mask(cache.lengths, t, 32)
  kw = {} if num_layers is None else {"num_layers": num_layers}
  logits, hidden, written = model.apply(model.params, toks, pos, cache, mask, **kw)
  logits2, hidden2, new = model.apply(model.params, toks, pos, cache, mask, write_cache=False,
                                      **kw)
  assert isinstance(new, kv.NewEntries)
  assert len(new.layers) == (num_layers or model.config.num_layers)
  np.testing.assert_array_equal(np.asarray(logits2), np.asarray(logits))
  np.testing.assert_array_equal(np.asarray(hidden2), np.asarray(hidden))
  later = kv.write_new(cache, new.pad(t + 3))  # padding writes garbage slots past lengths only
  for a, b, c in zip(later.layers, written.layers, cache.layers):
    for name in ("k", "v"):
      got, want, old = (np.asarray(x[name]) for x in (a, b, c))
      for row, n in enumerate([5, 9]):
        np.testing.assert_array_equal(got[row, :, :n + t], want[row, :, :n + t])
        np.testing.assert_array_equal(got[row, :, n + t + 3:], old[row, :, n + t + 3:])


BRANCHING = {
    "prompt-lookup": lambda: sj.PromptLookup(ngram=2, num_tokens=3),
    "suffix": lambda: sj.SuffixDecoding(num_nodes=6, max_depth=3),
    "draft-width": lambda: sj.DraftModel(tiny_model(seed=1), gamma=3, adaptive=True),
    "quantized-lookup": lambda: sj.QuantizedDraft(bits=8, gamma=3, adaptive=True, lookup=2),
}


@pytest.mark.parametrize("name", sorted(BRANCHING))
def test_branching_verification_copies_no_cache(name):
  """The compiled decode loop of every method whose verification (or multi-level draft) branches
  holds no copy of a cache-shaped buffer, and decodes as autoregressive decoding does."""
  model = tiny_model(seed=0)
  method = BRANCHING[name]()
  prompts = random_prompts(2, model.config.vocab_size, seed=4)
  out = sj.generate(model, prompts, method, max_new_tokens=12)
  ar = sj.generate(model, prompts, sj.Autoregressive(), max_new_tokens=12)
  assert out.tokens == ar.tokens
  assert cache_copies_in_loop(method, model.config, 2) == 0
