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
from specjax import decode, lazy, prompts, sampling, validate, weights

from tests.helpers.models import tiny_model

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


def test_generate_needs_a_loaded_model():
  with pytest.raises(sj.InputError, match=r"model='smollm2-135m' is invalid: must be a loaded "
                     r"specjax Model \(load it first: sj.load_model\('smollm2-135m'\)\)"):
    sj.generate("smollm2-135m", ["hi"])
  with pytest.raises(sj.InputError, match="model=None is invalid: must be a loaded specjax Model$"):
    sj.generate(None, ["hi"])


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
  from tests.helpers.tinyhf import save_tiny_hf

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
  lazy.check_finite(big, "w", "here")
  big[1, 2] = np.nan
  with pytest.raises(sj.WeightsError,
                     match=r"here: tensor 'w' holds 1 non-finite .* at index \(1, 2\)"):
    lazy.check_finite(big, "w", "here")


# ----------------------------------------------------------------------------- prompt sets


def test_a_missing_named_set_is_an_error_not_a_substitution(tmp_path, monkeypatch):
  monkeypatch.setenv("SPECJAX_PROMPTS", str(tmp_path))
  for call in (lambda: prompts.load("spec_bench:summarization", 3),
               lambda: prompts.load_prompt_set("spec_bench:summarization", 3),
               lambda: prompts.check_prompt_set("spec_bench:summarization")):
    with pytest.raises(sj.InputError, match=r"'spec_bench:summarization' is not available: no "
                       rf"spec_bench.jsonl in {re.escape(str(tmp_path))}.*set SPECJAX_PROMPTS "
                       r"to that folder"):
      call()
  ps, chat = prompts.load_prompt_set("spec_bench:summarization", 3, fallback=True)
  assert ps == prompts.FALLBACK[:3] and ps.source.startswith("builtin (standing in for")
  labels = {label for label, _, _ in prompts.load_prompt_sets("mt_bench,builtin", 2,
                                                              fallback=True)}
  assert labels == {"builtin (standing in for mt_bench: not found)", "builtin"}
  assert prompts.load("builtin", 2) == prompts.FALLBACK[:2]  # named explicitly: always there
  prompts.check_prompt_set("builtin")


