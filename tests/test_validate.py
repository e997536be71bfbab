"""Nothing silently wrong: bad user input gets a specific InputError naming the argument, its value
and what is allowed, before anything compiles, and leaves the caller's objects usable; values that
are right but unusual (numpy / JAX scalars, tiny temperatures) give the right answer."""

from __future__ import annotations

import json
import os
import re
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax import decode, prompts, sampling, validate, weights

from conftest import tiny_model

PROMPT = [[5, 9, 2, 7]]
NEW = 6


@pytest.fixture(scope="module")
def tiny():
  return tiny_model()


@pytest.fixture(scope="module")
def method():
  return sj.PromptLookup()


@pytest.fixture(scope="module")
def reference(tiny, method):
  return sj.generate(tiny, PROMPT, method, max_new_tokens=NEW).tokens


# ----------------------------------------------------------------------------- the checkers


def test_integers_are_ints_not_bools_or_floats():
  assert validate.integer("k", np.int64(8)) == 8 and type(validate.integer("k", np.int64(8))) is int
  assert validate.integer("k", jnp.int32(8)) == 8
  assert validate.integer("k", np.uint8(3), 1, 5) == 3
  for bad, msg in ((True, r"k=True is invalid: must be an integer in \[0, 2147483647\], not bool"),
                   (8.0, r"k=8.0 is invalid: must be an integer in \[0, 2147483647\], not float"),
                   ("8", "not str"), (np.float32(8), "not float32"),
                   (2**31, r"k=2147483648 is invalid: must be an integer in \[0, 2147483647\]$"),
                   (-1, r"k=-1 is invalid")):
    with pytest.raises(sj.InputError, match=msg):
      validate.integer("k", bad)


def test_numbers_accept_numpy_and_jax_scalars():
  for v in (0.5, np.float32(0.5), np.float64(0.5), jnp.float32(0.5), jnp.bfloat16(0.5),
            jnp.asarray(0.5)):
    got = validate.number("temperature", v, 0)
    assert got == 0.5 and type(got) is float
  assert validate.number("x", np.int32(2), 0) == 2.0
  for bad, msg in ((True, "not bool"), ("0.5", "not str"), (float("nan"), r"in \[0, inf\)"),
                   (float("inf"), "finite"), (-0.1, r"x=-0.1 is invalid"), (10**400, "finite"),
                   (jnp.ones(2), r"x=.* is invalid: must be a finite number")):
    with pytest.raises(sj.InputError, match=msg):
      validate.number("x", bad, 0)
  with pytest.raises(sj.InputError,
                     match=r"top_p=0 is invalid: must be a finite number in \(0, 1\]"):
    validate.number("top_p", 0, 0, 1, lo_open=True)


def test_booleans_are_only_true_or_false():
  assert validate.boolean("chat", np.bool_(True)) is True
  assert validate.boolean("chat", jnp.asarray(False)) is False
  for bad in ("no", 1, 0, None):
    with pytest.raises(sj.InputError, match=f"chat={bad!r} is invalid: must be True or False"):
      validate.boolean("chat", bad)


def test_seeds_are_64_bit():
  assert validate.seed("seed", 2**63 - 1) == 2**63 - 1 and validate.seed("seed", -5) == -5
  with pytest.raises(sj.InputError, match=r"seed=18446744073709551616 is invalid: must be an "
                     r"integer in \[-9223372036854775808, 9223372036854775807\] \(a 64-bit"):
    validate.seed("seed", 2**64)


def test_prompts_reject_bytes_bools_and_floats_with_their_index():
  ok = ["a", (1, np.int64(2)), np.array([3, 4]), jnp.asarray([5], jnp.int32)]
  assert validate.prompts(ok, 10) == ["a", [1, 2], [3, 4], [5]]
  for bad, msg in (([b"The capital"], r"prompts\[0\] is bytes: pass text as str"),
                   (["a", bytearray(b"x")], r"prompts\[1\] is bytearray"),
                   ([[1, True]], r"prompts\[0\]\[1\]=True is invalid: token ids must be integers "
                                 r"in \[0, 10\), not bool"),
                   ([[1, 2.0]], r"prompts\[0\]\[1\]=2.0 is invalid: .* not float"),
                   ([[1, "2"]], r"prompts\[0\]\[1\]='2' .* not str"),
                   ([np.array([1.0])], r"prompts\[0\] is a float64 array"),
                   ([[1, 10]], r"prompts\[0\] has token id 10 outside \[0, 10\)"),
                   ([3], r"prompts\[0\] must be a string or a list of token ids"),
                   (b"abc", "prompts must be a list of strings .* got bytes"),
                   ([], "prompts is empty")):
    with pytest.raises(sj.InputError, match=msg):
      validate.prompts(bad, 10)


