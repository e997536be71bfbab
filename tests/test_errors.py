"""Bad input raises a specific error naming the argument or file, before anything compiles."""

from __future__ import annotations

import json

import pytest

import specjax as sj
from specjax import decode, weights

from tests.helpers.models import tiny_model


@pytest.fixture
def no_compile():
  before = decode.compile_cache.count
  yield
  assert decode.compile_cache.count == before, "an error was raised only after compiling"


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompts=[]), "prompts is empty"),
    (dict(prompts=[[]]), r"prompts\[0\] is empty"),
    (dict(prompts="abc"), "prompts must be a list"),
    (dict(prompts=[[1, 2, 999]]), "outside"),
    (dict(prompts=[[1] * 500], max_new_tokens=20), "exceeds the model's context of 512"),
    (dict(max_new_tokens=0), "max_new_tokens=0"),
    (dict(max_new_tokens=2.5), "max_new_tokens=2.5"),
    (dict(temperature=-0.1), "temperature=-0.1"),
    (dict(temperature=float("nan")), "temperature=nan"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(top_k=-1), "top_k=-1"),
    (dict(method="greedy"), "is not a decoding method"),
])
def test_generate_rejects_bad_input(kwargs, match, no_compile):
  model = tiny_model()
  args = dict(prompts=[[1, 2, 3]], max_new_tokens=4)
  args.update(kwargs)
  prompts = args.pop("prompts")
  with pytest.raises(sj.InputError, match=match):
    sj.generate(model, prompts, **args)


def test_unknown_model_name():
  with pytest.raises(sj.ModelNotFoundError, match="unknown model 'no-such-model'"):
    sj.load_model("no-such-model")


def test_directory_without_weights(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({
      "model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
      "num_attention_heads": 2, "intermediate_size": 16}))
  with pytest.raises(sj.ModelNotFoundError, match="no weights found"):
    sj.load_model(str(tmp_path))


def test_directory_without_config(tmp_path):
  with pytest.raises(sj.ConfigError, match="no config.json"):
    sj.load_model(str(tmp_path))


def test_unsupported_architecture(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 10}))
  with pytest.raises(sj.ConfigError, match="unsupported architecture model_type='bert'"):
    sj.load_model(str(tmp_path))


def _tiny_hf_dir(path):
  from tests.helpers.hf_models import save_tiny_hf

  save_tiny_hf("llama", str(path))
  return path


def test_truncated_safetensors(tmp_path):
  d = _tiny_hf_dir(tmp_path)
  f = d / "model.safetensors"
  data = f.read_bytes()
  f.write_bytes(data[: len(data) // 2])
  with pytest.raises(sj.WeightsError, match="model.safetensors: truncated"):
    sj.load_model(str(d))


def test_missing_and_misshaped_tensors_are_named(tmp_path):
  from safetensors.numpy import load_file, save_file

  d = _tiny_hf_dir(tmp_path)
  f = str(d / "model.safetensors")
  tensors = load_file(f)
  bad = dict(tensors)
  del bad["model.layers.1.mlp.up_proj.weight"]
  save_file(bad, f)
  with pytest.raises(sj.WeightsError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
    sj.load_model(str(d))
  bad = dict(tensors)
  bad["model.layers.0.self_attn.k_proj.weight"] = bad["model.layers.0.self_attn.k_proj.weight"][:, :-1].copy()
  save_file(bad, f)
  with pytest.raises(sj.WeightsError, match="'model.layers.0.self_attn.k_proj.weight' has shape"):
    sj.load_model(str(d))
  bad = dict(tensors)
  bad["model.layers.0.extra.weight"] = bad["model.norm.weight"]
  save_file(bad, f)
  with pytest.raises(sj.WeightsError, match="unexpected tensor.*model.layers.0.extra.weight"):
    sj.load_model(str(d))


def test_truncated_gguf(tmp_path):
  src = weights.resolve("smollm2-135m")
  dst = tmp_path / "cut.gguf"
  with open(src, "rb") as f:
    dst.write_bytes(f.read(3_000_000))
  with pytest.raises(sj.WeightsError, match="cut.gguf: cannot read GGUF file"):
    sj.load_model(str(dst))


def test_missing_gguf_file(tmp_path):
  with pytest.raises(sj.ModelNotFoundError):
    sj.load_model(str(tmp_path / "absent.gguf"))
