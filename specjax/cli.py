"""`specjax generate | demo | bench | data | train`."""

from __future__ import annotations

import argparse
import json
import os
import sys

from specjax import distributed, validate
from specjax.errors import InputError

DEFAULT_MODEL = "smollm2-135m"


# ----------------------------------------------------------------------------- flag values
# argparse reads a flag's text as an int or a float; what values are allowed is checked here,
# after parsing and before anything loads, by the same checkers sj.generate and the trainers use
# (specjax.validate), named by flag: "--top-p 2.0 is invalid: must be a finite number in (0, 1]".
# main prints it as one line with exit status 2, like argparse's own errors.


def _int(lo: int, hi: int | None = None, what: str = ""):
  return lambda flag, value: validate.integer(flag, value, lo, hi, what)


def _num(lo: float | None, hi: float | None = None, what: str = "", **ends):
  return lambda flag, value: validate.number(flag, value, lo, hi, what=what, **ends)


def _seed(lo: int = validate.SEED_MIN):
  return lambda flag, value: validate.integer(flag, value, lo, validate.SEED_MAX,
                                              " (a 64-bit signed seed)" if lo < 0 else "")


def _numbers(kind, lo: float, hi: float | None = None, example: str = ""):
  """A comma-separated list flag ("0,0.7,1.0") -> its numbers, each checked like one flag."""
  def check(flag: str, text) -> list:
    noun = "integers" if kind is int else "numbers"
    rng = validate.int_range(lo, hi) if kind is int else validate.number_range(lo, hi)
    out = []
    for item in str(text).split(","):
      try:
        v = kind(item.strip())
        out.append(validate.integer("", v, lo, hi) if kind is int
                   else validate.number("", v, lo, hi))
      except (ValueError, InputError):
        raise InputError(f"{flag} {text!r} is invalid: {item.strip()!r} is not one of the comma-"
                         f"separated {noun} {rng} it must hold, e.g. {example}") from None
    return out
  return check


SAMPLING_FLAGS = {"--max-new-tokens": _int(1, validate.INT32_MAX),
                  "--temperature": _num(0, what=" (0 = greedy)"),
                  "--top-k": _int(0, validate.INT32_MAX, " (0 = off)"),
                  "--top-p": _num(0, 1, " (1 = off)", lo_open=True), "--seed": _seed()}
METHOD_FLAGS = {"--gamma": _int(0, what=" (0 = from the cost curve)"),
                "--exit-layer": _int(0, what=" (0 = a quarter of the layers)"),
                "--nodes": _int(0, what=" (0 = from the cost curve)")}
BENCH_FLAGS = {"--num-prompts": _int(1), "--batch-size": _int(1), "--repeats": _int(1),
               "--max-new-tokens": _int(1), "--temperature": _num(0, what=" (0 = greedy)")}
DATA_FLAGS = {"--tokens": validate.count, "--batch-size": _int(1, 4096),
              "--micro-batch": _int(1, 4096), "--max-new-tokens": _int(1, 1 << 16),
              "--temperatures": _numbers(float, 0, example="0,0.7,1.0"),
              "--max-minutes": _num(0, what=" (0 = no limit)"), "--seed": _seed(0),
              "--batch-sizes": _numbers(int, 1, 4096, example="1,16,32"),
              "--new-tokens": _int(1, 1 << 16)}
TRAIN_FLAGS = {"--vocab-size": _int(0), "--steps": _int(1), "--batch-size": _int(1),
               "--seq-len": _int(2), "--lr": _num(0, lo_open=True), "--warmup": _int(0),
               "--weight-decay": _num(0), "--grad-clip": _num(0), "--held-out": _num(0, 1,
               hi_open=True), "--ckpt-every": _int(1), "--eval-every": _int(1),
               "--max-minutes": _num(0, what=" (0 = no limit)"), "--seed": _seed(0),
               "--num-layers": _int(1), "--soft-top-k": _int(0, what=" (0 = corpus tokens)"),
               "--unroll": _int(1)}


def check_flags(args, rules: dict) -> None:
  """Checks (and normalises) each flag of `rules` that args has: flag -> check(flag, value),
  which returns the value to use or raises InputError naming the flag and the value."""
  for flag, check in rules.items():
    dest = flag[2:].replace("-", "_")
    if getattr(args, dest, None) is not None:
      setattr(args, dest, check(flag, getattr(args, dest)))


def _method_options(name: str, args) -> dict:
  """The CLI's settings of method `name` (a registry name) as its factory's options: everything
  else about building a method (defaults, the shipped drafter for the model) is the registry's
  (specjax.methods)."""
  if name == "draft":  # gamma / nodes 0: chosen from the cost curve (specjax/methods/defaults.py)
    return {"draft": args.draft, "gamma": args.gamma or None}
  if name == "layer-skip":
    return {"exit_layer": args.exit_layer or None, "gamma": args.gamma or None}
  if name in ("medusa", "mtp"):
    return {"heads": args.heads}
  if name == "eagle":
    return {"heads": args.heads, **({"num_nodes": args.nodes} if args.nodes else {})}
  return {}


def _registry_names() -> list[str]:
  """The registered method names (specjax.methods), autoregressive first."""
  from specjax import methods

  return methods.names()