# ----------------------------------------------------------------------------- sj.generate


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompts=[b"The capital of France is"]), r"prompts\[0\] is bytes"),
    (dict(prompts=[[1, True, 3]]), r"prompts\[0\]\[1\]=True is invalid: .*\[0, 61\), not bool"),
    (dict(prompts=[[1.0, 2.0]]), r"prompts\[0\]\[0\]=1.0 is invalid: .* not float"),
    (dict(stop_at_eos="no"), "stop_at_eos='no' is invalid: must be True or False, not str"),
    (dict(chat="yes"), "chat='yes' is invalid: must be True or False"),
    (dict(chat=True), r"chat=True, but prompts\[0\] is token ids: the chat template applies to "
                      r"text only"),
    (dict(top_k=5.0), r"top_k=5.0 is invalid: must be an integer in \[0, 2147483647\] "
                      r"\(0 = off\), not float"),
    (dict(top_k=2**31), r"top_k=2147483648 is invalid: must be an integer in \[0, 2147483647\]"),
    (dict(max_new_tokens=8.0), r"max_new_tokens=8.0 is invalid: .* not float"),
    (dict(max_new_tokens=True), r"max_new_tokens=True is invalid: .* not bool"),
    (dict(seed=2**64), r"seed=18446744073709551616 is invalid: .* \(a 64-bit signed seed\)"),
    (dict(seed=1.5), r"seed=1.5 is invalid: .* not float"),
    (dict(temperature="0.5"), r"temperature='0.5' is invalid: .* not str"),
    (dict(temperature=True), r"temperature=True is invalid: .* not bool"),
    (dict(method=sj.Autoregressive), "method=Autoregressive is a class, not a decoding method: "
                                     r"call it, e.g. method=Autoregressive\(\)"),
])
def test_generate_rejects_before_compiling_and_objects_stay_usable(
    kwargs, match, tiny, method, reference):
  args = dict(prompts=PROMPT, method=method, max_new_tokens=NEW)
  args.update(kwargs)
  before = decode.compile_cache.count
  with pytest.raises(sj.InputError, match=match):
    sj.generate(tiny, args.pop("prompts"), args.pop("method"), **args)
  assert decode.compile_cache.count == before, "an error was raised only after compiling"
  assert sj.generate(tiny, PROMPT, method, max_new_tokens=NEW).tokens == reference


def test_numpy_and_jax_scalars_are_accepted(tiny, method):
  plain = sj.generate(tiny, PROMPT, method, max_new_tokens=NEW, temperature=0.5, top_k=3, seed=7)
  scalars = sj.generate(tiny, [np.array(PROMPT[0])], method, max_new_tokens=jnp.int32(NEW),
                        temperature=jnp.float32(0.5), top_k=np.int64(3), seed=np.uint32(7),
                        stop_at_eos=np.bool_(True))
  assert scalars.tokens == plain.tokens and len(plain.tokens[0]) == NEW


def test_largest_seed_runs(tiny):
  out = sj.generate(tiny, PROMPT, max_new_tokens=NEW, temperature=1.0, seed=validate.SEED_MAX)
  assert len(out.tokens[0]) == NEW


class _NoTemplate:
  """A tokenizer without a chat template."""
  chat_template = None
  eos_token_id = None

  def encode(self, text):
    return [1 + ord(c) % 50 for c in text]

  def decode(self, ids, skip_special_tokens=True):
    return ""


def test_chat_needs_a_chat_template(tiny):
  model = sj.Model(tiny.config, tiny.graphdef, tiny.params, _NoTemplate(), name="plain")
  with pytest.raises(sj.InputError, match="chat=True, but model 'plain''s tokenizer has no chat "
                     "template; pass chat=False"):
    sj.generate(model, ["hello"], max_new_tokens=NEW, chat=True)
  assert len(sj.generate(model, ["hello"], max_new_tokens=NEW).tokens[0]) == NEW


# ----------------------------------------------------------------------------- tiny temperatures


@pytest.mark.parametrize("temperature", [float(np.finfo(np.float32).tiny), 1e-38, 1e-45, 1e-6])
def test_tiny_temperatures_are_greedy(tiny, temperature):
  prompts_ = [[5, 9, 2, 7], [3, 1]]
  greedy = sj.generate(tiny, prompts_, max_new_tokens=12).tokens
  for seed in (0, 1):
    out = sj.generate(tiny, prompts_, max_new_tokens=12, temperature=temperature, seed=seed)
    assert out.tokens == greedy
  assert any(t != tiny.config.vocab_size - 1 for row in greedy for t in row)


