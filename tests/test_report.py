"""specjax.report: README.md's results block is generated from the experiments' results files, and
`--check` catches a hand edit (run here on the real README, so CI fails on one)."""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest

from specjax import bench, report

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _cell(speedup, tau, identical=True, tok_s=None, same_as_ar=None):
  c = {"speedup": speedup, "tau": tau, "identical": identical, "cases": 1, "tok_s": tok_s}
  return c if same_as_ar is None else dict(c, same_as_ar=same_as_ar)


FIXTURE = {
    "info": {"date": "2026-01-02 03:04", "processor": "Some CPU", "cores": 2, "device": "cpu",
             "jax": "0.0.1", "load_average": [1.5, 1.0, 0.5], "load_average_end": [2.25, 1, 1],
             "run_s": 123.4, "command": "python experiments/spec_bench/run.py --quick"},
    "model": "tiny", "num_prompts": 1, "max_new_tokens": 32, "repeats": 1,
    "categories": ["mt_bench", "humaneval"],
    "methods": {"autoregressive": "baseline", "prompt-lookup": "PromptLookup(ngram=3)",
                "medusa": "Medusa, 3 nodes"},
    "summary": {
        "autoregressive": {"mt_bench": _cell(1.0, 1.0, tok_s=40.25),
                           "humaneval": _cell(1.0, 1.0, tok_s=50.0),
                           "overall": _cell(1.0, 1.0, tok_s=45.0)},
        "prompt-lookup": {"mt_bench": _cell(0.8125, 1.25), "humaneval": _cell(1.5, 2.0),
                          "overall": _cell(1.0, 1.5)},
        "medusa": {"mt_bench": _cell(0.5, 1.125, False), "humaneval": _cell(0.75, 1.5),
                   "overall": _cell(0.625, 1.25)},
    },
}


# The first source: a run on the GGUF's blocks, with llama.cpp rows beside it.
BLOCKS = copy.deepcopy(FIXTURE)
BLOCKS["info"].update(weights="blocks", activations="float32")
BLOCKS["external"] = ["llama.cpp", "llama.cpp prompt-lookup 2"]
BLOCKS["methods"].update({"llama.cpp": "llama.cpp 9.9, 2 threads",
                          "llama.cpp prompt-lookup 2": "llama.cpp 9.9, prompt lookup 2"})
BLOCKS["summary"].update({
    "llama.cpp": {"mt_bench": _cell(1.25, 1.0, None, same_as_ar=0.5),
                  "humaneval": _cell(0.875, 1.0, None, same_as_ar=1.0),
                  "overall": _cell(1.125, 1.0, None, same_as_ar=0.75)},
    "llama.cpp prompt-lookup 2": {"mt_bench": _cell(2.0, 1.5, None, same_as_ar=0.25),
                                  "humaneval": _cell(0.5, 1.25, None, same_as_ar=0.25),
                                  "overall": _cell(1.0, 1.375, None, same_as_ar=0.25)}})


@pytest.fixture
def tree(tmp_path):
  """A repository root with BLOCKS at the first source's path, the fixture at every other, and a
  README holding an empty results block."""
  for rel in report.SOURCES:
    src = tmp_path / rel
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_text(json.dumps(BLOCKS if rel == report.SOURCES[0] else FIXTURE))
  readme = tmp_path / "README.md"
  readme.write_text(f"# title\n\nbefore\n\n{report.BEGIN}\nold\n{report.END}\n\nafter\n")
  return tmp_path


def test_block_from_fixture(tree):
  block = report.build(str(tree))
  lines = block.splitlines()
  assert lines[0] == report.BEGIN and lines[-1] == report.END
  assert "| method | MT-Bench | HumanEval | all sets |" in lines
  # the baseline's tokens/s first, then a row per method: "speedup x (tau)", above 1x in bold
  rows = [l for l in lines if l.startswith("| ")]
  first, rest = rows[:6], rows[6:]
  assert rest == rest[:4] * (len(report.SOURCES) - 1)  # a table per source, in SOURCES' order
  assert rest[1:4] == ["| autoregressive (float32), tokens/s | 40.2 | 50.0 | 45.0 |",
                       "| prompt-lookup | 0.81x (1.25) | **1.50x (2.00)** | 1.00x (1.50) |",
                       "| medusa | 0.50x (1.12) | 0.75x (1.50) | 0.62x (1.25) |"]
  flat = " ".join(block.split())  # the notes are wrapped at 100 characters
  assert ("Source: `experiments/spec_bench/results_quick.json`, 2026-01-02 03:04; Some CPU, 2 cores "
          "(cpu, jax 0.0.1); load average 1.5 at start, 2.2 at end; run 123 s. Command: "
          "`python experiments/spec_bench/run.py --quick`.") in flat
  assert all(len(l) <= 100 for l in lines if not l.startswith("| "))
  assert "tiny, greedy, batch 1, 1 prompt(s) per set, 32 new tokens" in flat
  assert "prompt-lookup: PromptLookup(ngram=3); medusa: Medusa, 3 nodes." in flat
  assert "NOT token-identical to autoregressive: medusa on MT-Bench." in flat
  assert ("**tiny on the float32 path (the GGUF's weights dequantized to float32): MT-Bench, "
          "HumanEval, 1 prompt(s) per set x 32 tokens**") in flat


