"""Tiny random models (no weights needed), prompts and the greedy checks the tests share."""

from __future__ import annotations

import jax
import numpy as np

import specjax as sj
from specjax import prompts


def tiny_config(**kw) -> sj.ModelConfig:
  base = dict(arch="llama", vocab_size=61, hidden_size=32, num_layers=2, num_heads=4,
              num_kv_heads=2, head_dim=8, intermediate_size=48, max_position_embeddings=512,
              rope_theta=10000.0, tie_word_embeddings=False, eos_token_ids=())
  base.update(kw)
  return sj.ModelConfig(**base)


def tiny_model(seed: int = 0, scale: float = 0.3, **kw) -> sj.Model:
  """A random model with logits spread wide enough that greedy argmax has no near-ties."""
  return sj.Model.random(tiny_config(**kw), seed=seed, scale=scale)


def memoryless_model(seed: int = 0) -> sj.Model:
  """A tiny model with every attention output zeroed: its greedy next token is a function of the
  current token alone, so text it generated predicts its own continuation exactly (drafts that
  copy or Jacobi-iterate it are accepted)."""
  import jax.numpy as jnp

  m = tiny_model(seed=seed)
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.zeros_like(x) if "'wo'" in jax.tree_util.keystr(path) else x, m.params)
  return sj.Model(m.config, m.graphdef, params)


def shared_prompts(n: int, kind: str = "mt_bench") -> list[str]:
  """First n prompts from ../shared/data/prompts (first turns), or the built-in sample where the
  shared folder is absent: the tests need some text, not a benchmark's."""
  return prompts.load(kind, n, fallback=True)


def random_adapters(target, rank: int, seed: int) -> dict:
  """specjax.lora.init's adapters with B drawn at random too (init leaves it zero): merged in,
  they make a model that really differs from `target` (Medusa-2's adapted model in tests)."""
  from specjax import lora

  ad = lora.init(target, rank=rank, seed=seed)
  key = jax.random.PRNGKey(seed + 100)
  return {n: dict(v, b=jax.random.normal(jax.random.fold_in(key, i), v["b"].shape))
          for i, (n, v) in enumerate(sorted(ad.items()))}


def random_prompts(n: int, vocab: int, seed: int = 0, lo: int = 3, hi: int = 20) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, vocab, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def assert_greedy(model, runs, new_tokens: int) -> None:
  """runs: (prompt, generated tokens) pairs. Each generation must be what autoregressive greedy
  decoding of `model` emits: its argmax after every position, from one teacher-forced forward
  over all rows (right-padded; causal, so the padding changes nothing before it)."""
  from specjax.model import forward_sequence

  seqs = np.zeros((len(runs), max(len(p) + len(t) for p, t in runs)), np.int32)
  for i, (p, t) in enumerate(runs):
    seqs[i, :len(p) + len(t)] = p + t
  logits = np.asarray(forward_sequence(model.config, model.module(model.params), seqs)[0])
  for i, (p, t) in enumerate(runs):
    want = logits[i].argmax(-1)[len(p) - 1:len(p) + new_tokens - 1].tolist()
    assert len(t) == new_tokens and t == want, (p, t, want)


def assert_same_greedy(model, prompts, reference, tokens, what: str = "") -> None:
  """A method's greedy tokens against autoregressive decoding's, row by row. Where the arithmetic
  is batch-invariant (the CPU: its kernels and fixed reduction orders) identity is required; on
  an accelerator, whose fused kernels round by shape, a divergence fails only where the
  autoregressive run's top-2 margin there exceeds the dtype's bound (specjax.exactness), and the
  report names each divergence with its margin."""
  tokens, reference = [list(t) for t in tokens], [list(r) for r in reference]
  if jax.default_backend() == "cpu":
    assert tokens == reference, what
    return
  from specjax import exactness

  report = exactness.check_greedy(model, prompts, reference, tokens)
  assert report.ok, f"{what}\n{report.summary()}"
