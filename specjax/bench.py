"""Timing protocol, statistics and tables.

Protocol (`run_cases`; `specjax bench`, experiments/spec_bench and experiments/scaling use it):
every method runs the same prompts in the same process; for each prompt (or batch of prompts)
the methods run one after another with a baseline run before each and after the last, `repeats`
rounds; each (method, program shape) is compiled and warmed once; a time is the compiled
program's wall time, and each method run is compared with the baseline runs around it
(`rescore`). `summarize` reports, per group of prompts, the median over prompts of the
per-prompt ratios, tau pooled over the group, and whether greedy outputs were token-identical
to the baseline's. Speedups are ratios of times measured in this same run, never against a
number from another day. Timing lives here and in experiments/, never in unit tests.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import sys
import time
from typing import Callable, Sequence

import numpy as np

from specjax import distributed
# The prompt sets live in specjax/prompts.py; the CLI and the experiments read them from here too.
from specjax.prompts import (MT_BENCH_CATEGORIES, PROMPT_SETS,  # noqa: F401
                             SPEC_BENCH_CATEGORIES, check_prompt_set, load_prompt_set,
                             load_prompt_sets, spec_bench_categories)


# The CPU arithmetics a GGUF target runs in, as `load_model` keywords: float32 weights, the
# file's blocks times float32 activations, and llama.cpp's W4A8 (the blocks times int8 blocks).
ARITHMETICS = {"float32": {}, "blocks": {"weights": "blocks"},
               "w4a8": {"weights": "blocks", "activations": "int8"}}


def median(xs: Sequence[float]) -> float:
  return float(statistics.median(xs)) if len(xs) else float("nan")


def agreement(rows: Sequence[Sequence[int]], ref: Sequence[Sequence[int]]) -> tuple[float, float]:
  """How closely token rows follow reference rows (greedy output of an inexact configuration
  against exact decoding's): (the share of rows identical to their reference, the share of the
  reference's tokens that come before each row's first difference)."""
  if len(rows) != len(ref) or not len(ref):
    raise ValueError(f"agreement needs as many rows as references (>= 1): {len(rows)} vs {len(ref)}")
  same = total = whole = 0
  for a, b in zip(rows, ref):
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    same, total, whole = same + n, total + len(b), whole + (list(a) == list(b))
  return whole / len(ref), same / max(total, 1)


def time_call(fn: Callable[[], object], repeats: int) -> list[float]:
  out = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    out.append(time.perf_counter() - t0)
  return out


def measure_read_bandwidth(nbytes: int = 512 << 20, repeats: int = 7) -> float:
  """Best-of-n memory read bandwidth in bytes/s, from a jitted sum over a large float32 array
  (XLA uses every core, as the decode step does)."""
  import jax
  import jax.numpy as jnp

  x = jnp.ones((nbytes // 4,), jnp.float32)
  f = jax.jit(jnp.sum)
  f(x).block_until_ready()
  best = min(time_call(lambda: f(x).block_until_ready(), repeats))
  return nbytes / best


def measure_cost_curve(model, sizes=(1, 2, 4, 8, 16, 32, 64), *, cache_len: int = 512,
                       filled: int = 256, reps: int = 9) -> dict[int, float]:
  """c(T): the time of one T-token forward (model.apply, batch 1, a cache of `cache_len` slots
  with `filled` entries) over the time of a 1-token forward, medians of `reps` interleaved runs,
  measured now (`specjax.calibrate.measure`; `calibrate.cost_curve` is the cached curve the
  methods' defaults and method="auto" read)."""
  from specjax import calibrate

  return calibrate.measure(model, sizes, cache_len=cache_len, filled=filled, reps=reps)


def save_report(out_dir: str, stem: str, data: dict, markdown: str,
                plot: Callable | None = None) -> dict[str, str]:
  """Writes an experiment's raw results `stem.json`, its table `stem.md` and, when `plot` is
  given, `stem.png` (plot(fig) draws on a fresh matplotlib figure; the Agg backend, no display).
  Every file is written under a temporary name and renamed, so a killed run leaves the previous
  report whole, and by process 0 alone under jax.distributed. Returns {"json": path, "md": path[, "png": path]}."""
  import json

  os.makedirs(out_dir, exist_ok=True)
  paths = {"json": os.path.join(out_dir, f"{stem}.json"), "md": os.path.join(out_dir, f"{stem}.md")}

  def put(path, write):  # by process 0 only under jax.distributed; the others wait for it
    distributed.write_once(path, write, f"report {os.path.basename(path)}")

  put(paths["json"], lambda p: open(p, "w").write(json.dumps(data, indent=1, default=_jsonable)))
  put(paths["md"], lambda p: open(p, "w").write(markdown.rstrip() + "\n"))
  if plot is not None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(7, 4.5))
    plot(fig)
    fig.tight_layout()
    paths["png"] = os.path.join(out_dir, f"{stem}.png")
    put(paths["png"], lambda p: fig.savefig(p, dpi=110, format="png"))
    plt.close(fig)
  return paths


