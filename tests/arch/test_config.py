"""Bad model configurations fail before any weight is read, with a ConfigError naming the file, the
field and the value (specjax/arch, specjax/config.HFFields); bad arguments to model.apply fail
with an InputError instead of raw JAX errors. No weights and no compiles: every case fails first.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax import arch
from specjax import cache as kv

LLAMA = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 16}
GEMMA3 = {"model_type": "gemma3_text", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 2,
          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
          "intermediate_size": 16, "sliding_window": 4,
          "layer_types": ["sliding_attention", "full_attention"]}


def write(tmp_path, cfg) -> str:
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  # A weights file that cannot be read: the config must fail before it is opened.
  (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
  return str(tmp_path)


def load_error(tmp_path, cfg, match):
  with pytest.raises(sj.ConfigError, match=match) as e:
    sj.load_model(write(tmp_path, cfg), tokenizer=False)
  assert os.path.join(str(tmp_path), "config.json") in str(e.value)  # names the file


@pytest.mark.parametrize("cfg,match", [
    ({k: v for k, v in LLAMA.items() if k != "num_attention_heads"},
     "required field 'num_attention_heads' is missing"),
    (dict(LLAMA, hidden_size="8"), "field 'hidden_size' = '8' must be an integer"),
    (dict(LLAMA, hidden_size=8.5), "field 'hidden_size' = 8.5 must be an integer"),
    (dict(LLAMA, num_hidden_layers=True), "field 'num_hidden_layers' = True must be an integer"),
    (dict(LLAMA, rms_norm_eps="small"), "field 'rms_norm_eps' = 'small' must be a number"),
    (dict(LLAMA, vocab_size=0), "field 'vocab_size' = 0 must be >= 1"),
    (dict(LLAMA, num_attention_heads=3, num_key_value_heads=2, head_dim=4),
     "num_attention_heads = 3 is not a multiple of num_key_value_heads = 2"),
    (dict(LLAMA, hidden_size=9), "hidden_size = 9 is not a multiple of num_attention_heads = 2"),
    (dict(LLAMA, rope_scaling={"rope_type": "yarn", "factor": 4.0}), "unsupported rope type 'yarn'"),
    (dict(LLAMA, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
     "unsupported rope type 'dynamic'"),
    (dict(LLAMA, rope_scaling={"rope_type": "linear"}), "rope type 'linear' needs a number 'factor'"),
    (dict(LLAMA, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                  "partial_rotary_factor": 0.5}), "partial_rotary_factor = 0.5"),
    (dict(GEMMA3, layer_types=["sliding_attention"]),
     "'layer_types' has 1 entries; num_hidden_layers = 2"),
    (dict(GEMMA3, layer_types=["sliding_attention", "chunked_attention"]),
     "'layer_types' holds 'chunked_attention'"),
    (dict(GEMMA3, sliding_window=None), "sliding_attention layers but 'sliding_window' is not set"),
    ({"model_type": "phi3", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
      "num_attention_heads": 2, "intermediate_size": 16,
      "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
     "Phi-3's long-context rope \\(rope type 'longrope'\\) is not supported"),
], ids=["missing-heads", "string-width", "float-width", "bool-layers", "string-eps", "zero-vocab",
        "heads-do-not-divide", "width-not-heads", "yarn", "dynamic", "linear-no-factor",
        "partial-rotary", "layer-types-length", "layer-types-kind", "no-window", "phi3-longrope"])
def test_bad_config_json(tmp_path, cfg, match):
  load_error(tmp_path, cfg, match)


def test_config_json_not_an_object(tmp_path):
  load_error(tmp_path, [LLAMA], "expected a JSON object of config fields, got a list")


def test_unsupported_model_type_lists_the_supported(tmp_path):
  with pytest.raises(sj.ConfigError, match="model_type='bert'; supported: llama, mistral, qwen2, qwen3, "
                                           "gemma, gemma2, gemma3_text, phi3, gpt2"):
    sj.load_model(write(tmp_path, {"model_type": "bert"}), tokenizer=False)


def test_good_configs_map_to_the_family():
  """The same dicts, unbroken, load as configs (per-layer windows from layer_types)."""
  c = arch.from_hf_dict(GEMMA3)
  assert c.layer_windows == (4, 0) and c.qk_norm and c.post_norms and c.head_dim == 4
  assert c.rope(0) == (10000.0, ()) and c.rope(1) == (1_000_000.0, ())
  c = arch.from_hf_dict(dict(LLAMA, model_type="mistral", sliding_window=3))
  assert c.sliding_window == 3 and c.window(1) == 3 and c.window(None) == 0


def test_apply_with_bad_arguments(tiny):
  """A wrong-shape mask, cache=None or mismatched tokens / positions: InputError naming them."""
  toks, pos = jnp.zeros((1, 3), jnp.int32), jnp.arange(3)[None]
  cache = tiny.init_cache(1, 8)
  with pytest.raises(sj.InputError, match=r"mask must be \[B,T,S\] = \(1, 3, 8\).*got \(1, 3, 3\)"):
    tiny.apply(tiny.params, toks, pos, cache, kv.causal_mask(cache.lengths, 3, 3))
  with pytest.raises(sj.InputError, match="cache must be a KVCache .*got NoneType"):
    tiny.apply(tiny.params, toks, pos, None, kv.causal_mask(cache.lengths, 3, 8))
  with pytest.raises(sj.InputError, match="tokens and positions must both be"):
    tiny.apply(tiny.params, toks, np.arange(3), cache, kv.causal_mask(cache.lengths, 3, 8))
  with pytest.raises(sj.InputError, match="this call needs 2 for batch 2"):
    tiny.apply(tiny.params, jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 3), jnp.int32), cache,
               jnp.ones((2, 3, 8), bool))