def test_bench_mt_bench_rows_without_turns(tmp_path, monkeypatch):
  """bench reads MT-Bench round-robin over categories (prompts.load_prompt_set): a row without a
  prompt is an InputError naming the file and line, not a KeyError."""
  monkeypatch.setenv("SPECJAX_PROMPTS", str(tmp_path))
  rows = [{"category": "writing", "turns": ["w 0"]}, {"category": "math", "turns": ["m 0"]},
          {"category": "writing", "turns": ["w 1"]}]
  (tmp_path / "mt_bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  ps, chat = prompts.load_prompt_set("mt_bench", 3)
  assert list(ps) == ["w 0", "m 0", "w 1"] and chat
  (tmp_path / "mt_bench.jsonl").write_text(json.dumps({"category": "x", "question": 3}) + "\n")
  with pytest.raises(sj.InputError, match=r"mt_bench.jsonl line 1: a prompt row needs a string"):
    prompts.load_prompt_set("mt_bench", 1)


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


# ----------------------------------------------------------------------------- load_model


def _never(*a, **k):
  raise AssertionError("read or built before the arguments were checked")


@pytest.mark.parametrize("dtype", ["bogus", "int8", "float64", 5, True, [1], jnp.int8])
def test_load_model_rejects_a_bad_dtype_before_reading(dtype, monkeypatch):
  monkeypatch.setattr(weights, "resolve", _never)
  monkeypatch.setattr(weights, "read_checkpoint", _never)
  monkeypatch.setattr(weights, "open_checkpoint", _never)
  with pytest.raises(sj.InputError, match=re.escape(
      f"dtype={dtype!r} is invalid: must be one of float32, bfloat16, float16 (a name or a numpy "
      f"/ JAX dtype), or None for the default")):
    sj.load_model("smollm2-135m", dtype=dtype)


def test_dtypes_by_name_or_as_numpy_and_jax_types():
  for value, name in (("float32", "float32"), (" BFloat16", "bfloat16"), ("f4", "float32"),
                      ("half", "float16"), (jnp.bfloat16, "bfloat16"), (np.float32, "float32"),
                      (np.dtype("float16"), "float16"), (jnp.zeros(1).dtype, "float32"),
                      (None, None)):
    assert validate.dtype("dtype", value) == name


@pytest.mark.parametrize("kwargs,match", [
    (dict(weights="blocks"), "weights='blocks' is invalid for the shipped draft "
                             "'smollm2-135m-draft': a draft is built from its target's tensors"),
    (dict(weights="blocks", target="TINY"), "weights='blocks' is invalid with target=: .* "
                                            "Allowed here: weights='float32'"),
    (dict(dtype="bfloat16", target="TINY"), r"dtype='bfloat16' is invalid with target=: a draft "
                                            r"built on a loaded target runs in the target's dtype "
                                            r"\(float32\)"),
    (dict(tokenizer="no"), "tokenizer='no' is invalid: must be True or False, not str"),
    (dict(kernels=1), "kernels=1 is invalid: must be True or False, not int"),
])
def test_load_model_settings_a_draft_would_ignore(kwargs, match, tiny, monkeypatch):
  from specjax import shipped

  monkeypatch.setattr(weights, "resolve", _never)
  monkeypatch.setattr(shipped, "build", _never)
  if kwargs.get("target") == "TINY":
    kwargs["target"] = tiny
  with pytest.raises(sj.InputError, match=match):
    sj.load_model("smollm2-135m-draft", **kwargs)


# ----------------------------------------------------------------------------- asset files


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny):
  """A heads file and a draft asset for the tiny model, and broken files beside them."""
  from specjax import heads, shipped

  d = tmp_path_factory.mktemp("assets")
  out = {"heads": heads.save_heads(sj.init_heads(tiny, "medusa", num_heads=2), str(d / "h.npz")),
         "draft": shipped.export_draft(shipped.draft_from_target(tiny, 1), str(d / "d.npz"),
                                        target_name="tiny")}
  raw = open(out["heads"], "rb").read()
  for name, data in (("empty", b""), ("truncated", raw[:len(raw) // 2]),
                     ("text", b"prompt,turns\nhello,1\n"),
                     ("damaged", raw[:len(raw) // 2] + bytes([raw[len(raw) // 2] ^ 0xFF])
                      + raw[len(raw) // 2 + 1:])):
    (d / f"{name}.npz").write_bytes(data)
    out[name] = str(d / f"{name}.npz")
  np.save(str(d / "one.npy"), np.zeros(3))
  out["npy"] = str(d / "one.npy")
  np.savez(str(d / "foreign.npz"), x=np.zeros(3))
  out["foreign"] = str(d / "foreign.npz")
  return out


def _readers(tiny):
  from specjax import shipped

  heads = "expected heads (.npz written by sj.save_heads / `specjax train medusa|eagle|mtp --export`)"
  draft = ("expected a draft model asset (.npz written by export_draft / `specjax train draft "
           "--export`)")
  return {"load_heads": (sj.load_heads, heads),
          "load_draft_asset": (lambda p: shipped.load_draft_asset(p, tiny), draft),
          "read_draft_header": (shipped.read_draft_header, draft)}


@pytest.mark.parametrize("reader", ["load_heads", "load_draft_asset", "read_draft_header"])
@pytest.mark.parametrize("file,says", [
    ("empty", r"is empty \(0 bytes\); "),
    ("truncated", r"is not a readable .npz archive \(truncated, or another kind of file: "
                  r"BadZipFile: .*\); "),
    ("text", r"is not a readable .npz archive \(truncated, or another kind of file: .*\); "),
    ("npy", r"holds a single array \(.npy\), not a .npz archive; "),
    ("foreign", r"has no array '__header__' \(it holds x\); "),
])
def test_broken_asset_files_name_the_file_and_what_was_expected(reader, file, says, tiny, assets):
  read, expected = _readers(tiny)[reader]
  with pytest.raises(sj.WeightsError, match=re.escape(assets[file]) + " " + says
                     + re.escape(expected)):
    read(assets[file])


def test_a_damaged_array_is_named_too(tiny, assets):
  with pytest.raises(sj.WeightsError, match=re.escape(assets["damaged"]) + r": an array cannot be "
                     r"read \(truncated or damaged: BadZipFile: .*\); expected heads"):
    sj.load_heads(assets["damaged"])


def test_a_file_of_the_other_kind_says_what_it_is(tiny, assets):
  from specjax import shipped

  for read in (shipped.read_draft_header, lambda p: shipped.load_draft_asset(p, tiny)):
    with pytest.raises(sj.WeightsError, match=re.escape(
        f"{assets['heads']} holds medusa heads (written by save_heads), not a draft model asset "
        f"(.npz written by export_draft / `specjax train draft --export`): load it with "
        f"sj.load_heads({assets['heads']!r}, target)")):
      read(assets["heads"])
  with pytest.raises(sj.WeightsError, match=re.escape(
      f"{assets['draft']} is a draft model asset (export_draft), not heads")):
    sj.load_heads(assets["draft"])
  assert shipped.read_draft_header(assets["draft"])["target"] == "tiny"
  assert sj.load_heads(assets["heads"], tiny).config.num_heads == 2


def test_draft_assets_by_shipped_name():
  from specjax import shipped

  assert shipped.read_draft_header("smollm2-135m-draft")["target"] == "smollm2-135m"
  with pytest.raises(sj.InputError, match="'smollm2-135m-medusa' names shipped medusa heads, not "
                     r"a draft model: load them with sj.load_heads\('smollm2-135m-medusa', target\)"):
    shipped.read_draft_header("smollm2-135m-medusa")
  with pytest.raises(sj.WeightsError, match="no-such.npz: no such file; expected a draft model"):
    shipped.read_draft_header("no-such.npz")
  with pytest.raises(sj.InputError, match=r"'smollm2-135m-draft' is a shipped draft model, not "
                     r"heads: load it with sj.load_model\('smollm2-135m-draft', target="):
    sj.load_heads("smollm2-135m-draft")


# ----------------------------------------------------------------------------- counts and exports


def test_counts_are_whole_numbers():
  for text, n in (("2M", 2_000_000), ("500k", 500_000), ("1.5k", 1500), ("1.1k", 1100),
                  ("2_000", 2000), (7, 7), (np.int64(3), 3)):
    assert validate.count("tokens", text) == n
  for bad in ("inf", "nan", "2.5", "lots", "", "0", "-1k", True, 2.0):
    with pytest.raises(sj.InputError, match=re.escape(
        f"tokens={bad!r} is invalid: must be a whole count >= 1, like 2000000, 500k or 2M")):
      validate.count("tokens", bad)


def test_writable_file_checks_and_creates_nothing(tmp_path):
  blocker = tmp_path / "a-file"
  blocker.write_text("x")
  ok = tmp_path / "new" / "deeper" / "d.npz"
  assert validate.writable_file("export", str(ok), ".npz") == str(ok)
  assert not (tmp_path / "new").exists()
  for path, says in ((blocker / "d.npz", f"cannot be written: {blocker} is a file, not a folder"),
                     (tmp_path / "d.bin", "is invalid: must end in .npz"),
                     ("/proc/d.npz", "cannot be written: folder /proc is not writable"),
                     (None, "is invalid: must be a file path")):
    with pytest.raises(sj.InputError, match=re.escape(f"export={str(path) if path else path!r}"
                                                      if path else "export=None") + ".*"
                       + re.escape(says)):
      validate.writable_file("export", str(path) if path else path, ".npz")
  with pytest.raises(sj.InputError, match="is a folder: give a file path in it"):
    validate.writable_file("export", str(tmp_path))


def test_trainers_check_the_export_before_anything_else(tmp_path, tiny):
  """Before the corpus is even looked at (corpus=None is the next error), and no out folder."""
  from specjax.training import draft, heads

  blocker = tmp_path / "a-file"
  blocker.write_text("x")
  out = tmp_path / "run"
  with pytest.raises(sj.InputError, match=f"export='{blocker}/d.npz' cannot be written"):
    draft.train_draft(tiny, None, out_dir=str(out), export=str(blocker / "d.npz"))
  with pytest.raises(sj.InputError, match=f"export='{blocker}/h-medusa.npz' cannot be written"):
    heads.train_heads("medusa,mtp", tiny, None, out_dir=str(out),
                      export=str(blocker / "h-{kind}.npz"))
  assert not out.exists()
  (tmp_path / "empty.npz").write_bytes(b"")
  with pytest.raises(sj.WeightsError, match="empty.npz is empty .*; expected a draft model asset"):
    draft.train_draft(tiny, None, out_dir=str(out), init=str(tmp_path / "empty.npz"))
  assert not out.exists()
  with pytest.raises(sj.InputError, match="corpus=None"):  # a good export passes
    draft.train_draft(tiny, None, out_dir=str(out), export=str(tmp_path / "d.npz"))
  assert not out.exists()  # made by the run, removed when it failed


def test_a_failed_run_removes_only_what_it_created(tmp_path):
  from specjax.training import folders, trainer

  def run(out, save=False):
    with pytest.raises(RuntimeError):
      with folders.removed_on_failure(str(out), trainer.has_checkpoint):
        os.makedirs(out / "ckpt", exist_ok=True)
        if save:
          (out / "ckpt" / "40").mkdir()
        raise RuntimeError("failed")

  run(tmp_path / "runs" / "a")
  assert not (tmp_path / "runs").exists()
  run(tmp_path / "b", save=True)  # a checkpoint to resume from
  assert (tmp_path / "b" / "ckpt" / "40").is_dir()
  (tmp_path / "mine").mkdir()
  run(tmp_path / "mine")  # there before the run
  assert (tmp_path / "mine" / "ckpt").is_dir()
  with folders.removed_on_failure(str(tmp_path / "ok"), trainer.has_checkpoint):
    (tmp_path / "ok").mkdir()
  assert (tmp_path / "ok").is_dir()


def test_corpus_arguments(tmp_path):
  from specjax.training import corpus

  for kw, match in ((dict(tokens="inf"), "tokens='inf' is invalid: must be a whole count"),
                    (dict(temperatures=(0, "abc")), r"temperatures\[1\]='abc' is invalid: must "
                                                    r"be a finite number in \[0, inf\) \(0 = greedy\)"),
                    (dict(temperatures=()), r"temperatures=\(\) is invalid"),
                    (dict(temperatures="0,1"), r"temperatures='0,1' is invalid"),
                    (dict(seed=-1), r"seed=-1 is invalid: must be an integer in \[0, ")):
    with pytest.raises(sj.InputError, match=match):
      corpus.generate_corpus(_never, str(tmp_path / "c"), **kw)
    assert not (tmp_path / "c").exists()
