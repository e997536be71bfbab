"""Spec-Bench on this machine: every method, greedy, batch 1, against autoregressive (issue 13).

    .venv/bin/python experiments/spec_bench/run.py [--quick] [--model NAME_OR_DIR] [--out DIR]
        [--num-prompts N] [--max-new-tokens N] [--categories a,b] [--methods a,b] [--repeats N]
        [--rescore results.json]

The six Spec-Bench categories (multi-turn conversation = MT-Bench's first turns, translation,
summarization, QA, math reasoning, RAG; chat template) plus HumanEval (raw code completion), in
one process: the methods decode each prompt one after another with an sj.Autoregressive() run
before each and after the last (specjax.bench.run_cases / rescore: compile excluded, a fresh
program's first run discarded), and every greedy output is checked token for token against
autoregressive. Writes results.json (raw per-prompt records; `--rescore` scores them again),
results.md (the tables) and results.png to --out (`results_quick.*` with --quick): speedup per
category (median of per-prompt ratios), the overall speedup and mean accepted tokens over the six
categories, in Spec-Bench's leaderboard layout, next to Spec-Bench's published Vicuna-7B / A100
figures.

Methods: every registered method with the registry's defaults (specjax.methods.defaults: chosen
from this device's cost curve and each drafter's held-out numbers; the report prints what each
chose), Medusa with the tree `specjax.tree.choose_budget` picks on the cost curve measured in the
run (or --medusa-nodes). The drafters: the shipped `smollm2-135m-draft` for SmolLM2, else the
target's first layer (layer-skip drafts over the draft's vocabulary where it has one); heads come
from the registry when the model has shipped ones (a Medusa-2 model's are its asset's); a model
with a registry entry whose asset is not there yet skips that method, and every model skips a
method the registry says it cannot run that has no stand-in here (DFlash without shipped heads),
saying why; a model with no entries (e.g. a test checkpoint) gets random heads
(`sj.init_heads(target, kind, seed=0)`), so the script runs end to end on any model.

`--weights blocks` decodes with the GGUF's own quantized blocks instead of float32 (and
`--activations int8` with 8-bit activations too: W4A8); every method then runs on that target and
is exact with respect to it. `--llama-cpp` adds llama.cpp on the same GGUF file and the same
token ids (experiments/blocks/llama_runner.py: `--threads` threads, greedy, exactly as many
tokens, whole prompt evaluated every call), plain and with llama-cpp-python's own prompt-lookup
speculation (`LlamaPromptLookupDecoding`, num_pred_tokens 2 and 10), timed among the methods
against the same autoregressive runs (`bench.External`). llama.cpp computes with 8-bit
activations, so its greedy tokens may differ from autoregressive's: the report gives the share
of them before the first difference instead of asserting identity; its tau counts its forwards
(the prompt's, then one per verification) as specjax counts target calls.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, ROOT)

import specjax as sj  # noqa: E402
from specjax import bench, shipped  # noqa: E402
from specjax import report as sj_report  # noqa: E402
from specjax import methods as sj_methods  # noqa: E402

CATEGORIES = bench.SPEC_BENCH_CATEGORIES + ("humaneval",)
TITLES = {"mt_bench": "MT-Bench", "translation": "Translation", "summarization": "Summarization",
          "qa": "QA", "math_reasoning": "Math", "rag": "RAG", "humaneval": "HumanEval"}
METHODS = sj.METHODS  # every registered method (specjax.methods), autoregressive first

# Spec-Bench's leaderboard, Vicuna-7B-v1.3, greedy, fp16, batch 1, one A100 80GB:
# https://github.com/hemingkx/Spec-Bench/blob/main/Leaderboard.md ("Leaderboard on A100").
# Speedup per category (MT-Bench, translation, summarization, QA, math, RAG), mean accepted
# tokens, overall speedup.
SPEC_BENCH_A100_VICUNA7B = {
    "EAGLE": ((2.67, 1.99, 2.23, 2.12, 2.67, 2.04), 3.61, 2.29),
    "Hydra": ((2.45, 1.94, 1.79, 2.03, 2.49, 1.77), 3.24, 2.09),
    "Medusa": ((2.05, 1.73, 1.57, 1.75, 2.05, 1.51), 2.32, 1.78),
    "PLD (prompt lookup)": ((1.64, 1.04, 2.43, 1.14, 1.61, 1.71), 1.73, 1.59),
    "SpS (draft model)": ((1.66, 1.13, 1.62, 1.49, 1.47, 1.55), 2.28, 1.49),
    "REST": ((1.63, 1.31, 1.36, 1.66, 1.21, 1.73), 1.82, 1.48),
    "Lookahead": ((1.40, 1.14, 1.19, 1.24, 1.55, 1.09), 1.66, 1.27),
}
SPEC_BENCH_SOURCE = "https://github.com/hemingkx/Spec-Bench/blob/main/Leaderboard.md"


def build_methods(target, names=METHODS, *, medusa_nodes: int = 0,
                  cost_sizes=(1, 2, 4, 8, 16, 32), log=print) -> tuple[dict, dict]:
  """(name -> method, name -> what it is: settings and where its drafter came from) for the
  method names in `names` (registry names, specjax.methods) that can run on `target`, with
  its shipped drafters. Each method is the registry's, with this experiment's
  settings (`_settings`) and drafters (`_drafter`).

  medusa_nodes: the Medusa tree size (0: `choose_budget` on the cost curve measured here at
  `cost_sizes`, from the heads' held-out per-rank accuracies, or Medusa's published ones for
  random heads).
  """
  names = [sj_methods.get(n).name for n in names]  # an unknown name fails here
  methods, notes = {}, {}
  draft = _drafter(target, "draft", log) if {"draft", "layer-skip"} & set(names) \
      else (None, None)
  for n in names:
    if n in ("draft", "layer-skip"):
      drafter = draft
    elif n in HEAD_METHODS:
      drafter = _drafter(target, n, log)
      if drafter[0] is None:
        notes[n] = drafter[1]  # registered for this model but not shipped yet: skipped
        continue
    elif why := sj_methods.get(n).unavailable(target):  # no stand-in here (DFlash unshipped)
      log(f"(skipping {n}: {why})")
      notes[n] = f"not run: {why}"
      continue
    else:
      drafter = (None, None)
    options, note = _settings(n, target, *drafter, medusa_nodes, cost_sizes, log)
    methods[n] = sj_methods.build(n, target, **options)
    notes[n] = note or _describe(methods[n], drafter[1] if n != "layer-skip" else None, n)
  return methods, notes


HEAD_METHODS = ("medusa", "eagle", "mtp")
# llama.cpp rows (--llama-cpp): name -> llama-cpp-python's prompt-lookup num_pred_tokens (0: off).
LLAMA_CPP = {"llama.cpp": 0, "llama.cpp prompt-lookup 2": 2, "llama.cpp prompt-lookup 10": 10}


def llama_cpp_methods(target, gguf: str, threads: int):
  """(name -> bench.External, name -> what it is, close: frees them) for the LLAMA_CPP rows on
  the GGUF file `gguf`, fed the token ids sj.generate would feed `target`."""
  from experiments.blocks.llama_runner import LlamaCpp

  methods, notes, opened = {}, {}, []
  for name, k in LLAMA_CPP.items():
    llm = LlamaCpp(gguf, threads, num_pred_tokens=k)
    methods[name], opened = bench.External(_llama_generate(target, llm)), opened + [llm]
    notes[name] = (f"llama.cpp {llm.version} (llama-cpp-python) on the same GGUF, {threads} "
                   f"threads, 8-bit activations (not specjax's arithmetic)"
                   + (f", prompt lookup (LlamaPromptLookupDecoding, num_pred_tokens={k})"
                      if k else ""))
  return methods, notes, lambda: [llm.close() for llm in opened]


def _llama_generate(target, llm):
  """sj.generate's shape around llama.cpp (one prompt a call): its first call is a warm-up."""
  import types

  calls = [0]

  def generate(model, prompts, *, max_new_tokens, temperature=0.0, chat=True, seed=0, **_):
    if len(prompts) != 1:
      raise ValueError(f"llama.cpp rows decode one prompt a call, got {len(prompts)}")
    ids = sj.decode._encode(target, prompts, chat)[0]  # the ids sj.generate feeds
    out = llm.decode(ids, max_new_tokens, temperature, seed)
    calls[0] += 1
    return types.SimpleNamespace(tokens=[out["tokens"]], stats={
        "wall_time_s": out["wall_s"], "compile_time_s": out["wall_s"] if calls[0] == 1 else 0.0,
        "new_tokens": len(out["tokens"]), "target_calls_per_row": [out["forwards"]],
        "prompt_bucket": len(ids)})
  return generate