def _jsonable(x):
  if isinstance(x, np.generic):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  return str(x)


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
  """rows of dicts; columns (key, header, format) -> an aligned plain-text table. None -> "-",
  booleans -> "yes" / "no"."""
  cells = [[h for _, h, _ in columns]]
  for r in rows:
    cells.append([_cell(r.get(k), f) for k, _, f in columns])
  widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
  lines = ["  ".join(c[i].rjust(widths[i]) if i else c[i].ljust(widths[i])
                     for i in range(len(columns))) for c in cells]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return "\n".join(lines)


def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
  """rows of dicts; columns (key, header, format) -> a GitHub markdown table. None -> "-",
  booleans -> "yes" / "no"."""
  lines = ["| " + " | ".join(h for _, h, _ in columns) + " |",
           "|" + "|".join("---" for _ in columns) + "|"]
  for r in rows:
    lines.append("| " + " | ".join(_cell(r.get(k), f) for k, _, f in columns) + " |")
  return "\n".join(lines)


def _cell(v, fmt: str) -> str:
  if v is None:
    return "-"
  if isinstance(v, (bool, np.bool_)):
    return "yes" if v else "no"
  return format(v, fmt)


def machine_info() -> dict:
  """Where and when a measurement ran: date, CPU, cores, load average, jax and its device."""
  import platform

  import jax

  load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
  return {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.machine(),
          "processor": platform.processor() or _cpu_model(), "cores": os.cpu_count(),
          "load_average": [round(x, 2) for x in load], "jax": jax.__version__,
          "device": str(jax.devices()[0].device_kind), "command": command_line()}


def command_line(argv: Sequence[str] | None = None) -> str:
  """The command that is running, as a reader would retype it from the repository root: "python"
  and the script's path relative to the root (paths under the root made relative too), so a
  results file says how it was made without naming the machine's directories."""
  import shlex

  argv = list(sys.argv if argv is None else argv)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

  def rel(a: str) -> str:
    key, eq, value = a.partition("=") if a.startswith("--") else ("", "", a)
    if os.path.isabs(value) and os.path.abspath(value).startswith(root + os.sep):
      value = os.path.relpath(value, root)
    return key + eq + value

  script, rest = (argv[0] if argv else ""), [rel(a) for a in argv[1:]]
  if script == "-c":
    return shlex.join(["python", "-c"] + rest)
  if not script.endswith(".py"):  # a console script: `specjax demo`
    return shlex.join([os.path.basename(script)] + rest)
  script = rel(script)
  if script.startswith("specjax" + os.sep):  # run with python -m
    return shlex.join(["python", "-m", script[:-3].replace(os.sep, ".")] + rest)
  return shlex.join(["python", script] + rest)


def relative_path(path: str) -> str:
  """A path as a results file records it: relative to the repository root (e.g.
  "../shared/data/prompts/mt_bench.jsonl"), so no machine's directories end up in the project."""
  if not path:
    return path
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return os.path.relpath(os.path.abspath(path), root)