def test_first_table_names_its_baseline_and_shows_llama_cpp_as_speedup_alone(tree):
  """The blocks run: the title and the first row name the baseline's arithmetic; llama.cpp
  rows are marked, carry no tau, are described once, and their agreement is reported."""
  block = report.build(str(tree))
  rows = [l for l in block.splitlines() if l.startswith("| ")][:6]
  assert rows[1:] == [
      "| autoregressive (GGUF blocks), tokens/s | 40.2 | 50.0 | 45.0 |",
      "| prompt-lookup | 0.81x (1.25) | **1.50x (2.00)** | 1.00x (1.50) |",
      "| medusa | 0.50x (1.12) | 0.75x (1.50) | 0.62x (1.25) |",
      "| llama.cpp (not exact) | **1.25x** | 0.88x | **1.12x** |",
      "| llama.cpp prompt-lookup 2 (not exact) | **2.00x** | 0.50x | 1.00x |"]
  flat = " ".join(block.split())
  first = flat[:flat.index(f"Source: `{report.SOURCES[1]}`")]
  assert ("**tiny on the GGUF's own quantized blocks (weights=\"blocks\"), float32 activations: "
          "MT-Bench, HumanEval, 1 prompt(s) per set x 32 tokens**") in first
  assert "Methods: prompt-lookup: PromptLookup(ngram=3); medusa: Medusa, 3 nodes." in first
  assert ("llama.cpp: llama.cpp 9.9, 2 threads; 0.50-1.00 of the autoregressive tokens before "
          "the first difference, per set; llama.cpp prompt-lookup 2: llama.cpp 9.9, prompt "
          "lookup 2; 0.25 of the autoregressive tokens") in first
  assert "Every specjax method's greedy output was token-identical" not in first  # medusa differs
  assert "(not exact)" not in flat[len(first):]  # the float32 tables have no llama.cpp rows


def test_arithmetic_names_what_the_target_computed_with():
  assert report.arithmetic({}) == report.arithmetic({"weights": "float32"})  # the old default
  assert report.arithmetic({"weights": "blocks", "activations": "int8"}, short=True) == \
      "GGUF blocks, int8 activations"
  with pytest.raises(report.ReportError, match="weights='bf16'"):
    report.arithmetic({"weights": "bf16"})


def test_missing_command_is_said_not_invented(tree):
  for rel in report.SOURCES:
    src = tree / rel
    data = json.loads(src.read_text())
    del data["info"]["command"], data["info"]["run_s"]
    src.write_text(json.dumps(data))
  flat = " ".join(report.build(str(tree)).split())
  assert f"Command: {report.NO_COMMAND}." in flat
  assert "; run " not in flat


def test_rewrite_is_idempotent_and_check_follows(tree, capsys):
  readme = tree / "README.md"
  args = ["--root", str(tree), "--readme", str(readme)]
  assert report.main(args + ["--check"]) == 1  # "old" is stale
  assert report.main(args) == 0
  once = readme.read_text()
  assert once.startswith("# title\n\nbefore\n\n") and once.endswith("\n\nafter\n")
  assert report.main(args) == 0
  assert readme.read_text() == once
  assert report.main(args + ["--check"]) == 0
  readme.write_text(once.replace("0.81x", "0.91x"))  # a hand edit inside the block
  assert report.main(args + ["--check"]) == 1
  assert "stale or was edited by hand" in capsys.readouterr().err


def test_errors_name_the_file(tree):
  with pytest.raises(report.ReportError, match="markers"):
    report.splice("no block here", "x", "R.md")
  bad = tree / "bad.json"
  bad.write_text(json.dumps({"rows": []}))
  with pytest.raises(report.ReportError, match="bad.json: no summary, categories, info"):
    report.load_source(str(bad))