def _shipped(target, kind: str):
  """(drafter name, None) when shipped for `target` (specjax.methods.shipped: on a Medusa-2
  model, its asset's heads are its Medusa heads); (None, reason) when registered for it but
  absent; (None, None) when the model has no registry entry of this kind."""
  name = sj_methods.shipped(kind, target)
  if name:
    return name, None
  absent = [d.name for d in shipped.DRAFTERS.values()
            if d.kind == kind and d.target == getattr(target, "name", None)]
  return None, (f"{absent[0]} is registered but not shipped yet" if absent else None)


def _drafter(target, kind: str, log):
  """(the drafter of `kind` for target, where it came from): the shipped one; else an untrained
  stand-in (the target's first layer as a draft; random heads for a model without registry
  entries) so the script runs end to end on any model. Heads registered for the model but not
  shipped yet: (None, why)."""
  name, missing = _shipped(target, kind)
  if kind == "draft":
    if name:
      return sj.load_model(name, target=target), f"shipped draft {name}"
    return (shipped.draft_from_target(target, num_layers=1),
            "the target's first layer (untrained): no draft shipped for this model")
  if missing:
    log(f"(skipping {kind}: {missing})")
    return None, missing
  if name:
    return sj.load_heads(name, target), f"shipped heads {name}"
  return sj.init_heads(target, kind, seed=0), "random heads (sj.init_heads, seed 0): none shipped"