def machine_summary(m: dict) -> str:
  """One line for a report: "date; CPU (N cores); load average [..] at start, [..] at end; run
  S s". Reads machine_info()'s keys plus "load_average_end" / "run_s" when the run added them,
  and the older experiment JSONs' keys (cpu, loadavg, loadavg_end)."""
  cpu = m.get("processor") or m.get("cpu") or m.get("machine", "?")
  line = f"{m.get('date', '?')}; {cpu} ({m.get('cores', '?')} cores); load average " \
         f"{m.get('load_average', m.get('loadavg'))} at start"
  end = m.get("load_average_end", m.get("loadavg_end"))
  if end is not None:
    line += f", {end} at end"
  if m.get("run_s") is not None:
    line += f"; run {m['run_s']} s"
  return line


def finish_machine_info(info: dict, t_start: float) -> dict:
  """Adds the load average at the end and the run's duration to a machine_info() dict."""
  info["load_average_end"] = machine_info()["load_average"]
  info["run_s"] = round(time.time() - t_start, 1)
  return info


def alternating_autoregressive(models: dict, prompts: Sequence, *, chat: bool,
                               max_new_tokens: int, repeats: int) -> dict:
  """{name: tok/s} of autoregressive decoding by each of `models` (several arithmetics of one
  checkpoint) over whole calls (prefill included; compiling in an untimed first call), the
  models alternating within each repeat so load falls on all alike; the fastest repeat kept."""
  import specjax as sj

  kw = dict(max_new_tokens=max_new_tokens, chat=chat, stop_at_eos=False)
  best = {name: float("inf") for name in models}
  for m in models.values():
    sj.generate(m, list(prompts[:1]), **kw)
  for _ in range(repeats):
    for name, m in models.items():
      t0 = time.perf_counter()
      for p in prompts:
        sj.generate(m, [p], **kw)
      best[name] = min(best[name], time.perf_counter() - t0)
  return {name: len(prompts) * max_new_tokens / t for name, t in best.items()}


def paired(method_run: Callable, ar_run: Callable, repeats: int):
  """The method and autoregressive decoding alternately, `repeats` times each, on one prompt ->
  (the method's first output, its fastest wall time, autoregressive's fastest). The fastest run
  is the least disturbed one: on a shared CPU a single run now and then takes 2-3x as long, and
  alternating puts both sides of the ratio under the same minutes of load. A run that compiled
  its program is a warm-up, discarded and repeated (as in `run_cases`): a fresh program's first
  run is slower than a warm one."""
  def warm(run):
    out = run()
    return run() if out.stats.get("compile_time_s", 0) > 0 else out

  outs, ar = [], []
  for _ in range(repeats):
    outs.append(warm(method_run))
    ar.append(warm(ar_run).stats["wall_time_s"])
  return outs[0], min(o.stats["wall_time_s"] for o in outs), min(ar)


def with_defaults(args, quick: bool, full: dict, short: dict):
  """An experiment's argparse namespace with every option left unset (None) taken from `short`
  (--quick) or `full`: options given on the command line win."""
  for k, v in (short if quick else full).items():
    if getattr(args, k) is None:
      setattr(args, k, v)
  return args


def read_saved(path: str) -> tuple[dict, str, str]:
  """An earlier run's results JSON -> (its data, its folder, its file stem)."""
  import json

  with open(path) as f:
    data = json.load(f)
  return data, os.path.dirname(os.path.abspath(path)), os.path.splitext(os.path.basename(path))[0]


def rerender(path: str, markdown: Callable[[dict], str], plot: Callable | None = None) -> dict:
  """Rewrites a results JSON's .md (markdown(data)) and .png (plot(fig, data)) beside it from the
  JSON alone, after a change to an experiment's tables or plots."""
  data, out, stem = read_saved(path)
  save_report(out, stem, data, markdown(data),
              plot=None if plot is None else (lambda fig: plot(fig, data)))
  return data


def publish(out_dir: str, stem: str, data: dict, markdown: Callable[[dict], str],
            plot: Callable | None = None) -> dict[str, str]:
  """An experiment's last step: `save_report` of data with its table markdown(data) and figure
  plot(fig, data), the table printed and the files named. Returns the paths."""
  md = markdown(data)
  paths = save_report(out_dir, stem, data, md,
                      plot=None if plot is None else (lambda fig: plot(fig, data)))
  print(md)
  print("wrote", ", ".join(paths.values()))
  return paths


