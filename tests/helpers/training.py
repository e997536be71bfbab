"""Targets and text for the drafters' training tests: a target a small draft can learn, corpora and
token arrays of a target's own greedy text, a config-only stand-in for a target."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import specjax as sj

from tests.helpers.models import random_prompts, tiny_config, tiny_model
from tests.helpers.tinyhf import FakeCorpus


def _learnable_target():
  """A 4-layer tiny model with every attention output zeroed (its greedy next token is a function
  of the current token): a map a 1-layer draft can learn in a few dozen steps, though the target's
  first layer alone (the draft's starting point) agrees with it on almost nothing."""
  import jax.numpy as jnp

  m = tiny_model(seed=0, num_layers=4, scale=0.3)
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.zeros_like(x) if "'wo'" in jax.tree_util.keystr(path) else x, m.params)
  return sj.Model(m.config, m.graphdef, params)


def _self_corpus(target, n=64, new=40, seed=0):
  """The target's own greedy responses to random 6-token prompts, as a corpus."""
  prompts = random_prompts(n, target.config.vocab_size, seed=seed, lo=6, hi=7)
  out = sj.generate(target, prompts, max_new_tokens=new)
  return FakeCorpus([p + t for p, t in zip(prompts, out.tokens)], [len(p) for p in prompts],
                    target.config.vocab_size)


def stand_in(**kw):
  """A target as heads see it (config only): building a random Model costs seconds."""
  import types
  return types.SimpleNamespace(config=tiny_config(**kw), name="", dtype=jnp.float32)


def own_text(target, n=32, length=32, seed=11):
  v = target.config.vocab_size
  ps = random_prompts(n, v, seed=seed, lo=3, hi=8)
  gen = sj.generate(target, ps, max_new_tokens=length, stop_at_eos=False).tokens
  return np.array([(p + g)[:length] for p, g in zip(ps, gen)])