def _settings(n: str, target, drafter, source: str, medusa_nodes: int, cost_sizes, log):
  """(the registry factory's options for method n in this experiment, its note; None: the note
  is made from the built method's settings). Every method runs with the registry's defaults,
  which specjax.methods.defaults chooses from this device's cost curve and the drafter's
  held-out numbers; the experiment gives only the drafters (and layer-skip the draft's
  vocabulary), and Medusa's tree (`_medusa_tree`: the same choice on the cost curve measured in
  this run, or --medusa-nodes)."""
  if n == "autoregressive":
    return {}, "baseline"
  if n == "draft":
    return {"draft": drafter}, None
  if n == "layer-skip":
    vocab = drafter.vocab_subset
    return ({"vocab": vocab} if vocab is not None else {}), None
  if n == "medusa":
    tree, nodes, how = _medusa_tree(target, drafter, medusa_nodes, cost_sizes, log)
    return ({"heads": drafter, "tree": tree, "top_k": 5},
            f"Medusa, {nodes}-node tree ({how}), exact acceptance: {source}")
  if n in HEAD_METHODS:
    return {"heads": drafter}, None
  return {}, None


def _describe(method, source: str | None, n: str) -> str:
  """"Class(setting=value, ...)" from a built method's plain settings (what the registry chose),
  then where its drafter came from, or the registry's description."""
  import dataclasses

  shown = {f.name: getattr(method, f.name) for f in dataclasses.fields(method)
           if f.name not in ("name", "lossless") and type(getattr(method, f.name)) in (int, float, str)}
  vocab = getattr(method, "vocab", None)  # a drafter proposing over a vocabulary subset
  extra = f", the draft's {len(vocab)}-token vocabulary" if vocab is not None else ""
  text = f"{type(method).__name__}({', '.join(f'{k}={v}' for k, v in shown.items())}{extra})"
  return f"{text}: {source or sj_methods.REGISTRY[n].description}"


def _medusa_tree(target, heads, medusa_nodes: int, cost_sizes, log):
  """(the Medusa tree, its node count, how the count was chosen)."""
  from specjax import tree as T

  acc = T.per_rank_accuracy(heads.meta, heads.config.num_heads)
  if acc is None or not acc.any():  # random heads: no held-out accuracy; Medusa's published
    acc = T.prior_accuracies(heads.config.num_heads, top_k=5)
  if medusa_nodes:
    nodes, how = medusa_nodes, "given"
  else:
    cost = bench.measure_cost_curve(target, cost_sizes, reps=5)
    # Up to the largest measured size only: beyond it the curve would be extrapolated.
    nodes = T.choose_budget(cost, acc, max_nodes=max(cost_sizes) - 1)["num_nodes"]
    how = "choose_budget"
    log("cost curve c(T): " + ", ".join(f"{t}: {c:.2f}" for t, c in cost.items())
        + f" -> Medusa tree of {nodes} nodes")
  return T.build_tree(acc, nodes), nodes, how


