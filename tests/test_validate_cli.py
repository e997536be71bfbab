"""Nothing silently wrong, on the command line: every bad flag value of `specjax generate | bench |
data | train` is one line naming the flag and the value (exit status 2, no traceback), before any
model loads; `specjax generate` says what it is doing while it loads and compiles; a failed run
leaves no folder it created behind, and never removes one it did not create.

Everything runs in-process (cli.main) with the model load replaced by a failure or a tiny model:
no model is loaded or compiled here."""

from __future__ import annotations

import json
import os

import pytest

import specjax as sj
from specjax import cli, weights
from specjax.decode import GenerateOutput


@pytest.fixture
def no_load(monkeypatch):
  """Loading a model is a test failure: every check must come first."""
  def fail(*a, **k):
    raise AssertionError("the model was loaded before the arguments were checked")

  monkeypatch.setattr(sj, "load_model", fail)
  monkeypatch.setattr(weights, "load_model", fail)


def _fails(argv, capsys, match: str) -> str:
  """cli.main(argv) exits with status 2 and one line on stderr holding `match`."""
  with pytest.raises(SystemExit) as e:
    cli.main(argv)
  err = capsys.readouterr().err
  assert e.value.code == 2, err
  assert match in err, err
  assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
  return err


# ----------------------------------------------------------------------------- specjax generate


