"""The bfloat16 target on the CPU kernels (issue 46, item 3): is every method lossless on real
weights, and how fast is bf16 against float32 on the same checkpoint.

    .venv/bin/python experiments/bf16/run.py [--quick] [--models smollm2-135m,gemma3-270m]
        [--prompts 3] [--max-new-tokens 48] [--methods a,b]

Each model's GGUF (SmolLM2-135M's Q4_1, Gemma 3 270M's Q4_K_M) is loaded twice in one process:
dequantized to float32 and to bfloat16 weights (`dtype=jnp.bfloat16`: bf16 weights and
activations into the kernel's products, float32 sums in a fixed order, float32 attention).

  - lossless: every registered method by name, greedy, on held-out chat (MT-Bench) and code
    (HumanEval) prompts (the chat ones in the model's chat template where its tokenizer has
    one: SmolLM2's; Gemma 3's GGUF ships none, so its prompts go in as text), batch 1 (each prompt alone) and batch 3 (mixed lengths), against bf16
    autoregressive decoding: strict token identity, since the kernels give a T-token forward
    each row's one-token bits. A method whose drafter is not shipped for the model (SmolLM2's
    DFlash; every trained drafter of Gemma 3) is built with random drafters
    (specjax.exactness.method_options), marked `random drafter`: the check of exactness holds
    for any drafter, although a random one gets few drafts accepted. Beside identity, tau (new
    tokens per target forward: how much of the accept path the runs exercised). Speedups of
    the methods are not timed here (specjax bench times them on any model).
  - speed: autoregressive tok/s of bf16 and float32 (whole calls, prefill included, the two
    alternating within each repeat, fastest repeat kept) and the cost curve c(T) of each.

Writes results.json / results.md here (results_quick.* with --quick).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

import specjax as sj  # noqa: E402
from specjax import bench, decode, exactness  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = ("smollm2-135m", "gemma3-270m")


def build(name: str, model) -> tuple[object, bool]:
  """(method, random_drafter): the method by name with its defaults, else, where the model has
  no shipped drafter for it, with random drafters."""
  if sj.methods.get(name).available(model):
    return sj.methods.build(name, model), False
  return exactness.build_method(name, model), True


def lossless(model, sets: dict, names: list, n_new: int) -> list:
  """Every method by name on the bf16 model, batch 1 and 3, against bf16 autoregressive decoding
  of the same batch: runs with identical tokens, and tau (new tokens per target forward)."""
  cases = []
  for group, (ps, chat) in sets.items():
    cases += [([p], chat) for p in ps] + [(ps[i:i + 3], chat) for i in range(0, len(ps) - 2, 3)]
  kw = dict(max_new_tokens=n_new, stop_at_eos=False)
  refs = [sj.generate(model, ps, chat=chat, **kw).tokens for ps, chat in cases]
  rows = []
  for name in tqdm(names, desc="bf16 methods"):
    method, random = build(name, model)
    same = tokens = calls = 0
    for (ps, chat), ref in zip(cases, refs):
      out = sj.generate(model, ps, method, chat=chat, **kw)
      same += out.tokens == ref
      tokens += out.stats["new_tokens"]
      calls += int(sum(out.stats["target_calls_per_row"]))
    # Each method compiles its own programs per prompt shape; on Gemma 3 (a 262k vocabulary)
    # they outgrew the process's memory mappings after a few methods, so they go once used.
    decode.compile_cache.clear()
    jax.clear_caches()
    rows.append({"method": name, "random_drafter": random, "runs": len(cases),
                 "identical_runs": same, "tau": tokens / max(1, calls)})
  return rows


def one_model(name: str, args, n: int, n_new: int, sizes) -> dict:
  models = {"float32": sj.load_model(name), "bfloat16": sj.load_model(name, dtype=jnp.bfloat16)}
  chat = getattr(models["bfloat16"].tokenizer, "chat_template", None) is not None
  sets = {"chat": (list(bench.load_prompt_set("mt_bench", n, fallback=True)[0]), chat),
          "code": (list(bench.load_prompt_set("humaneval", n, fallback=True)[0]), False)}
  curves = {a: {int(t): float(c) for t, c in bench.measure_cost_curve(
      m, sizes, cache_len=512, filled=256, reps=3 if args.quick else 9).items()}
      for a, m in models.items()}
  speed = {g: bench.alternating_autoregressive(models, ps, chat=chat, max_new_tokens=n_new,
                                               repeats=args.repeats)
           for g, (ps, chat) in sets.items()}
  names = [m for m in (args.methods.split(",") if args.methods else sj.METHODS)
           if m and m != "autoregressive"]
  return {"curves": curves, "autoregressive": speed,
          "methods": lossless(models["bfloat16"], sets, names, n_new)}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="3 prompts a set, 24 tokens, short curves")
  ap.add_argument("--models", default=",".join(MODELS))
  ap.add_argument("--prompts", type=int, default=3, help="per set (chat, code)")
  ap.add_argument("--max-new-tokens", type=int, default=48)
  ap.add_argument("--repeats", type=int, default=3, help="autoregressive timing repeats")
  ap.add_argument("--methods", default="",
                  help="comma-separated (default: every registered; ',' for none: speed only)")
  ap.add_argument("--out", default=None, help="results stem (default results / results_quick)")
  args = ap.parse_args(argv)
  n, n_new = (3, 24) if args.quick else (args.prompts, args.max_new_tokens)
  sizes = (1, 4, 16) if args.quick else (1, 2, 4, 8, 16, 32, 64)
  t_start = time.time()
  info = bench.machine_info()
  res = {"command": bench.command_line(), "prompts_per_set": n, "new_tokens": n_new, "models": {}}
  stem = args.out or ("results_quick" if args.quick else "results")
  for m in args.models.split(","):  # saved after each model: a run cut short keeps what it made
    res["models"][m] = one_model(m, args, n, n_new, sizes)
    res["machine"] = bench.finish_machine_info(dict(info), t_start)
    bench.save_report(HERE, stem, res, report(res))
  print(report(res))


def report(res: dict) -> str:
  lines = [f"`{res['command']}`", "", bench.machine_summary(res["machine"]), ""]
  for name, r in res["models"].items():
    sizes = list(next(iter(r["curves"].values())))
    lines += [f"## {name}", "",
              "| arithmetic | " + " | ".join(f"c({t})" for t in sizes) + " | "
              + " | ".join(f"AR tok/s {g}" for g in r["autoregressive"]) + " |",
              "|---" * (1 + len(sizes) + len(r["autoregressive"])) + "|"]
    for a, curve in r["curves"].items():
      lines.append(f"| {a} | " + " | ".join(f"{curve[t]:.2f}" for t in sizes) + " | "
                   + " | ".join(f"{s[a]:.1f}" for s in r["autoregressive"].values()) + " |")
    ratios = ", ".join(f"{g} {s['bfloat16'] / s['float32']:.2f}x"
                       for g, s in r["autoregressive"].items())
    lines += ["", f"bf16 autoregressive against float32: {ratios}.", ""]
    if not r["methods"]:  # a speed-only run (--methods ,)
      continue
    lines += [f"Every method by name on the bf16 model ({res['prompts_per_set']} chat and "
              f"{res['prompts_per_set']} code prompts, batch 1 and 3, {res['new_tokens']} tokens):",
              "", "| method | runs identical to bf16 AR | tau |", "|---|---|---|"]
    for m in r["methods"]:
      label = m["method"] + (" (random drafter)" if m["random_drafter"] else "")
      lines.append(f"| {label} | {m['identical_runs']}/{m['runs']} | {m['tau']:.2f} |")
    same = sum(m["identical_runs"] for m in r["methods"])
    total = sum(m["runs"] for m in r["methods"])
    lines += ["", f"Identical: {same} of {total} runs.", ""]
  return "\n".join(lines)


if __name__ == "__main__":
  main()