def select_prompts(model, category: str, n: int, max_tokens: int = 0,
                   max_new_tokens: int = 0) -> tuple[list[str], bool]:
  """The first n prompts of a category whose token count (chat template included) is at most
  max_tokens (0: no limit) and leaves room for max_new_tokens in the model's context; when fewer
  than n fit max_tokens, the shortest that fit the context fill up. Returns (prompts, chat);
  no prompts when none fits the context."""
  spec = category if category == "humaneval" else f"spec_bench:{category}"
  pool, chat = bench.load_prompt_set(spec, 200)
  pool = list(dict.fromkeys(pool))  # load_prompt_set cycles a short set: drop the repeats
  room = model.config.max_position_embeddings - max_new_tokens
  lengths = [len(_encode(model, p, chat)) for p in pool]
  fits = [(k, p) for k, p in zip(lengths, pool) if k <= room]
  chosen = [p for k, p in fits if not max_tokens or k <= max_tokens][:n]
  chosen += [p for _, p in sorted(fits, key=lambda kp: kp[0]) if p not in chosen][:n - len(chosen)]
  return (chosen * n)[:n] if chosen else [], chat


def _encode(model, prompt: str, chat: bool) -> list[int]:
  if chat:
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                              add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
  return model.tokenizer.encode(prompt)


def tables(summary: dict, categories, methods) -> str:
  """The leaderboard (speedup per category, overall, mean tau, greedy identity), then tau per
  category."""
  spec = [c for c in categories if c in bench.SPEC_BENCH_CATEGORIES]
  rest = [c for c in categories if c not in spec]
  rows, tau_rows = [], []
  for name in methods:
    cells = summary[name]
    ov = cells.get("spec_bench")
    r = {"method": name, "overall": None if ov is None else f"{ov['speedup']:.2f}x",
         "tau": None if ov is None else ov["tau"],
         "identical": bench.OVERALL in cells and cells[bench.OVERALL]["identical"]}
    share = cells.get(bench.OVERALL, {}).get("same_as_ar")
    if share is not None:  # llama.cpp: other arithmetic, its agreement is reported, not asserted
      r["identical"] = f"{share:.2f} of tokens"
    t = {"method": name}
    for c in categories:
      r[c] = f"{cells[c]['speedup']:.2f}x" if c in cells else None
      t[c] = cells[c]["tau"] if c in cells else None
    rows.append(r)
    tau_rows.append(t)
  cols = ([("method", "method", "s")] + [(c, TITLES.get(c, c), "s") for c in spec]
          + [("overall", "Overall (6 categories)", "s"), ("tau", "mean tau", ".2f")]
          + [(c, TITLES.get(c, c), "s") for c in rest] + [("identical", "greedy = AR", "")])
  ar = summary["autoregressive"]
  speed = ", ".join(f"{TITLES.get(c, c)} {ar[c]['tok_s']:.1f}" for c in categories if c in ar)
  return (bench.markdown_table(rows, cols)
          + f"\n\nAutoregressive tok/s (median per prompt): {speed}.\n\n"
          + "Tau (new tokens per target call, prefill included) per category:\n\n"
          + bench.markdown_table(tau_rows, [("method", "method", "s")]
                                 + [(c, TITLES.get(c, c), ".2f") for c in categories]))


def reference_table() -> str:
  rows = [{"method": name, **{c: f"{v:.2f}x" for c, v in zip(bench.SPEC_BENCH_CATEGORIES, sp)},
           "overall": f"{ov:.2f}x", "tau": tau}
          for name, (sp, tau, ov) in SPEC_BENCH_A100_VICUNA7B.items()]
  cols = ([("method", "method", "s")] + [(c, TITLES[c], "s") for c in bench.SPEC_BENCH_CATEGORIES]
          + [("overall", "Overall", "s"), ("tau", "mean tau", ".2f")])
  return (f"Spec-Bench's published figures (Vicuna-7B-v1.3, greedy, fp16, batch 1, one A100; "
          f"{SPEC_BENCH_SOURCE}):\n\n" + bench.markdown_table(rows, cols))