def _add_sampling(p: argparse.ArgumentParser) -> None:
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--top-k", type=int, default=0)
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--chat", action="store_true", help="wrap prompts in the model's chat template")


def _add_method(p: argparse.ArgumentParser) -> None:
  from specjax import methods

  p.add_argument("--method", default="autoregressive",
                 help=f"{' | '.join(methods.names())} | auto (or an alias: self-spec, pld, ...; "
                 f"draft, medusa, eagle and mtp need a drafter: the one shipped for --model, or "
                 f"--draft / --heads; auto: the available method with the highest predicted "
                 f"tokens/s on this device)")
  _add_method_options(p)


def _add_method_options(p: argparse.ArgumentParser) -> None:
  """The methods' settings, shared by generate / demo (--method) and bench (--methods)."""
  p.add_argument("--draft", default="smollm2-135m-draft", help="the draft model of method draft")
  p.add_argument("--gamma", type=int, default=0, help="draft / layer-skip: tokens drafted per step "
                 "(0: chosen from this device's cost curve and the draft's recorded acceptance)")
  p.add_argument("--exit-layer", type=int, default=0, help="layer-skip: layers of the drafter "
                 "(0: a quarter of the model's)")
  p.add_argument("--heads", default=None,
                 help="heads for medusa / eagle / mtp: a shipped name, a .npz, or a published "
                 "drafter's file or directory (docs/drafters.md)")
  p.add_argument("--nodes", type=int, default=0,
                 help="eagle: tree nodes verified per step (0: chosen from this device's cost "
                 "curve and the heads' recorded acceptance; sj.Eagle's own default is 32)")


WEIGHTS_FLAG = dict(default="float32", choices=("float32", "blocks"),
                    help="blocks: a GGUF model's dense products read its quantized blocks as "
                    "stored (same numbers as float32, fewer bytes; see sj.load_model)")


ACTIVATIONS_FLAG = dict(default="float32", choices=("float32", "int8"),
                        help="int8 (with --weights blocks): activations quantized per block of 32 "
                        "and integer dot products against the GGUF's blocks, llama.cpp's W4A8 "
                        "(see sj.load_model)")


def _load(args):
  import specjax as sj

  return sj.load_model(args.model, weights=getattr(args, "weights", "float32"),
                       activations=getattr(args, "activations", "float32"),
                       mesh=getattr(args, "mesh", None))


def _add_distributed(p: argparse.ArgumentParser, mesh: bool = True) -> None:
  """--coordinator / --num-processes / --process-id (jax.distributed; each defaults to the
  variable JAX reads: $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES, $JAX_PROCESS_ID) and --mesh."""
  g = p.add_argument_group("many processes (jax.distributed; see docs/sharding.md)")
  g.add_argument("--coordinator", default=None, help="host:port of process 0's coordinator "
                 "(default $JAX_COORDINATOR_ADDRESS)")
  g.add_argument("--num-processes", type=int, default=None,
                 help="processes in the run (default $JAX_NUM_PROCESSES)")
  g.add_argument("--process-id", type=int, default=None,
                 help="this process's id, 0 .. num-processes - 1 (default $JAX_PROCESS_ID)")
  if mesh:
    g.add_argument("--mesh", default=None, help="load the model onto this device mesh, e.g. "
                   "data=2,model=4 (every process's devices; default: one device)")


def _start_distributed(args) -> None:
  """jax.distributed for this run, from the flags or JAX's variables (nothing without either)."""
  if hasattr(args, "coordinator"):
    distributed.initialize(args.coordinator, args.num_processes, args.process_id)


def _method_name(name: str) -> str:
  """--method NAME (or an alias) -> its registry name, or "auto"; InputError naming the
  available ones otherwise. Needs no model."""
  from specjax import auto, methods

  if auto.is_auto(name):
    return auto.NAME
  canonical = methods.canonical(name)
  if canonical is None:
    raise InputError(f"--method {name!r} is unknown; available: "
                     f"{', '.join(methods.names())}, auto")
  return canonical


def _make_method(name: str, model, args):
  """The registry's method `name` (or an alias) for model, with the CLI's settings; "auto": the
  method specjax.auto chooses (its choice is printed to stderr)."""
  from specjax import auto, methods

  canonical = _method_name(name)
  if canonical == auto.NAME:
    method, report = auto.choose(model)
    print(f"auto: {report['method']} {json.dumps(report['settings'], default=str)[:200]}, "
          f"predicted {report['predicted_speedup']:.2f}x", file=sys.stderr)
    return method
  return methods.build(canonical, model, **_method_options(canonical, args))


def _check_generate_args(args) -> str:
  """Every check of `specjax generate` that needs no model, so a bad argument fails in a moment
  rather than after the load (~10 s): the flags' values, the method name, the model name.
  Returns the method's registry name (or "auto")."""
  from specjax import weights

  check_flags(args, {**SAMPLING_FLAGS, **METHOD_FLAGS})
  name = _method_name(args.method)
  weights.check_model(args.model)  # an unknown model name fails here, before anything loads
  return name


