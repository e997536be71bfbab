"""The families beyond Llama / GPT-2 (specjax/arch), each against a tiny random model built by
transformers and saved locally (no download): Qwen3, Gemma 1 / 2 / 3 and Phi-3, with sliding
windows shorter than the test sequence where the family has them.

Per family: fp32 logits within 1e-4 of transformers at every position, 32 greedy tokens identical
to transformers' `generate`, and prefill + token-by-token decode equal to one full forward (the
decode steps cross the windows). One transformers model and one loaded model per family (module
fixtures); the lossless suite runs methods on these families in tests/methods/test_lossless.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax import cache as kv

from tests.helpers.families import FAMILIES, T, V, build_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

S = 48  # cache slots of every call here, so each family compiles three shapes: [2, T], [2, P], [2, 1]
P = 8  # prompt / prefill length


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
  """(name, transformers model, specjax model, jitted model.apply) for one family."""
  path = str(tmp_path_factory.mktemp(request.param))
  ref = build_hf(request.param, path)
  model = sj.load_model(path, tokenizer=False, kernels=False)
  return request.param, ref, model, jax.jit(model.apply)


def run(model, apply, ids, cache):
  """ids [B,t] at positions lengths..lengths+t -> (logits [B,t,V] numpy, cache advanced by t)."""
  b, t = ids.shape
  pos = cache.lengths[:, None] + jnp.arange(t)[None]
  logits, _, cache = apply(model.params, jnp.asarray(ids, jnp.int32), pos, cache,
                           kv.causal_mask(cache.lengths, t, S))
  return np.asarray(logits), kv.advance(cache, jnp.full((b,), t))


def test_config_is_the_family(pair):
  name, ref, model, _ = pair
  c = model.config
  if name in ("gemma2", "gemma3", "phi3"):  # windows shorter than the test sequence
    assert 0 < max(c.window(i) for i in range(c.num_layers)) < T
  if name == "gemma3":
    assert c.qk_norm and c.layer_windows == (5, 0) and c.local_rope_theta == 10000.0
  if name == "qwen3":
    assert c.qk_norm and c.head_dim == 24


def test_logits_match_transformers(pair):
  name, ref, model, apply = pair
  ids = np.random.default_rng(0).integers(0, V, size=(2, T))
  with torch.no_grad():
    expected = ref(torch.tensor(ids)).logits.numpy()
  ours, _ = run(model, apply, ids, model.init_cache(2, S))
  np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)
  assert np.abs(expected).max() > 0.5  # not a comparison of near-zero logits


def test_greedy_matches_transformers_generate(pair):
  """32 greedy tokens from a prefill and token-by-token decode steps (sj.generate's own loop
  runs on these families in the lossless suite) equal transformers' generate."""
  name, ref, model, apply = pair
  prompts = np.random.default_rng(2).integers(0, V, size=(2, P))
  logits, cache = run(model, apply, prompts, model.init_cache(2, S))
  toks = [logits[:, -1].argmax(-1)]
  for _ in range(31):
    logits, cache = run(model, apply, toks[-1][:, None], cache)
    toks.append(logits[:, -1].argmax(-1))
  ours = np.stack(toks, 1)
  with torch.no_grad():
    out = ref.generate(torch.tensor(prompts), attention_mask=torch.ones(2, P, dtype=torch.long),
                       max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
  np.testing.assert_array_equal(ours, out[:, P:].numpy(), err_msg=f"{name}: greedy tokens differ")


def test_prefill_then_decode_equals_full_forward(pair):
  name, ref, model, apply = pair
  ids = np.random.default_rng(1).integers(0, V, size=(2, T))
  full, _ = run(model, apply, ids, model.init_cache(2, S))
  logits, cache = run(model, apply, ids[:, :P], model.init_cache(2, S))
  steps = [logits]
  for t in range(P, T):
    logits, cache = run(model, apply, ids[:, t:t + 1], cache)
    steps.append(logits)
  np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5, rtol=0)