def plot(summary: dict, categories, methods):
  """Grouped bars: speedup per category (and overall) for each method but the baseline."""
  import numpy as np

  names = [m for m in methods if m != "autoregressive"]
  groups = list(categories) + ["spec_bench"]
  labels = [TITLES.get(c, c) for c in categories] + ["Overall"]

  def draw(fig):
    ax = fig.add_subplot(111)
    w = 0.8 / max(1, len(names))
    x = np.arange(len(groups))
    for i, name in enumerate(names):
      ys = [summary[name].get(g, {}).get("speedup", np.nan) for g in groups]
      ax.bar(x + (i - (len(names) - 1) / 2) * w, ys, w, label=name)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(x, labels, rotation=20)
    ax.set_ylabel("speedup over autoregressive")
    ax.set_title("Spec-Bench categories + HumanEval, greedy, batch 1")
    ax.legend(fontsize=7, ncol=2)
  return draw


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true",
                  help="1 prompt per category (the first of <= 64 tokens; the shortest where none is), "
                  "32 new tokens")
  ap.add_argument("--model", default="smollm2-135m")
  ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
  ap.add_argument("--num-prompts", type=int, default=None, help="per category (default 10; quick 1)")
  ap.add_argument("--max-new-tokens", type=int, default=None, help="default 128; quick 32")
  ap.add_argument("--max-prompt-tokens", type=int, default=None,
                  help="prefer prompts of at most this many tokens (default: no limit; quick 64)")
  ap.add_argument("--categories", default=",".join(CATEGORIES))
  ap.add_argument("--methods", default=",".join(METHODS))
  ap.add_argument("--repeats", type=int, default=1, help="timed runs per (method, prompt)")
  ap.add_argument("--medusa-nodes", type=int, default=0,
                  help="Medusa tree size (0: choose_budget on the measured cost curve)")
  ap.add_argument("--weights", choices=("float32", "blocks"), default="float32",
                  help="the target's weights (sj.load_model): float32, or a GGUF's own blocks")
  ap.add_argument("--activations", choices=("float32", "int8"), default="float32",
                  help="int8 (with --weights blocks): the W4A8 target")
  ap.add_argument("--llama-cpp", action="store_true",
                  help="add llama.cpp on the same GGUF: plain and prompt lookup 2 / 10 "
                  "(llama-cpp-python)")
  ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
  ap.add_argument("--no-progress", action="store_true")
  ap.add_argument("--rescore", default="", metavar="JSON",
                  help="decode nothing: score the records of an earlier run's JSON again and "
                  "rewrite its report next to it")
  args = ap.parse_args(argv)
  if args.rescore:
    return bench.rescore_saved(args.rescore, report)
  quick = args.quick
  n = args.num_prompts if args.num_prompts is not None else (1 if quick else 10)
  new = args.max_new_tokens if args.max_new_tokens is not None else (32 if quick else 128)
  max_prompt = args.max_prompt_tokens if args.max_prompt_tokens is not None else (64 if quick else 0)
  cats = [c for c in args.categories.split(",") if c]
  names = [sj_methods.canonical(m) or m for m in args.methods.split(",") if m]  # aliases too
  if bad := [c for c in cats if c not in CATEGORIES]:
    ap.error(f"--categories: unknown {', '.join(bad)}; choose from {', '.join(CATEGORIES)}")
  if bad := [m for m in names if m not in METHODS]:
    ap.error(f"--methods: unknown {', '.join(bad)}; choose from {', '.join(METHODS)}")
  if n < 1 or new < 1 or args.repeats < 1:
    ap.error("--num-prompts, --max-new-tokens and --repeats must be >= 1")
  names = ["autoregressive"] + [m for m in names if m != "autoregressive"]
  gguf = _check_llama_cpp(ap, args) if args.llama_cpp else None

  info, t_start = bench.machine_info(), time.time()
  info.update(weights=args.weights, activations=args.activations)
  print(f"{info['date']}, {info['processor']}, {info['cores']} cores, load average "
        f"{info['load_average']}, jax {info['jax']}")
  target = sj.load_model(args.model, weights=args.weights, activations=args.activations)
  methods, notes = build_methods(target, names, medusa_nodes=args.medusa_nodes,
                                 cost_sizes=(1, 2, 4, 8, 16) if quick else (1, 2, 4, 8, 16, 32))
  close = lambda: None  # noqa: E731
  if gguf:
    extra, extra_notes, close = llama_cpp_methods(target, gguf, args.threads)
    methods, notes = {**methods, **extra}, {**notes, **extra_notes}
  for name, note in notes.items():
    print(f"  {name}: {note}")
  cases = []
  for c in cats:
    ps, chat = select_prompts(target, c, n, max_prompt, new)
    if not ps:
      ap.error(f"no {c} prompt fits {args.model}'s context of "
               f"{target.config.max_position_embeddings} tokens with {new} new tokens")
    cases += [bench.Case([p], chat, c) for p in ps]
  records = bench.run_cases(target, cases, methods, max_new_tokens=new, repeats=args.repeats,
                            desc="spec-bench", progress=not args.no_progress)
  close()
  bench.finish_machine_info(info, t_start)
  data = {"info": info, "args": vars(args), "model": args.model, "num_prompts": n,
          "max_new_tokens": new, "repeats": args.repeats, "max_prompt_tokens": max_prompt,
          "categories": cats, "methods": notes, "records": records,
          "external": [m for m in methods if isinstance(methods[m], bench.External)]}
  return report(data, args.out, "results_quick" if quick else "results")


