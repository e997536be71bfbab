"""MTP (specjax/methods/mtp.py), its heads (specjax/heads.py kind "mtp") and its loss
(specjax/training/mtp.py). Greedy identity and the TV check are in test_lossless.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax import decode
from specjax.errors import InputError
from specjax.heads import init_heads
from specjax.training import mtp as tm

from tests.helpers.models import memoryless_model, random_prompts
from tests.helpers.training import own_text, stand_in


@pytest.fixture(scope="module")
def memoryless():
  return memoryless_model()


@pytest.fixture(scope="module")
def fitted(memoryless):
  """Three MTP modules fitted to the memoryless model's own text."""
  return tm.fit(memoryless, init_heads(memoryless, "mtp", num_heads=3, seed=0),
                own_text(memoryless), steps=200, lr=3e-3)


def test_fitted_modules_are_accepted_and_identical(memoryless, fitted):
  heads, _ = fitted
  prompts = random_prompts(4, 61, seed=9)
  ref = sj.generate(memoryless, prompts, max_new_tokens=24)
  out = sj.generate(memoryless, prompts, sj.MTP(heads), max_new_tokens=24)
  assert out.tokens == ref.tokens
  st = out.stats
  assert st["mean_accepted"] > 1.5, st
  assert st["gamma"] == 3 and len(st["depth_acceptance"]) == 3
  assert len(st["accepted_depth_hist"]) == 4 and st["accepted_depth_hist"][3] > 0
  assert min(st["depth_acceptance"]) > 0.5  # every depth's module is accepted most of the time
  hot = sj.generate(memoryless, prompts, sj.MTP(heads), max_new_tokens=24, temperature=0.7, seed=1)
  assert hot.stats["mean_accepted"] > 1.5
  # Fewer modules draft a shorter chain (and compile their own program).
  two = sj.generate(memoryless, prompts, sj.MTP(heads, gamma=1), max_new_tokens=24)
  assert two.tokens == ref.tokens and two.stats["gamma"] == 1
  assert len(two.stats["accepted_depth_hist"]) == 2


def test_loss_decreases_and_depth_metrics(memoryless, fitted):
  heads, losses = fitted
  assert losses[-1] < 0.2 * losses[0]
  toks = own_text(memoryless, n=8, seed=99)  # held-out text
  loss_fn = jax.jit(tm.make_loss(memoryless, heads))
  frozen = tm.frozen_arrays(memoryless, heads)
  _, met = loss_fn(heads.params, {"tokens": jnp.asarray(toks)}, jax.random.PRNGKey(0), frozen)
  for k in range(3):
    assert float(met[f"top1_{k}"]) > 0.8, met
  # Per-depth weights: weight only depth 1 and the loss is that depth's CE.
  one = jax.jit(tm.make_loss(memoryless, heads, weights=(0.0, 1.0, 0.0)))
  l1, m1 = one(heads.params, {"tokens": jnp.asarray(toks)}, jax.random.PRNGKey(0), frozen)
  np.testing.assert_allclose(l1, m1["loss_1"], rtol=1e-6)
  np.testing.assert_allclose(m1["loss_1"], met["loss_1"], rtol=1e-5)


def test_loss_labels_and_vocab_subset(tiny):
  """Module k at position i is scored on token i + k + 2, only inside the window and the subset."""
  toks = jnp.asarray(random_prompts(2, 61, seed=4, lo=10, hi=11))
  heads = init_heads(tiny, "mtp", num_heads=2, seed=1)
  frozen = tm.frozen_arrays(tiny, heads)
  _, met = jax.jit(tm.make_loss(tiny, heads))(heads.params, {"tokens": toks}, None, frozen)
  assert int(met["count"]) == 2 * 8  # depth 0: positions 0..7 have a label (t + 2 < 10)
  ids = np.arange(0, 61, 2)
  sub = init_heads(tiny, "mtp", num_heads=2, seed=1, vocab=ids)
  fz = tm.frozen_arrays(tiny, sub)
  _, ms = jax.jit(tm.make_loss(tiny, sub))(sub.params, {"tokens": toks}, None, fz)
  want = int(np.sum(np.asarray(toks)[:, 2:] % 2 == 0))
  assert int(ms["count"]) == want


@pytest.mark.parametrize("kw,match", [
    (dict(gamma=0), "gamma=0"),
    (dict(gamma=3), "gamma=3"),
    (dict(acceptance="typical"), "acceptance='typical'"),
])
def test_bad_arguments(tiny, kw, match):
  heads = init_heads(tiny, "mtp", num_heads=2)
  with pytest.raises(InputError, match=match):
    sj.MTP(heads, **kw)


def test_bad_heads_raise_before_compiling(tiny):
  n = decode.compile_cache.count
  with pytest.raises(InputError, match="kind 'eagle'"):
    sj.MTP(init_heads(tiny, "eagle"))
  with pytest.raises(InputError, match="num_heads=0"):
    init_heads(tiny, "mtp", num_heads=0)
  other = init_heads(stand_in(hidden_size=16, num_heads=2, num_kv_heads=1), "mtp")
  with pytest.raises(InputError, match="width 16"):
    sj.generate(tiny, [[1, 2, 3]], sj.MTP(other), max_new_tokens=4)
  layer = init_heads(stand_in(intermediate_size=40), "mtp")  # same width and vocabulary
  with pytest.raises(InputError, match="layer"):
    sj.generate(tiny, [[1, 2, 3]], sj.MTP(layer), max_new_tokens=4)
  assert decode.compile_cache.count == n