def rescore_saved(path: str, report: Callable[[dict, str, str], dict]) -> dict:
  """Reads an earlier run's results JSON (run_cases records) and hands it to
  report(data, out_dir, stem) to be scored again and rewritten beside it."""
  data, out, stem = read_saved(path)
  data.setdefault("model", data["args"]["model"])
  data.setdefault("repeats", data["args"]["repeats"])
  return report(data, out, stem)


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
  except OSError:
    return ""


# ----------------------------------------------------------------------------- the protocol

OVERALL = "overall"


@dataclasses.dataclass
class Case:
  """One timed call: `prompts` (B rows: strings or token-id lists) decoded as one batch.

  chat: wrap string prompts in the model's chat template; group: the label results are
  summarised by (a category, a batch size, a prompt length); meta: copied into its records.
  """
  prompts: list
  chat: bool = True
  group: object = ""
  meta: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class External:
  """A decoder outside specjax that `run_cases` times among the methods (llama.cpp, in
  experiments/spec_bench): generate(model, prompts, **sj.generate's keywords) returns what
  sj.generate does (.tokens; .stats with wall_time_s, compile_time_s > 0 on a warm-up call,
  new_tokens, target_calls_per_row, prompt_bucket). Other arithmetic may give other greedy
  tokens, so its records' `identical` is None and `same_as_ar` says how far they agree."""
  generate: Callable


def run_cases(model, cases: Sequence[Case], methods: dict, *, max_new_tokens: int = 128,
              temperature: float = 0.0, repeats: int = 1, baseline: str = "autoregressive",
              stop_at_eos: bool = False, progress: bool = True, desc: str = "bench") -> list[dict]:
  """The timing protocol every benchmark here uses. Returns one record per (method, case).

  For each case (one batch of prompts), in each of `repeats` rounds, the methods decode it one
  after another with a baseline run (same batch, same seed) before each and after the last, so
  load from other processes falls on both sides of a ratio alike; `rescore` turns the times
  into ratios (each method run against a robust line through the baseline runs around it,
  unmoved by one disturbed run, following load that drifts). A time is `generate`'s wall time
  of the compiled program (tokenising, compiling and detokenising excluded); a call that
  compiled a program is a warm-up: its run is discarded and repeated, so every (method, program
  shape) is compiled and warmed once. Fixed-length generation by default (stop_at_eos=False):
  every method emits the same number of tokens.

  Records: method, case, group, meta..., batch, prompt_bucket, new_tokens, target_calls, tau
  (new tokens per target call, prefill included), time_s (median of its runs), times_s,
  base_time_s and ratio (see `rescore`), tok_s, identical (greedy: every run's tokens equal the
  baseline's; None when sampling), compile_s. An `External` method's greedy records have
  same_as_ar instead of identical (`agreement`'s share of tokens before the first difference).
  """
  import specjax as sj
  from specjax.errors import InputError, check_int
  from tqdm.auto import tqdm

  if baseline not in methods:
    raise InputError(f"baseline {baseline!r} is not among the methods ({', '.join(methods)})")
  check_int("repeats", repeats, 1)
  others = [n for n in methods if n != baseline]
  per_round = 2 * len(others) + 1
  records = []
  bar = tqdm(total=len(cases) * repeats * per_round, desc=desc, unit="run", disable=not progress)
  for ci, case in enumerate(cases):
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, chat=case.chat,
              stop_at_eos=stop_at_eos, seed=ci)
    outs = {name: [] for name in methods}
    compile_s = {name: 0.0 for name in methods}

    def run(name):
      bar.set_postfix_str(f"{case.group} {name}", refresh=False)
      m = methods[name]
      gen = functools.partial(m.generate, model, case.prompts) if isinstance(m, External) \
          else functools.partial(sj.generate, model, case.prompts, m)
      out = gen(**kw)
      if out.stats["compile_time_s"] > 0:  # a fresh program's first run pays one-off costs
        compile_s[name] += out.stats["compile_time_s"]
        out = gen(**kw)
      outs[name].append(out)
      bar.update()
      return out.stats["wall_time_s"]

    for _ in range(repeats):  # baseline, m1, baseline, m2, ..., mk, baseline
      for name in others:
        run(baseline)
        run(name)
      run(baseline)
    ref = outs[baseline][0].tokens
    for name in [baseline] + others:
      exact = temperature == 0 and not isinstance(methods[name], External)
      times = [o.stats["wall_time_s"] for o in outs[name]]
      st = outs[name][-1].stats
      calls = int(sum(st["target_calls_per_row"]))
      t = median(times)
      records.append({
          "method": name, "case": ci, "group": case.group, **case.meta,
          "batch": len(case.prompts), "prompt_bucket": st["prompt_bucket"],
          "new_tokens": st["new_tokens"], "target_calls": calls,
          "tau": st["new_tokens"] / max(1, calls), "time_s": t, "times_s": times,
          "tok_s": st["new_tokens"] / t,
          "identical": all(o.tokens == ref for o in outs[name]) if exact else None,
          **({"same_as_ar": agreement(outs[name][0].tokens, ref)[1]}
             if temperature == 0 and not exact else {}),
          "compile_s": compile_s[name]})
  bar.close()
  return rescore(records, baseline)


