"""Logits parity with transformers (PyTorch fp32) on tiny random HF models saved locally, the
prefill/decode equivalence, and parity on the real SmolLM2 weights (GGUF)."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax import cache as kv

from tests.helpers.gguf_files import without_vocabulary
from tests.helpers.hf_models import HF_CONFIGS, save_tiny_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def full_forward(model: sj.Model, ids: np.ndarray):
  b, t = ids.shape
  cache = model.init_cache(b, t)
  mask = kv.causal_mask(cache.lengths, t, t, model.config.sliding_window)
  logits, hidden, _ = model.apply(model.params, jnp.asarray(ids),
                                  jnp.broadcast_to(jnp.arange(t), (b, t)), cache, mask)
  return np.asarray(logits), np.asarray(hidden)


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_logits_match_transformers(name, tmp_path):
  ref_model = save_tiny_hf(name, str(tmp_path))
  model = sj.load_model(str(tmp_path))
  ids = np.random.default_rng(0).integers(0, 97, size=(2, 24))
  with torch.no_grad():
    ref = ref_model(torch.tensor(ids)).logits.numpy()
  ours, _ = full_forward(model, ids)
  assert ours.shape == ref.shape
  np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
  assert np.abs(ref).max() > 0.1  # the comparison is not between near-zero logits


def test_sharded_safetensors_with_index(tmp_path):
  ref_model = save_tiny_hf("llama", str(tmp_path), max_shard_size="50KB")
  assert os.path.isfile(tmp_path / "model.safetensors.index.json")
  assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
  model = sj.load_model(str(tmp_path))
  ids = np.arange(10)[None] % 97
  with torch.no_grad():
    ref = ref_model(torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(full_forward(model, ids)[0], ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen2"])
def test_prefill_then_decode_equals_full_forward(name, tmp_path):
  save_tiny_hf(name, str(tmp_path))
  model = sj.load_model(str(tmp_path))
  ids = np.random.default_rng(1).integers(0, 97, size=(1, 20))
  full, _ = full_forward(model, ids)
  s, p = 32, 8
  cache = model.init_cache(1, s)
  logits, _, cache = model.apply(model.params, jnp.asarray(ids[:, :p]), jnp.arange(p)[None], cache,
                                 kv.causal_mask(cache.lengths, p, s))
  cache = kv.advance(cache, jnp.array([p]))
  steps = [np.asarray(logits)]
  for t in range(p, 20):
    logits, _, cache = model.apply(model.params, jnp.asarray(ids[:, t:t + 1]), jnp.array([[t]]),
                                   cache, kv.causal_mask(cache.lengths, 1, s))
    cache = kv.advance(cache, jnp.array([1]))
    steps.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5, rtol=0)


def test_exit_layer_matches_truncated_model(tiny):
  """num_layers=k equals a model that has only the first k layers."""
  import dataclasses
  from specjax.model import Model

  k = 1
  ids = np.array([[1, 2, 3, 4, 5]])
  cache = tiny.init_cache(1, 8)
  mask = kv.causal_mask(cache.lengths, 5, 8)
  early, _, _ = tiny.apply(tiny.params, ids, np.arange(5)[None], cache, mask, num_layers=k)
  cfg = dataclasses.replace(tiny.config, num_layers=k)
  small = Model.random(cfg)
  params = dict(tiny.params)
  params["layers"] = {0: tiny.params["layers"][0]}
  from flax import nnx

  small_params = nnx.State(params)
  out, _, _ = small.apply(small_params, ids, np.arange(5)[None], small.init_cache(1, 8), mask)
  np.testing.assert_allclose(np.asarray(early), np.asarray(out), atol=1e-6)


def test_bf16_model_is_float32_activations_into_bf16_products(monkeypatch):
  """The bf16 arithmetic (model.py, "Arithmetic"): bf16 weights and KV cache, float32 everywhere
  else, each product's input rounded to bf16. Its logits equal, up to float32 summation order,
  a float32 model holding the same (bf16) weights whose products round their inputs to bf16,
  over a bf16 cache: a prefill, then a 3-token block over it. Rounding the residual stream or
  the norms to bf16 as well moves the logits by ~1e-2 (checked below), far past the bound."""
  import jax

  from specjax import model as model_mod
  from tests.helpers.models import tiny_config

  cfg = tiny_config(vocab_size=97)
  m16 = sj.Model.random(cfg, seed=3, scale=0.3, dtype=jnp.bfloat16)
  m32 = sj.Model(m16.config, m16.graphdef,
                 jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), m16.params))
  ids = np.random.default_rng(0).integers(0, 97, size=(2, 9))

  def run(model, cache_dtype):
    c = model.config
    cache = kv.init(c.num_layers, 2, 16, c.num_kv_heads, c.head_dim, cache_dtype)
    mask = kv.causal_mask(cache.lengths, 6, 16)
    pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
    _, _, cache = model.apply(model.params, ids[:, :6], pos[:, :6], cache, mask)
    cache = kv.advance(cache, jnp.array([6, 6]))
    mask = kv.causal_mask(cache.lengths, 3, 16)
    logits, hidden, _ = model.apply(model.params, ids[:, 6:], pos[:, 6:], cache, mask)
    return np.asarray(logits), hidden.dtype

  got, dtype = run(m16, jnp.bfloat16)
  assert dtype == jnp.float32
  real = model_mod.dense
  bf16 = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
  monkeypatch.setattr(model_mod, "dense",
                      lambda x, w, packed=None, **kw: real(bf16(x), w, None, **kw))
  ref, _ = run(m32, jnp.bfloat16)
  scale = np.abs(ref).max()
  assert scale > 1.0
  assert np.abs(got - ref).max() <= 1e-5 * scale
  # the bound is sharp enough to see a bf16 rounding of the residual stream
  real_block = model_mod.Block.__call__
  monkeypatch.setattr(model_mod.Block, "__call__",
                      lambda self, x, *a, **k: real_block(self, bf16(x), *a, **k))
  rounded, _ = run(m32, jnp.bfloat16)
  assert np.abs(rounded - ref).max() > 1e-3 * scale


# ----------------------------------------------------------------------------- real weights


@pytest.fixture(scope="module")
def torch_smollm2(tmp_path_factory):
  """transformers' model from SmolLM2's GGUF, read without the vocabulary arrays (the same
  fields and tensor bytes; tests/helpers/gguf_files.without_vocabulary)."""
  from specjax.weights import resolve

  copy = without_vocabulary(resolve("smollm2-135m"), tmp_path_factory.mktemp("smollm2") / "m.gguf")
  return transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(copy), gguf_file=os.path.basename(copy), dtype=torch.float32).eval()


@pytest.mark.slow
def test_smollm2_logits_match_transformers_gguf(smollm2, torch_smollm2):
  ids = np.array([smollm2.tokenizer.encode("The capital of France is Paris. The capital of Italy is")])
  with torch.no_grad():
    ref = torch_smollm2(torch.tensor(ids)).logits.numpy()
  ours, _ = full_forward(smollm2, ids)
  assert np.abs(ours - ref).max() <= 1e-3


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers_generate(smollm2, torch_smollm2):
  from tests.helpers.models import shared_prompts

  prompts = shared_prompts(1, "mt_bench") + shared_prompts(1, "humaneval")  # chat and code
  ids = [smollm2.tokenizer.encode(p) for p in prompts]
  ours = sj.generate(smollm2, ids, max_new_tokens=64)  # both stop at EOS (and include it)
  for i, p in enumerate(ids):
    with torch.no_grad():
      ref = torch_smollm2.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                   max_new_tokens=64, do_sample=False)
    assert ours.tokens[i] == ref[0, len(p):].tolist(), f"prompt {i} diverged from transformers"


def test_rope_tables_computed_once_per_forward(smollm2):
  """The compiled forward evaluates cos and sin once (model._once). XLA's CPU compiler otherwise
  fused them into each of SmolLM2's 30 layers' query and key rotations (60 evaluations, ~2 ms of
  a 16-token forward); the tiny test models do not show it, so this compiles the real one."""
  import jax

  t, s = 4, 64
  mask = kv.causal_mask(jnp.zeros((1,), jnp.int32), t, s)

  def forward(p, pos):
    return smollm2.apply(p, jnp.ones((1, t), jnp.int32), pos, smollm2.init_cache(1, s), mask)[0]

  hlo = jax.jit(forward).lower(smollm2.params, jnp.arange(t)[None]).compile().as_text()
  assert hlo.count("cosine(") == 1, hlo.count("cosine(")


def test_cached_tokenizer_is_autotokenizers_without_torch(smollm2):
  """A GGUF's tokenizer converted into the user's cache loads through the class its config names:
  the ids and chat template AutoTokenizer gives, and no torch import in a fresh process (seconds
  at every start of the CLI, a notebook or a script)."""
  import json
  import subprocess
  import sys

  import transformers

  from specjax.weights import load_tokenizer, resolve, tokenizer_cache

  path = resolve("smollm2-135m")
  load_tokenizer(path)  # converted into the cache once (the fixture's load did it already)
  text = "Fix the spelling: teh cat sat on teh mat."
  chat = [{"role": "user", "content": text}]
  code = ("import json, sys\nfrom specjax.weights import load_tokenizer\n"
          f"tok = load_tokenizer({path!r})\n"
          f"print(json.dumps([type(tok).__name__, tok.encode({text!r}), "
          f"tok.apply_chat_template({chat!r}, add_generation_prompt=True, tokenize=False), "
          f"'torch' in sys.modules]))\n")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                     cwd=os.path.join(os.path.dirname(__file__), ".."))
  assert r.returncode == 0, r.stderr[-3000:]
  name, ids, chat_text, torch_imported = json.loads(r.stdout.strip().splitlines()[-1])
  auto = transformers.AutoTokenizer.from_pretrained(tokenizer_cache(path))
  assert not torch_imported
  assert name == type(auto).__name__
  assert ids == auto.encode(text) == smollm2.tokenizer.encode(text)
  assert chat_text == auto.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
  assert "<|im_start|>assistant" in chat_text
