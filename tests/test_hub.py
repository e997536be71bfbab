"""Hugging Face Hub names (specjax/hub.py), offline: a cache laid out as huggingface_hub lays it
out (models--org--name/blobs, snapshots/<commit>, refs/main) is built here from a tiny random
Llama and tiny heads, and HF_HUB_CACHE / HF_HUB_OFFLINE point at it. A Hub name loads the same
model as its snapshot folder, revision= picks another snapshot, and what cannot be had is a
ModelNotFoundError naming the repository."""

from __future__ import annotations

import os

import numpy as np
import pytest

import specjax as sj
from specjax import cli, hub, weights
from specjax.errors import InputError, ModelNotFoundError
from specjax.drafters import export_heads
from specjax.heads import save_heads

from tests.helpers.tinyhf import put_in_hub_cache, save_tiny_hf

huggingface_hub = pytest.importorskip("huggingface_hub")

MAIN, V2 = "a" * 40, "b" * 40  # commits
PROMPT = [[3, 17, 40, 8, 99, 12]]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """Two tiny models (seeds 0 and 1) and Medusa heads for the first: a Medusa-1 directory and
  our .npz, as plain folders."""
  root = tmp_path_factory.mktemp("hubfiles")
  one = save_tiny_hf(str(root / "one"), seed=0)
  two = save_tiny_hf(str(root / "two"), seed=1)
  target = sj.load_model(one, kernels=False)
  heads = sj.init_heads(target, "medusa", num_heads=2, scale=0.3, seed=3)
  medusa = export_heads(heads, "medusa", str(root / "medusa"))
  save_heads(heads, str(root / "npz" / "heads.npz"))
  return {"one": one, "two": two, "medusa": medusa, "npz": str(root / "npz"), "target": target}


@pytest.fixture
def cache(tmp_path, monkeypatch, files):
  """The Hub cache, offline: org/tiny (main: model one; v2 and its commit: model two) and
  org/heads (main: the Medusa-1 directory and heads.npz)."""
  c = str(tmp_path / "hub")
  put_in_hub_cache(c, "org/tiny", files["one"], MAIN)
  put_in_hub_cache(c, "org/tiny", files["two"], V2, refs=("v2",))
  put_in_hub_cache(c, "org/heads", files["medusa"], MAIN)
  put_in_hub_cache(c, "org/heads", files["npz"], MAIN)
  # huggingface_hub reads its environment once, at import: set both the variables and what it read.
  monkeypatch.setenv("HF_HUB_CACHE", c)
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", c)
  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
  return c


def _tokens(model):
  return sj.generate(model, PROMPT, max_new_tokens=8, temperature=0.0).tokens


def test_a_hub_name_loads_its_snapshot(cache, files):
  snap = os.path.join(cache, "models--org--tiny", "snapshots", MAIN)
  assert weights.resolve("org/tiny") == snap
  model = sj.load_model("org/tiny", kernels=False)
  assert model.name == "org/tiny" and model.tokenizer is not None
  want = _tokens(sj.load_model(snap, kernels=False))
  assert _tokens(model) == want
  # Another revision, by commit or by tag: the other model.
  two = _tokens(sj.load_model(files["two"], kernels=False))
  assert two != want
  assert _tokens(sj.load_model("org/tiny", revision=V2, kernels=False)) == two
  assert weights.resolve("org/tiny", revision="v2") == os.path.join(
      cache, "models--org--tiny", "snapshots", V2)
  weights.check_model("org/tiny")  # the CLI's check passes a cached Hub name


def test_hub_heads(cache, files):
  target = files["target"]
  want = sj.load_heads(files["medusa"], target)
  for name in ("org/heads", "org/heads/heads.npz"):
    got = sj.load_heads(name, target)
    assert got.config == want.config
    for k in want.params:  # the .npz stores float16
      np.testing.assert_allclose(np.asarray(got.params[k]), np.asarray(want.params[k]),
                                 atol=2e-3 * float(np.abs(np.asarray(want.params[k])).max()))


def test_what_cannot_be_had_names_the_repository(cache, files, capsys):
  with pytest.raises(ModelNotFoundError, match=r"'org/missing'.*'main'.*HF_HUB_OFFLINE"):
    sj.load_model("org/missing")
  with pytest.raises(ModelNotFoundError, match=r"'org/tiny'.*'nope'"):
    sj.load_model("org/tiny", revision="nope")
  with pytest.raises(ModelNotFoundError, match=r"'org/missing'.*HF_HUB_OFFLINE"):
    sj.load_heads("org/missing", files["target"])
  with pytest.raises(ModelNotFoundError, match=r"'org/heads'.*'other.npz'.*not in the cache"):
    sj.load_heads("org/heads/other.npz")
  # The CLI refuses it before loading anything, with the same message.
  with pytest.raises(SystemExit) as e:
    cli.main(["generate", "--model", "org/missing", "--prompt", "hi"])
  assert e.value.code == 2
  assert "'org/missing'" in capsys.readouterr().err