def rescore(records: list[dict], baseline: str = "autoregressive") -> list[dict]:
  """Sets each record's base_time_s and ratio (= base_time_s / time_s) from the run order of
  `run_cases`: per case, round by round, baseline runs around the method runs (b m1 b m2 .. mk b).
  A method run's baseline time is read, at its place in that order, off a robust straight line
  through the case's baseline runs (Theil-Sen: the median of the pairwise slopes): exact when
  load drifts linearly through a case, and one disturbed run (on this shared 2-core machine a
  run now and then takes 3x as long) does not move it. A method's ratio is the median over its
  rounds. Returns `records` (updated in place)."""
  cases: dict = {}
  for r in records:
    cases.setdefault(r["case"], []).append(r)
  for rs in cases.values():
    base = next(r for r in rs if r["method"] == baseline)
    others = [r for r in rs if r is not base]  # in run order
    base.update(base_time_s=base["time_s"], ratio=1.0)
    if not others:
      continue
    a = np.asarray(base["times_s"], float)
    n = len(a) // len(others[0]["times_s"])  # baseline runs per round: k + 1
    xs = np.arange(len(a))
    pairs = [(a[l] - a[j]) / (l - j) for j in range(len(a)) for l in range(j + 1, len(a))]
    slope = float(np.median(pairs)) if pairs else 0.0
    level = float(np.median(a - slope * xs))
    for i, r in enumerate(others):
      # m_(i+1) of round j runs between baseline runs j*n + i and j*n + i + 1
      bases = [level + slope * (j * n + i + 0.5) for j in range(len(r["times_s"]))]
      r.update(base_time_s=median(bases),
               ratio=median([b / t for b, t in zip(bases, r["times_s"])]))
  return records


def summarize(records: list[dict], *, baseline: str = "autoregressive", by: str = "group",
              overall: Sequence | None = None) -> dict:
  """method -> {group (the records' `by` value) and OVERALL -> cell}. A cell: speedup (median
  over cases of each case's ratio baseline time / method time; speedup_of_means:
  Spec-Bench's mean tok/s over the baseline's mean tok/s, for comparison), tau (all new
  tokens / all target calls), tok_s and ms_per_token (medians over cases), identical (every
  case's greedy tokens equal the baseline's; None when sampling) and cases. OVERALL pools the
  cases whose group is in `overall` (default: every case)."""
  base = {r["case"]: r for r in records if r["method"] == baseline}
  out: dict = {}
  for name in dict.fromkeys(r["method"] for r in records):
    mine = [r for r in records if r["method"] == name]
    groups = {g: [r for r in mine if r[by] == g] for g in dict.fromkeys(r[by] for r in mine)}
    groups[OVERALL] = [r for r in mine if overall is None or r[by] in overall]
    out[name] = {g: _cell_stats(rs, base) for g, rs in groups.items() if rs}
  return out


def _ratio(r: dict, base: dict) -> float:
  """A record's speedup: its ratio (run_cases), else the baseline record's time over its."""
  return r["ratio"] if "ratio" in r else base[r["case"]]["time_s"] / r["time_s"]


