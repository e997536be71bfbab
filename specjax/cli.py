"""`specjax generate | demo | bench | data | train | export`: the parsers and the generate, demo
and bench commands (data, train and export: cli_train.py; flag values: cli_flags.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from specjax import distributed, validate
from specjax.cli_flags import (BENCH_FLAGS, DEFAULT_MODEL, METHOD_FLAGS, SAMPLING_FLAGS,
                               _add_distributed, _int, _start_distributed, check_flags)
from specjax.cli_train import _add_data_commands, _add_train_commands, cmd_export
from specjax.errors import InputError


def _method_options(name: str, args) -> dict:
  """The CLI's settings of method `name` (a registry name) as its factory's options: everything
  else about building a method (defaults, the shipped drafter for the model) is the registry's
  (specjax.methods)."""
  if name in ("draft", "pard"):  # gamma / nodes 0: chosen from the cost curve (methods/defaults.py)
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
                 f"draft, pard, medusa, eagle and mtp need a drafter: the one shipped for --model, or "
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
  and compiles, each with a progress line on stderr (progress.timed_step, as `specjax demo`)."""
  import specjax as sj
  from specjax import auto, methods, progress

  name = _check_generate_args(args)
  with progress.timed_step(f"loading {args.model}", stream=sys.stderr) as step:
    model = _load(args)
    step["note"] = str(model)
  if args.chat and getattr(model.tokenizer, "chat_template", None) is None:
    raise InputError(f"--chat: the tokenizer of {args.model!r} has no chat template; run "
                     f"without --chat")
  if name == auto.NAME:
    method = auto.NAME
  elif methods.REGISTRY[name].trained:  # its drafter loads (a draft model: seconds)
    with progress.timed_step(f"loading {name}'s drafter", stream=sys.stderr):
      method = _make_method(name, model, args)
  else:
    method = _make_method(name, model, args)
  with progress.timed_step(f"compiling and generating ({name}, {args.max_new_tokens} new tokens)",
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
  and compiled programs are kept on disk for the next demo (progress.use_compile_cache)."""
  import specjax as sj
  from specjax import bench, progress

  check_flags(args, {"--max-new-tokens": _int(1, validate.INT32_MAX), "--repeats": _int(1),
                     **METHOD_FLAGS})
  progress.use_compile_cache()
  with progress.timed_step(f"loading {args.model}") as step:
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
  warm = progress.warm_methods(model, methods, DEMO_PROMPTS[0], max_new_tokens=args.max_new_tokens)
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