def test_real_readme_is_current(tmp_path):
  """The shipped README's block equals what its sources give, and a hand edit is caught."""
  assert report.main(["--check"]) == 0
  copy = tmp_path / "README.md"
  shutil.copy(os.path.join(ROOT, "README.md"), copy)
  text = copy.read_text()
  inside = text[text.index(report.BEGIN):text.index(report.END)]
  edited = inside.replace("x (", "x  (", 1)
  assert edited != inside
  copy.write_text(text.replace(inside, edited))
  assert report.main(["--check", "--readme", str(copy)]) == 1


def test_command_line_is_relative_to_the_repository():
  root = os.path.dirname(os.path.dirname(os.path.abspath(bench.__file__)))
  run = os.path.join(root, "experiments", "spec_bench", "run.py")
  assert bench.command_line([run, "--quick", "--out", os.path.join(root, "x")]) == \
      "python experiments/spec_bench/run.py --quick --out x"
  assert bench.command_line([os.path.join(root, "specjax", "report.py"), "--check"]) == \
      "python -m specjax.report --check"
  assert bench.command_line(["/somewhere/bin/specjax", "demo"]) == "specjax demo"
  assert bench.command_line([run, "--prompts", "a b"]).endswith("--prompts 'a b'")


ACCEL = {
    "device": {"device_kind": "Some GPU", "platform": "gpu", "jax": "0.0.2",
               "machine": {"date": "2026-01-03 04:05"}},
    "lossless": {"target": "tiny", "rows": [
        {"method": "autoregressive", "dtype": "float32", "status": "ok", "identical": True,
         "ties": 0, "failures": 0},
        {"method": "prompt-lookup", "dtype": "float32", "status": "ok", "identical": True,
         "ties": 0, "failures": 0},
        {"method": "prompt-lookup", "dtype": "bfloat16", "status": "ok", "identical": False,
         "ties": 2, "failures": 0},
        {"method": "medusa", "dtype": "bfloat16", "status": "ok", "identical": False,
         "ties": 0, "failures": 1}]},
    "methods": {"target": "small shape", "rows": [
        {"method": "autoregressive", "status": "ok", "round_in_ar_steps": 1.0, "tau_cpu": 1.0,
         "speedup_if_tau_cpu": 1.0},
        {"method": "prompt-lookup", "status": "ok", "round_in_ar_steps": 1.25, "tau_cpu": 1.5,
         "speedup_if_tau_cpu": 1.2},
        {"method": "medusa", "status": "skipped: past the time budget (--budget)"}]},
    "ar_vs_roofline": {"copy_bandwidth_gbs": 1000.0,
                       "big": {"status": "ok", "tokens_per_s": 100.0,
                               "fraction_of_roofline": 0.75},
                       "small": {"status": "skipped: past the time budget (--budget)"}},
    "ar_vs_transformers": {"big": {"status": "ok", "speedup": 1.5}},
    "cost_curve": {"big": {"status": "ok", "c": {"1": 1.0, "16": 1.05, "64": 1.25}}},
    "command": "python experiments/accelerator/run.py", "run_s": 99.0,
}


def test_accelerator_column_reads_the_gpu_check(tree):
  """The GPU check's file adds a table after the Spec-Bench ones: lossless per dtype (identical,
  lossless with ties, or FAILED), the round's cost and the predicted speedup, and autoregressive
  decoding against the roofline and transformers; absent file, no table."""
  assert "On one GPU" not in report.build(str(tree))
  path = tree / report.ACCELERATOR
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(ACCEL))
  block = report.build(str(tree))
  assert block.index("On one GPU (Some GPU, jax 0.0.2)") > block.index("MT-Bench")
  assert "| autoregressive | identical | - | 1.00 | 1.00 | 1.00 |" in block
  assert "| prompt-lookup | identical | lossless (2 tie(s)) | 1.25 | 1.50 | 1.20 |" in block
  assert "| medusa | - | **FAILED** (ok, 1 failure(s)) | - | - | - |" in block
  flat = " ".join(block.split())
  assert "big-shaped (random weights) 100.0 tok/s, 0.75 of the memory roofline, 1.50x " \
         "transformers' `generate`; c(16) 1.05, c(64) 1.25" in flat
  assert "small-shaped" not in flat
  assert "Source: `experiments/accelerator/results.json`, 2026-01-03 04:05; " \
         "`python experiments/accelerator/run.py` (99.0 s)." in flat
  path.write_text(json.dumps({"device": {}}))
  with pytest.raises(report.ReportError, match="results.json: no lossless, methods"):
    report.build(str(tree))