def _check_llama_cpp(ap, args) -> str:
  """The GGUF file llama.cpp will read, after checking that llama-cpp-python is installed and
  that the model is a GGUF: errors before anything loads or compiles."""
  from experiments.blocks.llama_runner import import_llama_cpp
  from specjax import weights

  import_llama_cpp()
  if args.threads < 1:
    ap.error(f"--threads {args.threads}: must be >= 1")
  path = weights.resolve(args.model)
  if not str(path).endswith(".gguf"):
    ap.error(f"--llama-cpp needs a GGUF model; {args.model!r} is {path}")
  return path


def report(data: dict, out: str, stem: str) -> dict:
  """Scores a run's records (bench.rescore, bench.summarize), writes stem.json / .md / .png to
  `out` and returns the data with its summary."""
  records, cats, notes, info = data["records"], data["categories"], data["methods"], data["info"]
  bench.rescore(records)
  spec = [c for c in cats if c in bench.SPEC_BENCH_CATEGORIES]
  summary = bench.summarize(records, overall=None)
  if spec:  # Spec-Bench's "overall" covers its six categories only, not HumanEval
    pooled = bench.summarize(records, overall=spec)
    for name in summary:
      summary[name]["spec_bench"] = pooled[name][bench.OVERALL]
  ran = list(summary)
  head = (f"{data['model']} on {sj_report.arithmetic(info)}, greedy, batch 1, "
          f"{data['num_prompts']} prompt(s) per category, "
          f"{data['max_new_tokens']} new tokens (fixed length), {data['repeats']} timed run(s) "
          f"per prompt; {info['date']}, {info['processor'] or info['machine']}, {info['cores']} "
          f"cores, load average {info['load_average'][0]:.1f} at start / "
          f"{info['load_average_end'][0]:.1f} at end.")
  skipped = [f"{m} ({note})" for m, note in notes.items() if m not in ran]
  head += f" Not run: {'; '.join(skipped)}." if skipped else ""
  if data.get("external"):
    head += (f" {', '.join(data['external'])}: run outside specjax with other arithmetic (not "
             f"exact); their \"greedy = AR\" is the share of autoregressive's tokens before the "
             f"first difference.")
  markdown = "\n\n".join([head, tables(summary, cats, ran), reference_table()])
  data = dict(data, summary=summary, reference={"source": SPEC_BENCH_SOURCE,
                                                "vicuna7b_a100": SPEC_BENCH_A100_VICUNA7B})
  paths = bench.save_report(out, stem, data, markdown, plot=plot(summary, cats, ran))
  print("\n" + markdown + "\n\nwrote " + ", ".join(paths.values()))
  return data


if __name__ == "__main__":
  main()