@pytest.mark.parametrize("argv,match", [
    (["--temperature", "nan"], "--temperature nan is invalid: must be a finite number in [0, inf) "
                               "(0 = greedy)"),
    (["--temperature", "-0.5"], "--temperature -0.5 is invalid"),
    (["--top-p", "2"], "--top-p 2.0 is invalid: must be a finite number in (0, 1] (1 = off)"),
    (["--top-p", "0"], "--top-p 0.0 is invalid"),
    (["--top-k", "-1"], "--top-k -1 is invalid: must be an integer in [0, 2147483647] (0 = off)"),
    (["--top-k", str(2**31)], "--top-k 2147483648 is invalid"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0 is invalid: must be an integer in [1, "),
    (["--seed", str(2**64)], "--seed 18446744073709551616 is invalid: must be an integer in "
                             "[-9223372036854775808, 9223372036854775807] (a 64-bit signed seed)"),
    (["--gamma", "-2"], "--gamma -2 is invalid: must be an integer >= 0"),
    (["--nodes", "-1"], "--nodes -1 is invalid"),
    (["--method", "telepathy"], "--method 'telepathy' is unknown; available: autoregressive"),
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
])
def test_generate_checks_its_arguments_before_loading(argv, match, capsys, no_load):
  _fails(["generate", "--prompt", "hi", *argv], capsys, match)


def test_generate_non_numbers_are_argparse_errors(capsys, no_load):
  with pytest.raises(SystemExit) as e:
    cli.main(["generate", "--prompt", "hi", "--max-new-tokens", "8.5"])
  err = capsys.readouterr().err
  assert e.value.code == 2 and "argument --max-new-tokens: invalid int value: '8.5'" in err
  assert "Traceback" not in err


class _Tokenizer:
  """Text <-> ids for the tiny model, without a chat template."""
  chat_template = None
  eos_token_id = None

  def encode(self, text):
    return [1 + ord(c) % 50 for c in text]

  def decode(self, ids, skip_special_tokens=True):
    return "".join(chr(97 + i % 26) for i in ids)


class _Loaded:
  """What cli._load returns here: a stand-in model with a tokenizer (sj.generate is replaced, so
  nothing reads its weights and nothing compiles)."""
  tokenizer = _Tokenizer()

  def __str__(self):
    return "a stand-in model"


def _tiny_named(monkeypatch, seen: dict):
  """cli._load returns a stand-in model; sj.generate is recorded, not run."""
  monkeypatch.setattr(cli, "_load", lambda args: _Loaded())

  def generate(model, prompts, method, **kw):
    seen.update(prompts=prompts, method=method, **kw)
    return GenerateOutput(tokens=[[1, 2]], texts=["ab"], stats={"tokens": 2})

  monkeypatch.setattr(sj, "generate", generate)


@pytest.mark.parametrize("method,canonical", [("pld", "prompt-lookup"), ("draft", "draft")])
def test_generate_prints_what_it_is_doing(method, canonical, capsys, monkeypatch):
  from specjax import methods

  seen = {}
  _tiny_named(monkeypatch, seen)
  monkeypatch.setattr(methods, "build", lambda name, model, **kw: f"built {name}")
  cli.main(["generate", "--prompt", "hi", "--method", method, "--max-new-tokens", "2"])
  out, err = capsys.readouterr()
  lines = err.splitlines()
  assert lines[0] == "loading smollm2-135m ..."
  assert lines[1].startswith("loading smollm2-135m: ") and lines[1].endswith("s; a stand-in model")
  if canonical == "draft":  # a trained drafter loads: a step of its own
    assert lines[2] == "loading draft's drafter ..." and lines[3].startswith("loading draft's drafter: ")
    lines = lines[2:]
  assert lines[2] == f"compiling and generating ({canonical}, 2 new tokens) ..."
  assert lines[3].startswith(f"compiling and generating ({canonical}, 2 new tokens): ")
  assert len(lines) == 4
  assert ">>> hi\nab" in out and json.loads(out[out.index("{"):]) == {"tokens": 2}
  assert seen["method"] == f"built {canonical}" and seen["max_new_tokens"] == 2


def test_generate_chat_without_a_template_is_one_line(capsys, monkeypatch):
  seen = {}
  _tiny_named(monkeypatch, seen)
  with pytest.raises(SystemExit) as e:
    cli.main(["generate", "--prompt", "hi", "--chat"])
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 2 and "Traceback" not in "\n".join(err)
  assert err[-1] == ("specjax: error: --chat: the tokenizer of 'smollm2-135m' has no chat "
                     "template; run without --chat")
  assert err[0] == "loading smollm2-135m ..." and len(err) == 3
  assert seen == {}, "generate ran after the chat check failed"


# ----------------------------------------------------------------------------- specjax bench


def test_bench_prompt_files_are_read_before_the_model(tmp_path, capsys, no_load):
  no_turns = tmp_path / "p.jsonl"
  no_turns.write_text(json.dumps({"category": "x", "text": "no turns"}) + "\n")
  _fails(["bench", "--prompts", str(no_turns)], capsys,
         f"{no_turns}, row 1: a prompt row needs a string field \"prompt\", \"question\" or "
         f"\"turns\"")
  csv = tmp_path / "p.csv"
  csv.write_text("prompt\nhello\n")
  _fails(["bench", "--prompts", str(csv)], capsys,
         f"--prompts '{csv}' is invalid: a prompt file must end in .jsonl, .jsonl.gz, .txt")
  _fails(["bench", "--prompts", "p.csv"], capsys, "--prompts 'p.csv' is unknown")
  _fails(["bench", "--gamma", "-1"], capsys, "--gamma -1 is invalid")


# ----------------------------------------------------------------------------- specjax data


@pytest.mark.parametrize("argv,match", [
    (["--tokens", "inf"], "--tokens 'inf' is invalid: must be a whole count >= 1, like 2000000, "
                          "500k or 2M"),
    (["--tokens", "2.5"], "--tokens '2.5' is invalid"),
    (["--temperatures", "0,abc"], "--temperatures '0,abc' is invalid: 'abc' is not one of the "
                                  "comma-separated numbers in [0, inf) it must hold, e.g. 0,0.7,1.0"),
    (["--temperatures", "0,-1"], "--temperatures '0,-1' is invalid: '-1' is not one of"),
    (["--temperatures", ""], "--temperatures '' is invalid"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0 is invalid: must be an integer in [1, 65536]"),
    (["--micro-batch", "0"], "--micro-batch 0 is invalid"),
    (["--max-minutes", "inf"], "--max-minutes inf is invalid: must be a finite number in [0, inf)"),
    (["--seed", "-1"], "--seed -1 is invalid: must be an integer in [0, 9223372036854775807]"),
])
def test_data_generate_flags(argv, match, tmp_path, capsys, no_load):
  out = tmp_path / "corpus"
  _fails(["data", "generate", "--out", str(out), *argv], capsys, match)
  assert not out.exists()


@pytest.mark.parametrize("argv,match", [
    (["--batch-sizes", "1,x"], "--batch-sizes '1,x' is invalid: 'x' is not one of the comma-"
                               "separated integers in [1, 4096] it must hold, e.g. 1,16,32"),
    (["--batch-sizes", "1,0"], "--batch-sizes '1,0' is invalid: '0' is not one of"),
    (["--batch-sizes", "1.5"], "--batch-sizes '1.5' is invalid"),
    (["--new-tokens", "0"], "--new-tokens 0 is invalid"),
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
])
def test_data_throughput_flags(argv, match, capsys, no_load):
  _fails(["data", "throughput", *argv], capsys, match)


def test_data_generate_removes_the_folder_it_created(tmp_path, capsys, monkeypatch):
  """The model fails to load after the out folder was made: the folder goes, a user's stays."""
  def missing(name, **kw):
    raise sj.ModelNotFoundError(f"unknown model {name!r}")

  monkeypatch.setattr(weights, "load_model", missing)
  new = tmp_path / "runs" / "corpus"
  _fails(["data", "generate", "--model", "nope", "--out", str(new)], capsys, "unknown model 'nope'")
  assert not (tmp_path / "runs").exists()
  mine = tmp_path / "mine"
  mine.mkdir()
  (mine / "notes.txt").write_text("mine")
  _fails(["data", "generate", "--model", "nope", "--out", str(mine)], capsys, "unknown model")
  assert (mine / "notes.txt").read_text() == "mine"


# ----------------------------------------------------------------------------- specjax train


@pytest.mark.parametrize("kind", ["draft", "medusa", "heads"])
@pytest.mark.parametrize("argv,match", [
    (["--lr", "nan"], "--lr nan is invalid: must be a finite number in (0, inf)"),
    (["--lr", "0"], "--lr 0.0 is invalid"),
    (["--held-out", "1"], "--held-out 1.0 is invalid: must be a finite number in [0, 1)"),
    (["--steps", "0"], "--steps 0 is invalid: must be an integer >= 1"),
    (["--seq-len", "1"], "--seq-len 1 is invalid"),
    (["--seed", "-3"], "--seed -3 is invalid"),
    (["--grad-clip", "-1"], "--grad-clip -1.0 is invalid"),
])
def test_train_flags(kind, argv, match, tmp_path, capsys, no_load):
  out = tmp_path / "run"
  _fails(["train", kind, "--corpus", str(tmp_path), "--out-dir", str(out), *argv], capsys, match)
  assert not out.exists()


@pytest.mark.parametrize("kind,export", [
    ("draft", "{file}/draft.npz"), ("draft", "{tmp}/draft.bin"), ("draft", "{tmp}"),
    ("medusa", "{file}/heads.npz"), ("heads", "{file}/heads-{{kind}}.npz"),
    ("eagle", "/proc/heads.npz"),
])
def test_train_export_is_checked_before_training(kind, export, tmp_path, capsys, no_load):
  """An export that cannot be written fails at once, not after the training (and creates no
  out folder); the corpus is not even read."""
  file = tmp_path / "a-file"
  file.write_text("x")
  export = export.format(file=file, tmp=tmp_path)
  out = tmp_path / "run"
  err = _fails(["train", kind, "--corpus", str(tmp_path / "no-corpus"), "--out-dir", str(out),
                "--export", export], capsys, "specjax: error: export=")
  assert any(m in err for m in ("is a file, not a folder", "must end in .npz", "is a folder",
                                "is not writable")), err
  assert not out.exists()


@pytest.mark.parametrize("kind", ["draft", "mtp"])
def test_failed_train_removes_only_the_folder_it_created(kind, tmp_path, capsys, no_load):
  """No corpus there: the run fails after making its out folder, and removes it (the folders
  above it that it made too); a folder that was there before stays."""
  new = tmp_path / "runs" / kind
  _fails(["train", kind, "--corpus", str(tmp_path / "no-corpus"), "--out-dir", str(new)], capsys,
         "is not a corpus directory")
  assert not (tmp_path / "runs").exists()
  mine = tmp_path / "mine"
  mine.mkdir()
  _fails(["train", kind, "--corpus", str(tmp_path / "no-corpus"), "--out-dir", str(mine)], capsys,
         "is not a corpus directory")
  assert mine.is_dir()


def test_num_heads_flag(capsys, tmp_path, no_load):
  _fails(["train", "heads", "--corpus", str(tmp_path), "--num-heads", "medusa=x"], capsys,
         "--num-heads='medusa=x' is invalid: kind=count pairs like medusa=4,mtp=2")
  assert os.listdir(tmp_path) == []