def test_sampling_params_below_the_threshold_are_greedy():
  sp = sampling.SamplingParams.make(3, jnp.asarray([1e-38, 1e-6, 0.5]))
  assert np.asarray(sp.temperature).tolist() == [0.0, 0.0, 0.5]
  # params built directly (not by make) get the same treatment inside probs
  logits = jnp.asarray([[1.0, 3.0, 2.0], [0.5, 0.1, 0.2]])
  raw = sampling.SamplingParams(jnp.asarray([1e-38, 1e-45]), jnp.zeros(2, jnp.int32), jnp.ones(2))
  assert np.asarray(sampling.probs(logits, raw)).tolist() == [[0, 1, 0], [1, 0, 0]]


# ----------------------------------------------------------------------------- weights


def _tiny_checkpoint(tmp_path, tiny_dir, name: str, value: float) -> str:
  """A copy of the tiny HF checkpoint with one element of tensor `name` set to value."""
  from safetensors.numpy import load_file, save_file

  d = str(tmp_path / "bad")
  shutil.copytree(tiny_dir, d)
  tensors = load_file(os.path.join(d, "model.safetensors"))
  t = tensors[name].copy()
  t.reshape(-1)[7] = value
  tensors[name] = t
  save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
  return d


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  from tinyhf import save_tiny_hf

  return save_tiny_hf(str(tmp_path_factory.mktemp("tinyhf") / "model"))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_reported_by_name(tmp_path, tiny_dir, value):
  name = "model.layers.1.mlp.up_proj.weight"
  bad = _tiny_checkpoint(tmp_path, tiny_dir, name, value)
  with pytest.raises(sj.WeightsError, match=f"tensor '{name}' holds 1 non-finite value"):
    sj.load_model(bad, tokenizer=False, kernels=False)
  assert sj.load_model(tiny_dir, tokenizer=False, kernels=False).config.num_layers == 2


def test_large_finite_weights_load():
  """A sum that overflows is not a NaN: the element-wise check decides."""
  big = np.full((4, 4), 3e38, np.float32)
  with np.errstate(over="ignore"):
    assert not np.isfinite(big.sum())
  weights._check_finite(big, "w", "here")
  big[1, 2] = np.nan
  with pytest.raises(sj.WeightsError,
                     match=r"here: tensor 'w' holds 1 non-finite .* at index \(1, 2\)"):
    weights._check_finite(big, "w", "here")


# ----------------------------------------------------------------------------- prompt sets


def test_a_missing_named_set_is_an_error_not_a_substitution(tmp_path, monkeypatch):
  from specjax import bench

  monkeypatch.setenv("SPECJAX_PROMPTS", str(tmp_path))
  for call in (lambda: prompts.load("spec_bench:summarization", 3),
               lambda: bench.load_prompt_set("spec_bench:summarization", 3),
               lambda: bench.check_prompt_set("spec_bench:summarization")):
    with pytest.raises(sj.InputError, match=r"'spec_bench:summarization' is not available: no "
                       rf"spec_bench.jsonl in {re.escape(str(tmp_path))}.*set SPECJAX_PROMPTS "
                       r"to that folder"):
      call()
  ps, chat = bench.load_prompt_set("spec_bench:summarization", 3, fallback=True)
  assert ps == prompts.FALLBACK[:3] and ps.source.startswith("builtin (standing in for")
  labels = {label for label, _, _ in bench.load_prompt_sets("mt_bench,builtin", 2, fallback=True)}
  assert labels == {"builtin (standing in for mt_bench: not found)", "builtin"}
  assert prompts.load("builtin", 2) == prompts.FALLBACK[:2]  # named explicitly: always there
  bench.check_prompt_set("builtin")


def test_loaded_prompts_say_where_they_came_from(tmp_path, monkeypatch):
  rows = [{"category": "qa", "turns": ["q 0"]}, {"category": "rag", "turns": ["r 0"]}]
  (tmp_path / "spec_bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  monkeypatch.setenv("SPECJAX_PROMPTS", str(tmp_path))
  ps = prompts.load("spec_bench:rag", 2)
  assert ps == ["r 0", "r 0"] and ps.source == "spec_bench:rag"
  assert ps.path == str(tmp_path / "spec_bench.jsonl")
  (tmp_path / "odd.jsonl").write_text(json.dumps({"text": "no turns"}) + "\n")
  with pytest.raises(sj.InputError, match=r"odd.jsonl, row 1: a prompt row needs a string field"):
    prompts.load(str(tmp_path / "odd.jsonl"))
  (tmp_path / "p.csv").write_text("prompt\nhello\n")
  with pytest.raises(sj.InputError,
                     match=r"p.csv' is invalid: must end in .jsonl, .jsonl.gz, .txt"):
    prompts.load(str(tmp_path / "p.csv"))
  (tmp_path / "broken.jsonl").write_text("{not json\n")
  with pytest.raises(sj.InputError, match=r"broken.jsonl': cannot read it as JSON lines"):
    prompts.load(str(tmp_path / "broken.jsonl"))