def cmd_generate(args) -> None:
  """`specjax generate`: checks every argument, then loads (the model, and the method's drafter)
  and compiles, each with a progress line on stderr (bench.timed_step, as `specjax demo`)."""
  import specjax as sj
  from specjax import auto, bench, methods

  name = _check_generate_args(args)
  with bench.timed_step(f"loading {args.model}", stream=sys.stderr) as step:
    model = _load(args)
    step["note"] = str(model)
  if args.chat and getattr(model.tokenizer, "chat_template", None) is None:
    raise InputError(f"--chat: the tokenizer of {args.model!r} has no chat template; run "
                     f"without --chat")
  if name == auto.NAME:
    method = auto.NAME
  elif methods.REGISTRY[name].trained:  # its drafter loads (a draft model: seconds)
    with bench.timed_step(f"loading {name}'s drafter", stream=sys.stderr):
      method = _make_method(name, model, args)
  else:
    method = _make_method(name, model, args)
  with bench.timed_step(f"compiling and generating ({name}, {args.max_new_tokens} new tokens)",
                        stream=sys.stderr):
    out = sj.generate(model, args.prompt, method, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                      seed=args.seed, chat=args.chat)
  for p, t in zip(args.prompt, out.texts):
    print(f">>> {p}\n{t}\n")
  stats = {k: v for k, v in out.stats.items() if not isinstance(v, list)}
  print(json.dumps(stats, indent=1, default=str))


# Both fit one prompt-length bucket (<= 64 tokens with SmolLM2's chat template, tested), so each
# method compiles one program, not one per prompt.
DEMO_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Summarize in two sentences: The city council met on Tuesday to discuss new bike lanes. "
    "Residents supported the plan; shop owners worried about parking.",
]


def cmd_demo(args) -> None:
  """The main job on the embedded default model: generate with every available method and
  compare them with the autoregressive baseline in one run. Each method's compile (10-20 s) gets
  a progress line; both prompts share one length bucket, so the timed runs compile nothing more,
  and compiled programs are kept on disk for the next demo (bench.use_compile_cache)."""
  import specjax as sj
  from specjax import bench

  check_flags(args, {"--max-new-tokens": _int(1, validate.INT32_MAX), "--repeats": _int(1),
                     **METHOD_FLAGS})
  bench.use_compile_cache()
  with bench.timed_step(f"loading {args.model}") as step:
    model = _load(args)
    step["note"] = str(model)
  from tqdm import tqdm

  methods = {}
  # (building loads drafters and packs the quantized draft; the first measures the cost curve)
  bar = tqdm(_registry_names(), desc="choosing each method's settings", unit="method",
             file=sys.stderr, disable=None, leave=False)
  for name in bar:
    bar.set_postfix_str(name)
    try:
      methods[name] = _make_method(name, model, args)
    except Exception as e:  # e.g. a draft model that is not installed: show why, run the rest
      bar.write(f"(skipping {name}: {e})", file=sys.stdout)
  print(f"Compiling and running {len(methods)} methods on one prompt, greedy:", flush=True)
  warm = bench.warm_methods(model, methods, DEMO_PROMPTS[0], max_new_tokens=args.max_new_tokens)
  print(f"\n>>> {DEMO_PROMPTS[0]}\n{warm['autoregressive']['text']}\n")
  runs = len(DEMO_PROMPTS) * args.repeats * (2 * len(methods) - 1)
  print(f"Timing {runs} runs ({len(DEMO_PROMPTS)} prompts x {args.repeats} repeat(s), each method "
        f"beside autoregressive runs) ...", flush=True)
  rows = bench.bench_methods(model, DEMO_PROMPTS, methods, max_new_tokens=args.max_new_tokens,
                             repeats=args.repeats, chat=True, progress=sys.stdout.isatty())
  print("\nGreedy, batch 1, chat prompts, medians over prompts x repeats (same process):")
  print(bench.format_table(rows, [("method", "method", "s"), ("tok_s", "tok/s", ".1f"),
                                  ("tau", "tau", ".2f"), ("speedup", "speedup", ".2f"),
                                  ("identical", "greedy = AR", "")]))


def cmd_bench(args) -> None:
  """`specjax bench`: every method against autoregressive (or, with --vs-transformers, specjax's
  autoregressive decoding against transformers' PyTorch generate)."""
  if args.vs_transformers:
    _bench_vs_transformers(args)
  else:
    _bench_methods(args)


def _bench_vs_transformers(args) -> None:
  from specjax import bench

  r = bench.bench_vs_transformers(args.model, max_new_tokens=args.max_new_tokens,
                                  repeats=args.repeats)
  print(f"\n{args.model} {r['dtype']}, greedy, batch 1, {r['max_new_tokens']} new tokens, "
        f"{r['prompts']} prompts x {r['repeats']} repeats (medians), torch threads={r['torch_threads']}")
  print(bench.format_table([
      {"impl": "specjax (JAX/XLA)", "tok_s": r["specjax_tok_s"], "ratio": r["ratio"]},
      {"impl": "transformers (PyTorch)", "tok_s": r["transformers_tok_s"], "ratio": 1.0},
  ], [("impl", "implementation", "s"), ("tok_s", "tok/s", ".1f"), ("ratio", "vs transformers", ".2f")]))
  print(f"weights {r['weight_bytes'] / 1e6:.0f} MB/token, read bandwidth {r['read_bandwidth_GBs']:.1f} GB/s "
        f"-> bound {r['bound_tok_s']:.1f} tok/s; specjax reaches {100 * r['fraction_of_bound']:.0f}% of it")
  if args.json:
    _write_json(args.json, r)