def _cell_stats(rs: list[dict], base: dict) -> dict:
  same = [r["identical"] for r in rs if r["identical"] is not None]
  shares = [r["same_as_ar"] for r in rs if r.get("same_as_ar") is not None]
  return {
      "speedup": median([_ratio(r, base) for r in rs]),
      # Spec-Bench's own figure (evaluation/speed.py): mean tok/s over mean baseline tok/s.
      "speedup_of_means": float(np.mean([r["tok_s"] for r in rs]) / np.mean(
          [r["new_tokens"] / r.get("base_time_s", base[r["case"]]["time_s"]) for r in rs])),
      "tau": sum(r["new_tokens"] for r in rs) / max(1, sum(r["target_calls"] for r in rs)),
      "tok_s": median([r["tok_s"] for r in rs]),
      "ms_per_token": 1e3 * median([r["time_s"] / max(1, r["new_tokens"]) for r in rs]),
      "identical": all(same) if same else None,
      **({"same_as_ar": float(np.mean(shares))} if shares else {}),
      "cases": len(rs),
  }


def bench_methods(model, prompts: list, methods: dict, *, max_new_tokens: int = 128,
                  repeats: int = 3, temperature: float = 0.0, chat: bool = False,
                  baseline: str | None = None, progress: bool = True) -> list[dict]:
  """Times each method on each prompt (batch 1) with `run_cases`. Returns one row per method with
  median tok/s, tau, speedup over `baseline` (default: the first method), greedy identity with
  it, and the per-prompt records ("raw")."""
  baseline = baseline or next(iter(methods))
  records = run_cases(model, [Case([p], chat) for p in prompts], methods,
                      max_new_tokens=max_new_tokens, temperature=temperature, repeats=repeats,
                      baseline=baseline, progress=progress)
  table = summarize(records, baseline=baseline)
  return [{"method": name, **table[name][OVERALL],
           "raw": [r for r in records if r["method"] == name]} for name in methods]


def bench_vs_transformers(model_name: str = "smollm2-135m", prompts: list[str] | None = None, *,
                          max_new_tokens: int = 128, repeats: int = 3, progress: bool = True) -> dict:
  """specjax autoregressive vs transformers' PyTorch generate on the same weights and prompts,
  greedy, batch 1, fixed length; plus the fraction of the memory-bandwidth bound."""
  import torch
  import transformers
  from tqdm.auto import tqdm

  import specjax as sj
  from specjax import weights

  model = sj.load_model(model_name)
  path = weights.resolve(model_name)
  if os.path.isdir(path):
    tm = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
  else:
    tm = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
  tm.eval()
  prompts = prompts or ["The capital of France is", "def fibonacci(n):",
                        "Explain in one paragraph why the sky is blue."]
  ids = [model.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
  sj_t, hf_t = [], []
  for p in tqdm(ids, desc="specjax vs transformers", disable=not progress):
    kw = dict(max_new_tokens=max_new_tokens, stop_at_eos=False)
    sj.generate(model, [p], **kw)
    sj_t.append(median(time_call(lambda: sj.generate(model, [p], **kw), repeats)))
    x = torch.tensor([p])
    am = torch.ones_like(x)
    with torch.no_grad():
      gen = lambda: tm.generate(x, attention_mask=am, max_new_tokens=max_new_tokens,
                                min_new_tokens=max_new_tokens, do_sample=False)
      gen()
      hf_t.append(median(time_call(gen, repeats)))
  bw = measure_read_bandwidth()
  sj_tps = max_new_tokens / median(sj_t)
  hf_tps = max_new_tokens / median(hf_t)
  bound_tps = bw / model.num_param_bytes
  return {
      "model": model_name, "dtype": model.dtype.name, "max_new_tokens": max_new_tokens,
      "prompts": len(ids), "repeats": repeats, "torch_threads": torch.get_num_threads(),
      "specjax_tok_s": sj_tps, "transformers_tok_s": hf_tps, "ratio": sj_tps / hf_tps,
      "weight_bytes": model.num_param_bytes, "read_bandwidth_GBs": bw / 1e9,
      "bound_tok_s": bound_tps, "fraction_of_bound": sj_tps / bound_tps,
      "specjax_s": sj_t, "transformers_s": hf_t,
  }