def test_a_gguf_file_by_name(cache, tmp_path):
  folder = tmp_path / "gguf"
  folder.mkdir()
  (folder / "tiny.Q8_0.gguf").write_bytes(b"GGUF not really")
  put_in_hub_cache(cache, "org/tiny-GGUF", str(folder), MAIN)
  path = weights.resolve("org/tiny-GGUF/tiny.Q8_0.gguf")
  assert path == os.path.join(cache, "models--org--tiny-GGUF", "snapshots", MAIN, "tiny.Q8_0.gguf")
  with pytest.raises(ModelNotFoundError, match=r"org/tiny-GGUF/tiny.Q8_0.gguf"):
    weights.resolve("org/tiny-GGUF")  # no config.json: the error names the file to ask for


def test_what_a_name_is(cache, files, tmp_path, monkeypatch):
  assert weights.what_is("smollm2-135m") == hub.SHIPPED
  assert weights.what_is("smollm2-135m-draft") == hub.SHIPPED
  assert weights.what_is("org/tiny") == hub.HUB
  assert weights.what_is("org/tiny/file.gguf") == hub.HUB
  for not_hub in ("tiny", "./org/tiny", "/org/tiny", "~/org/tiny", "org/tiny/file.txt",
                  "org/ti--ny", "org//tiny"):
    assert weights.what_is(not_hub) is None, not_hub
  # A local folder named like a repository wins over the Hub.
  monkeypatch.chdir(tmp_path)
  os.makedirs("org")
  os.symlink(files["two"], "org/tiny")
  assert weights.what_is("org/tiny") == hub.LOCAL
  assert weights.resolve("org/tiny") == "org/tiny"
  with pytest.raises(InputError, match="revision="):
    weights.resolve("org/tiny", revision="v2")
  with pytest.raises(InputError, match="revision="):
    sj.load_model("smollm2-135m", revision="v2")


# Repositories as the Hub lists them (file names only), for the online selection below.
LISTINGS = {
    "mistralai/Mistral-7B-Instruct-v0.3": [
        ".gitattributes", "README.md", "config.json", "generation_config.json", "params.json",
        "consolidated.safetensors", "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
        "model.safetensors.index.json", "special_tokens_map.json", "tokenizer.json",
        "tokenizer.model", "tokenizer.model.v3", "tokenizer_config.json", "pytorch_model.bin",
        "original/consolidated.00.pth", "onnx/model.safetensors"],
    "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B": [".gitattributes", "README.md", "config.json",
                                            "pytorch_model.bin", "training_args.bin"],
    "FasterDecoding/medusa-vicuna-7b-v1.3": [".gitattributes", "README.md", "config.json",
                                             "medusa_lm_head.pt", "medusa_lm_head.safetensors"],
}


def test_online_only_the_files_a_load_reads(tmp_path, monkeypatch):
  """With the network, the patterns handed to snapshot_download pick only what a load reads: the
  config, tokenizer and HF-layout safetensors of a model (not its consolidated copy, .bin or
  subfolders); a heads repository's config and safetensors, its torch file only where it has no
  safetensors, never a training run's other pickles. snapshot_download is replaced by one that
  filters the listing as huggingface_hub does and writes empty files."""
  from huggingface_hub.utils import filter_repo_objects

  calls = []

  def snapshot_download(repo_id, *, revision=None, allow_patterns=None, ignore_patterns=None,
                        local_files_only=False):
    assert not local_files_only
    calls.append(repo_id)
    folder = tmp_path / repo_id.replace("/", "--")
    for f in filter_repo_objects(LISTINGS[repo_id], allow_patterns=allow_patterns,
                                 ignore_patterns=ignore_patterns):
      (folder / f).parent.mkdir(parents=True, exist_ok=True)
      (folder / f).write_bytes(b"")
    return str(folder)

  monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
  files = lambda folder: sorted(os.listdir(folder))  # noqa: E731
  eagle3 = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"  # fetched twice: no safetensors, then its .bin
  mistral = hub.model_path("mistralai/Mistral-7B-Instruct-v0.3")
  assert files(mistral) == ["config.json", "generation_config.json",
                            "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                            "model-00003-of-00003.safetensors", "model.safetensors.index.json",
                            "special_tokens_map.json", "tokenizer.json", "tokenizer.model",
                            "tokenizer_config.json"]
  assert files(hub.heads_path(eagle3)) == ["config.json", "pytorch_model.bin"]
  assert files(hub.heads_path("FasterDecoding/medusa-vicuna-7b-v1.3")) == [
      "config.json", "medusa_lm_head.safetensors"]
  assert calls == ["mistralai/Mistral-7B-Instruct-v0.3", eagle3, eagle3,
                   "FasterDecoding/medusa-vicuna-7b-v1.3"]