BENCH_COLUMNS = [("method", "method", "s"), ("tok_s", "tok/s", ".1f"),
                 ("ms_per_token", "ms/token", ".1f"), ("tau", "tau", ".2f"),
                 ("speedup", "speedup", ".2f"), ("identical", "greedy = AR", "")]


def _write_json(path: str, data) -> None:
  """data as JSON at path, by process 0 alone under jax.distributed (the others wait for it)."""
  from specjax import bench

  text = json.dumps(data, indent=1, default=bench._jsonable)
  distributed.write_text_once(path, text)


def _write_csv(path: str, rows: list[dict]) -> None:
  """The bench summary table as CSV (BENCH_COLUMNS and the case count), written once."""
  import csv

  def write(tmp):
    with open(tmp, "w", newline="") as f:
      w = csv.writer(f)
      keys = [k for k, _, _ in BENCH_COLUMNS] + ["cases"]
      w.writerow(keys)
      for r in rows:
        w.writerow(["" if r.get(k) is None else r[k] for k in keys])

  distributed.write_once(path, write)


def _check_bench_args(args) -> list[str]:
  """Every check that needs no model, so a bad argument fails in a moment, before loading or
  compiling anything. Returns the method names (autoregressive first)."""
  from specjax import bench, weights

  check_flags(args, {**BENCH_FLAGS, **METHOD_FLAGS})
  from specjax import methods as registry

  names = [n.strip() for n in args.methods.split(",") if n.strip()] if args.methods else \
      registry.names()
  for n in names:
    if registry.canonical(n) is None and n.lower() != "auto":
      raise InputError(f"--methods: {n!r} is unknown; available: "
                       f"{', '.join(registry.names())}, auto")
  names = [registry.canonical(n) or "auto" for n in names]
  bench.check_prompt_set(args.prompts)
  for flag, path, ext in (("--json", args.json, ""), ("--csv", args.csv, ""),
                          ("--plot", args.plot, ".png")):
    if path and ext and not path.lower().endswith(ext):
      raise InputError(f"{flag} {path!r} is invalid: must end in {ext}")
    if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
      raise InputError(f"{flag} {path!r}: folder {os.path.dirname(os.path.abspath(path))!r} "
                       f"does not exist")
  weights.check_model(args.model)  # an unknown model name fails here, before anything loads
  return ["autoregressive"] + [n for n in dict.fromkeys(names) if n != "autoregressive"]


def _bench_methods(args) -> None:
  import specjax as sj
  from specjax import bench
  from specjax.errors import SpecJaxError

  names = _check_bench_args(args)
  explicit = bool(args.methods)
  # Read before the model loads: a prompt file without prompts fails in a moment.
  ps, chat = bench.load_prompt_set(args.prompts, args.num_prompts)
  print(f"Loading {args.model} ...", file=sys.stderr, flush=True)
  model = _load(args)
  methods = {}
  for name in names:
    try:
      m = _make_method(name, model, args)
      m.validate(model)
      methods[name] = m
    except SpecJaxError as e:
      if explicit:  # asked for by name: say why it cannot run here
        raise InputError(f"--methods {name}: cannot run on {args.model}: {e}") from e
      print(f"(skipping {name}: {e})", file=sys.stderr)
  used = {"set": ps.source, "path": bench.relative_path(ps.path), "count": len(ps)}  # what ran
  chat = chat and not args.no_chat
  b = args.batch_size
  calls = -(-len(ps) // b)
  ps = (ps * (calls * b // len(ps) + 1))[:calls * b]  # a short last call is filled up from the start
  cases = [bench.Case(ps[i * b:(i + 1) * b], chat, used["set"]) for i in range(calls)]
  if args.breakdown:
    return _bench_breakdown(args, model, methods, cases, used)
  records = bench.run_cases(model, cases, methods, max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature, repeats=args.repeats,
                            stop_at_eos=args.stop_at_eos, desc="bench")
  summary = bench.summarize(records)
  rows = [{"method": n, **summary[n][bench.OVERALL]} for n in methods]
  title = (f"{args.model}, {used['set']}: {len(ps)} prompt(s) in {calls} call(s) of {b}, "
           f"{args.max_new_tokens} new tokens, temperature {args.temperature:g}, {args.repeats} "
           f"timed run(s) per call; speedup = median per-call ratio to autoregressive")
  _print_rich_table(title, rows)
  data = {"args": {k: v for k, v in vars(args).items() if k != "fn"}, "prompts": used,
          "info": bench.machine_info(), "summary": rows, "records": records}
  if args.json:
    _write_json(args.json, data)
  if args.csv:
    _write_csv(args.csv, rows)
  if args.plot:
    _bench_plot(args.plot, title, rows)


BREAKDOWN_COLUMNS = [("method", "method", "s"), ("draft_ms", "draft ms", ".2f"),
                     ("verify_ms", "verify ms", ".2f"), ("other_ms", "other ms", ".2f"),
                     ("round_ms", "ms/round", ".2f"), ("draft_share", "draft %", ".0%"),
                     ("verify_share", "verify %", ".0%"), ("other_share", "other %", ".0%"),
                     ("tau", "tau", ".2f"), ("ms_per_token", "ms/token", ".2f")]


def _bench_breakdown(args, model, methods, cases, used) -> None:
  """`specjax bench --breakdown`: each method's time per round split into draft / verify /
  other (acceptance and bookkeeping), measured inside the compiled loop (specjax.breakdown), on
  the first call's prompts: one compile and one profiled run per method."""
  from specjax import bench, breakdown

  rows = []
  for name, method in methods.items():
    print(f"profiling {name} ...", file=sys.stderr, flush=True)
    r = breakdown.breakdown(model, cases[0].prompts, method, max_new_tokens=args.max_new_tokens,
                            chat=cases[0].chat, temperature=args.temperature,
                            stop_at_eos=args.stop_at_eos)
    ms = r["per_round_ms"]
    rnd = sum(ms.values())
    rows.append({"method": name, **{f"{p}_ms": ms[p] for p in breakdown.PHASES},
                 **{f"{p}_share": r["share"][p] for p in breakdown.PHASES}, "round_ms": rnd,
                 "tau": r["mean_accepted"], "ms_per_token": rnd / max(r["mean_accepted"], 1e-9),
                 "raw": r})
  print(f"\n{args.model} ({args.weights}), {used['set']}, one call of {len(cases[0].prompts)}, "
        f"{args.max_new_tokens} new tokens: time per round inside the compiled loop")
  print(bench.format_table(rows, BREAKDOWN_COLUMNS))
  if args.json:
    _write_json(args.json, {"args": {k: v for k, v in vars(args).items() if k != "fn"},
                            "prompts": used, "info": bench.machine_info(), "breakdown": rows})


def _print_rich_table(title: str, rows: list[dict]) -> None:
  from rich.console import Console
  from rich.table import Table

  from specjax import bench

  t = Table(title=title, title_justify="left")
  for key, head, _ in BENCH_COLUMNS:
    t.add_column(head, justify="left" if key == "method" else "right")
  for r in rows:
    t.add_row(*(bench._cell(r.get(k), f) for k, _, f in BENCH_COLUMNS))
  Console().print(t)


def _bench_plot(path: str, title: str, rows: list[dict]) -> None:
  """Speedup bars, each labelled with its tau."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4.2))
  names = [r["method"] for r in rows]
  bars = ax.bar(names, [r["speedup"] for r in rows], color="tab:blue")
  for bar, r in zip(bars, rows):
    ax.annotate(f"tau {r['tau']:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center", va="bottom", fontsize=8)
  ax.axhline(1.0, color="k", lw=0.8, ls="--")
  ax.set_ylabel("speedup over autoregressive")
  ax.set_title(title, fontsize=8, wrap=True)
  ax.tick_params(axis="x", rotation=20)
  fig.tight_layout()
  distributed.write_once(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
  plt.close(fig)


def cmd_data_generate(args) -> None:
  from specjax.training import corpus

  check_flags(args, DATA_FLAGS)  # generate_corpus checks the out folder before the model loads
  c = corpus.generate_corpus(args.model, args.out, tokens=args.tokens, batch_size=args.batch_size,
                             micro_batch=args.micro_batch, max_new_tokens=args.max_new_tokens,
                             temperatures=args.temperatures,
                             seed=args.seed, max_minutes=args.max_minutes or None)
  print(c)


def cmd_data_throughput(args) -> None:
  import specjax as sj
  from specjax import bench, weights
  from specjax.training import corpus

  check_flags(args, DATA_FLAGS)
  weights.check_model(args.model)
  rows = corpus.measure_throughput(sj.load_model(args.model), args.batch_sizes,
                                   new_tokens=args.new_tokens)
  print(bench.format_table(rows, [("batch", "batch", "d"), ("tokens_per_second", "tok/s", ".1f"),
                                  ("step_ms", "ms/step", ".1f"), ("vs_batch1", "vs batch 1", ".2f")]))


def cmd_train_draft(args) -> None:
  from specjax.training import draft

  check_flags(args, TRAIN_FLAGS)  # train_draft checks --export and --out-dir before loading

  draft.train_draft(args.model, args.corpus, out_dir=args.out_dir, export=args.export,
                    num_layers=args.num_layers, vocab_size=args.vocab_size, steps=args.steps,
                    batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, warmup=args.warmup,
                    weight_decay=args.weight_decay, grad_clip=args.grad_clip,
                    soft_top_k=args.soft_top_k, held_out=args.held_out,
                    ckpt_every=args.ckpt_every, eval_every=args.eval_every,
                    max_minutes=args.max_minutes, seed=args.seed, init=args.init)


def _num_heads_arg(text):
  """--num-heads: "4" (one kind) or "medusa=4,mtp=2" (several kinds)."""
  if text is None or "=" not in text:
    try:
      return None if text is None else int(text)
    except ValueError:
      raise InputError(f"--num-heads={text!r} is invalid: an integer, or kind=count pairs like "
                       f"medusa=4,mtp=2") from None
  out = {}
  for part in text.split(","):
    k, _, v = part.partition("=")
    try:
      out[k.strip()] = int(v)
    except ValueError:
      raise InputError(f"--num-heads={text!r} is invalid: kind=count pairs like medusa=4,mtp=2") from None
  return out


def cmd_train_heads(args) -> None:
  from specjax.training import heads

  check_flags(args, TRAIN_FLAGS)  # train_heads checks --export and --out-dir before loading

  what = args.kinds if args.what == "heads" else args.what
  heads.train_heads(what, args.model, args.corpus, out_dir=args.out_dir, export=args.export,
                      num_heads=_num_heads_arg(args.num_heads), num_layers=args.num_layers,
                      vocab_size=args.vocab_size, steps=args.steps, batch_size=args.batch_size,
                      seq_len=args.seq_len, lr=args.lr, warmup=args.warmup,
                      weight_decay=args.weight_decay, grad_clip=args.grad_clip,
                      held_out=args.held_out, ckpt_every=args.ckpt_every,
                      eval_every=args.eval_every, max_minutes=args.max_minutes, seed=args.seed,
                      unroll=args.unroll, init=args.init, taps=args.taps or (),
                      dflash=_dflash_args(args))


def _dflash_args(args) -> dict | None:
  """`specjax train dflash`'s drafter shape: --block-size, --mask-token, --target-layers."""
  if args.what != "dflash":
    return None
  out = {"block_size": args.block_size, "mask_token_id": args.mask_token}
  if args.target_layers:
    out["target_layer_ids"] = tuple(int(i) for i in args.target_layers.split(","))
  return out


def cmd_train_medusa2(args) -> None:
  from specjax.training import heads

  check_flags(args, TRAIN_FLAGS)
  heads.train_medusa2(args.model, args.corpus, out_dir=args.out_dir, export=args.export,
                      num_heads=args.num_heads, num_layers=args.num_layers,
                      vocab_size=args.vocab_size, rank=args.rank, alpha=args.alpha,
                      sites=args.lora_sites, kl_weight=args.kl_weight,
                      backbone_lr=args.backbone_lr, warmup_heads=args.warmup_heads,
                      steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                      lr=args.lr, warmup=args.warmup, grad_clip=args.grad_clip,
                      held_out=args.held_out, ckpt_every=args.ckpt_every,
                      eval_every=args.eval_every, max_minutes=args.max_minutes, seed=args.seed,
                      init=args.init)


def _add_data_commands(sub) -> None:
  """`specjax data generate | throughput`."""
  da = sub.add_parser("data", help="build the self-distillation corpus drafters train on")
  dsub = da.add_subparsers(dest="what", required=True)
  dg = dsub.add_parser("generate", help="the target's own responses to an evaluation-free prompt "
                       "pool, in resumable shards (rerun the same command to continue)")
  dg.add_argument("--model", default=DEFAULT_MODEL)
  dg.add_argument("--out", required=True, help="corpus directory")
  dg.add_argument("--tokens", default="2M", help="response tokens to produce, e.g. 2M or 500k")
  dg.add_argument("--batch-size", type=int, default=64, help="rows per shard")
  dg.add_argument("--micro-batch", type=int, default=16,
                  help="rows per generate call (a shard's rows, sorted by prompt length)")
  dg.add_argument("--max-new-tokens", type=int, default=256)
  dg.add_argument("--temperatures", default="0,0.7,1.0,0.8",
                  help="comma-separated; shard i samples at the (i mod n)-th (0 = greedy)")
  dg.add_argument("--max-minutes", type=float, default=0.0, help="stop after this long (0 = no limit)")
  dg.add_argument("--seed", type=int, default=0)
  dg.set_defaults(fn=cmd_data_generate)
  dt = dsub.add_parser("throughput", help="generation tokens/s by batch size")
  dt.add_argument("--model", default=DEFAULT_MODEL)
  dt.add_argument("--batch-sizes", default="1,16,32,64,128")
  dt.add_argument("--new-tokens", type=int, default=64)
  dt.set_defaults(fn=cmd_data_throughput)


# The flags every `specjax train` subcommand has, declared once (`_add_train_run`); the settings
# that differ between a draft model and heads (a draft trains longer, on larger batches) are
# given per subcommand as add_argument keywords by flag.
_TRAIN_RUN_FLAGS = (
    ("--model", dict(default=DEFAULT_MODEL)),
    ("--corpus", dict(required=True, help="a corpus directory (`specjax data generate`)")),
    ("--out-dir", {}),
    ("--export", dict(default=None)),
    ("--vocab-size", dict(type=int, default=8192)),
    ("--steps", dict(type=int)),
    ("--batch-size", dict(type=int)),
    ("--seq-len", dict(type=int, default=256)),
    ("--lr", dict(type=float, default=1e-3)),
    ("--warmup", dict(type=int)),
    ("--weight-decay", dict(type=float, default=0.0)),
    ("--grad-clip", dict(type=float, default=1.0)),
    ("--held-out", dict(type=float, default=0.02)),
    ("--ckpt-every", dict(type=int)),
    ("--eval-every", dict(type=int)),
    ("--max-minutes", dict(type=float, default=0.0)),
    ("--seed", dict(type=int, default=0)),
)

_DRAFT_RUN = {
    "--model": dict(help="the target"),
    "--out-dir": dict(default="runs/draft",
                      help="checkpoints, log.jsonl and train.png; rerunning resumes from here"),
    "--export": dict(help="write the draft asset (.npz) here when done"),
    "--vocab-size": dict(help="draft vocabulary subset size"),
    "--steps": dict(default=2000), "--batch-size": dict(default=8), "--warmup": dict(default=100),
    "--ckpt-every": dict(default=100), "--eval-every": dict(default=100),
    "--held-out": dict(help="fraction of corpus sequences held out"),
    "--max-minutes": dict(help="stop (with a checkpoint) after this long; 0: no limit"),
}

_HEADS_RUN = {
    "--export": dict(help="write the heads (.npz) here when done; several kinds: a path with "
                     "{kind}, e.g. heads-{kind}.npz"),
    "--vocab-size": dict(help="heads score the corpus's most frequent next tokens (0: the full "
                         "vocabulary)"),
    "--steps": dict(default=400), "--batch-size": dict(default=4), "--warmup": dict(default=40),
    "--ckpt-every": dict(default=50), "--eval-every": dict(default=50),
}

_HEADS_HELPS = {"medusa": "Medusa-1 heads (4 by default)", "eagle": "an EAGLE feature head",
                "mtp": "multi-token-prediction modules (2 by default)",
                "eagle3": "an EAGLE-3 head (SafeAILab's architecture; export it with "
                "`specjax export --format eagle3`)",
                "dflash": "a DFlash block-diffusion drafter (z-lab's architecture; export it "
                "with `specjax export --format dflash`)",
                "heads": "several kinds of heads at once (--kinds), sharing one target forward "
                "per batch"}


def _add_train_run(p: argparse.ArgumentParser, differ: dict) -> None:
  """The shared `specjax train` flags; differ: flag -> the add_argument keywords of this one."""
  for flag, kw in _TRAIN_RUN_FLAGS:
    p.add_argument(flag, **{**kw, **differ.get(flag, {})})
  _add_distributed(p, mesh=False)


def _add_train_commands(sub) -> None:
  """`specjax train draft | medusa | eagle | mtp | eagle3 | dflash | heads | medusa2`."""
  t = sub.add_parser("train", help="train speculation drafts")
  tsub = t.add_subparsers(dest="what", required=True)
  td = tsub.add_parser("draft", help="distil a small same-tokenizer draft from the target on its "
                       "self-distillation corpus (checkpoints in --out-dir; rerun to resume)")
  _add_train_run(td, _DRAFT_RUN)
  td.add_argument("--num-layers", type=int, default=None, help="the draft's layers (default 2; with "
                  "--init the asset's, and more grows it: new layers start as identities)")
  td.add_argument("--soft-top-k", type=int, default=0,
                  help="train on the target's top-k distribution (one target forward per step; "
                  "0: the corpus tokens)")
  td.add_argument("--init", default=None, help="start from this draft asset (.npz or a registered "
                  "name, e.g. smollm2-135m-draft) instead of the target's first layers")
  td.set_defaults(fn=cmd_train_draft)
  for kind, what in _HEADS_HELPS.items():
    tm = tsub.add_parser(kind, help=f"train {what} on a frozen target over a corpus (orbax "
                         f"checkpoints in --out-dir; rerun to resume)")
    if kind == "heads":
      tm.add_argument("--kinds", default="eagle,medusa,mtp", help="comma-separated heads kinds")
    out_dir = dict(default=None if kind == "heads" else f"runs/{kind}",
                   help="default: runs/<kind> (several kinds: runs/<kind>+<kind>...)")
    _add_train_run(tm, {**_HEADS_RUN, "--out-dir": out_dir})
    tm.add_argument("--num-heads", default=None, help="default: 4 medusa, 1 eagle, 2 mtp; several "
                    "kinds: kind=count pairs, e.g. medusa=5,mtp=3")
    tm.add_argument("--num-layers", type=int, default=1, help="Medusa: residual blocks per head")
    tm.add_argument("--unroll", type=int, default=1, help="EAGLE: also learn to draft this many "
                    "steps ahead on its own features (training-time test; 1: next step only)")
    tm.add_argument("--init", default=None, help="start from these heads (.npz or a shipped name; "
                    "several kinds: with {kind}, e.g. smollm2-135m-{kind}) instead of fresh ones")
    tm.add_argument("--taps", default=None, help="EAGLE: fused features, the outputs of these "
                    "target layers beside the last (e.g. 2,15; 'auto': a low and a middle layer); "
                    "with --init from an unfused head, grows it")
    if kind == "dflash":
      tm.add_argument("--block-size", type=int, default=8, help="tokens per drafted block, the "
                      "last verified one included")
      tm.add_argument("--mask-token", type=int, required=True, help="the token id that fills a "
                      "block (one the text never uses)")
      tm.add_argument("--target-layers", default=None, help="0-based target layers read, e.g. "
                      "1,15,27 (default: --num-layers of them spread from layer 1 to L - 3)")
    tm.set_defaults(fn=cmd_train_heads)
  m2 = tsub.add_parser("medusa2", help="Medusa-2: Medusa heads and LoRA adapters on the target's "
                       "layers trained together, with KL(original || adapted) keeping the adapted "
                       "model close to the original (orbax checkpoints in --out-dir; rerun to "
                       "resume); the asset holds both")
  _add_train_run(m2, {**_HEADS_RUN, "--out-dir": dict(default="runs/medusa2"),
                      "--export": dict(help="write the Medusa-2 asset (heads + adapters, .npz)")})
  m2.add_argument("--num-heads", type=int, default=None, help="default: 4, or --init's count")
  m2.add_argument("--num-layers", type=int, default=1, help="residual blocks per head")
  m2.add_argument("--rank", type=int, default=8, help="LoRA rank")
  m2.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (the update is "
                  "alpha / rank x A B)")
  m2.add_argument("--lora-sites", default="wqkv,wo,w_in,w_out",
                  help="the layer matrices adapted (of wqkv, wo, w_in, w_out)")
  m2.add_argument("--kl-weight", type=float, default=1.0,
                  help="lambda: the weight of KL(original || adapted) in the loss")
  m2.add_argument("--backbone-lr", type=float, default=0.1,
                  help="the adapters' learning rate as a fraction of the heads'")
  m2.add_argument("--warmup-heads", type=int, default=50,
                  help="steps that train the heads alone before the adapters learn")
  m2.add_argument("--init", default=None, help="start from these Medusa-1 heads (.npz or a "
                  "shipped name, e.g. smollm2-135m-medusa) instead of fresh ones")
  m2.set_defaults(fn=cmd_train_medusa2)


def cmd_export(args) -> None:
  from specjax.drafters import export_files

  print(export_files(args.heads, args.format, args.out_dir, args.model))


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(prog="specjax", description="Speculative decoding in JAX")
  sub = ap.add_subparsers(dest="cmd", required=True)

  g = sub.add_parser("generate", help="generate text for one or more prompts")
  g.add_argument("--model", default=DEFAULT_MODEL)
  g.add_argument("--weights", **WEIGHTS_FLAG)
  g.add_argument("--activations", **ACTIVATIONS_FLAG)
  g.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
  _add_sampling(g)
  _add_method(g)
  _add_distributed(g)
  g.set_defaults(fn=cmd_generate)

  d = sub.add_parser("demo", help="run every method on the embedded default model")
  d.add_argument("--model", default=DEFAULT_MODEL)
  d.add_argument("--weights", **WEIGHTS_FLAG)
  d.add_argument("--activations", **ACTIVATIONS_FLAG)
  d.add_argument("--max-new-tokens", type=int, default=64)
  d.add_argument("--repeats", type=int, default=1, help="timed runs per method and prompt")
  _add_method(d)
  d.set_defaults(fn=cmd_demo)

  b = sub.add_parser("bench", help="time methods against autoregressive (or specjax vs "
                     "transformers) in one run")
  b.add_argument("--model", default=DEFAULT_MODEL, help="a named model, a local HF directory or a .gguf")
  b.add_argument("--weights", **WEIGHTS_FLAG)
  b.add_argument("--activations", **ACTIVATIONS_FLAG)
  b.add_argument("--vs-transformers", action="store_true",
                 help="autoregressive specjax vs transformers' PyTorch generate, same weights")
  b.add_argument("--methods", default="", help="comma-separated (autoregressive is always run); "
                 "default: every available method that runs on the model")
  b.add_argument("--prompts", default="mt_bench",
                 help="mt_bench | spec_bench[:category] | humaneval | gsm8k (files found under "
                      "$SPECJAX_PROMPTS or ../shared/data/prompts; an error if absent) | builtin "
                      "(a small sample shipped with specjax) | a .jsonl/.txt path")
  b.add_argument("--num-prompts", type=int, default=5)
  b.add_argument("--batch-size", type=int, default=1, help="prompts decoded together per call")
  b.add_argument("--max-new-tokens", type=int, default=128)
  b.add_argument("--repeats", type=int, default=3, help="timed runs per (method, call); medians")
  b.add_argument("--temperature", type=float, default=0.0)
  b.add_argument("--stop-at-eos", action="store_true",
                 help="stop rows at EOS (default: fixed length, every method emits the same count)")
  b.add_argument("--no-chat", action="store_true",
                 help="raw prompts (default: the chat template, except for HumanEval)")
  b.add_argument("--breakdown", action="store_true",
                 help="instead of timing: each method's time per round split into draft / "
                 "verify / other, profiled inside the compiled loop")
  b.add_argument("--json", default="", help="write the summary and per-call records here")
  b.add_argument("--csv", default="", help="write the summary table here")
  b.add_argument("--plot", default="", help="write a speedup bar chart here (.png)")
  _add_method_options(b)
  _add_distributed(b)
  b.set_defaults(fn=cmd_bench)

  _add_data_commands(sub)
  _add_train_commands(sub)

  x = sub.add_parser("export", help="write heads (.npz, a shipped name or published files) in a "
                     "published layout: medusa (FasterDecoding's Medusa-1), eagle (EAGLE-1/2), "
                     "eagle3 (EAGLE-3) or dflash (z-lab's DFlash)")
  x.add_argument("--format", required=True, choices=("medusa", "eagle", "eagle3", "dflash"))
  x.add_argument("heads")
  x.add_argument("out_dir")
  x.add_argument("--model", default=None, help="the target (default: the one the heads name; "
                 "medusa needs none)")
  x.set_defaults(fn=cmd_export)

  args = ap.parse_args(argv)
  from specjax.errors import SpecJaxError

  try:
    _start_distributed(args)
    args.fn(args)
  except SpecJaxError as e:
    print(f"specjax: error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  main()
