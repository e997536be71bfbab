"""The W4A8 target (issue 46): SmolLM2-135M (or --model, e.g. gemma3-270m) over its GGUF's own
blocks with int8 activations, against the same file with float32 activations (`weights=
"blocks"`) and the float32 model.

    .venv/bin/python experiments/w4a8/run.py [--quick] [--model smollm2-135m] [--prompts 10]
        [--max-new-tokens 128] [--methods ...] [--llama-cpp] [--out STEM]

In one process, for each arithmetic (float32, blocks x float32, blocks x int8):
  - cost curve: c(T) = time of a T-token forward / time of a one-token forward (batch 1, a cache
    of 512 slots with 256 filled; medians of interleaved runs, specjax.calibrate.measure);
  - autoregressive decoding: tok/s over whole calls (prefill included, compilation excluded) on
    chat (MT-Bench) and code (HumanEval) prompts, the three arithmetics alternating within every
    repeat, the fastest repeat of each kept;
  - agreement (reported, not asserted): how often int8 activations pick the token float32
    activations pick, teacher forced along the blocks model's own greedy output.
Then every method by name (its defaults from this device's cost curve for the W4A8 target) on
the W4A8 target against its own autoregressive decoding (specjax.bench.run_cases: baseline runs
around every method run), with greedy identity checked on every run. --llama-cpp: per
arithmetic, the share of llama.cpp's greedy tokens (llama-cpp-python on the same file and token
ids) before the first difference.
A tokenizer without a chat template takes the chat prompts as text.

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
import numpy as np  # noqa: E402

import specjax as sj  # noqa: E402
from specjax import bench, weights  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = "smollm2-135m"
METHODS = ("prompt-lookup", "draft", "medusa", "eagle", "mtp", "hybrid", "quantized")


def cost_curves(models: dict, sizes, reps: int) -> dict:
  return {name: {int(t): float(c) for t, c in
                 bench.measure_cost_curve(m, sizes, cache_len=512, filled=256, reps=reps).items()}
          for name, m in models.items()}


def agreement(ref_model, model, prompts: list, chat: bool, n_new: int) -> float:
  """Share of positions where `model`'s argmax equals `ref_model`'s, teacher forced along
  ref_model's greedy output (prompt and output in one forward of each)."""
  from specjax.decode import _encode

  out = sj.generate(ref_model, prompts, max_new_tokens=n_new, chat=chat, stop_at_eos=False)
  same = total = 0
  for ids, toks in zip(_encode(ref_model, prompts, chat), out.tokens):
    t = jnp.asarray([list(ids) + list(toks)], jnp.int32)
    picks = []
    for m in (ref_model, model):
      logits, _, _ = sj.model.forward_sequence(m.config, m.module(), t)
      picks.append(np.asarray(jnp.argmax(logits[0, -len(toks) - 1:-1], -1)))
    same += int((picks[0] == picks[1]).sum())
    total += len(toks)
  return same / max(1, total)


def prefix_share(a: list, b: list) -> float:
  """The share of a's tokens before its first difference from b."""
  n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
  return n / max(1, len(a))


def llama_cpp_agreement(models: dict, path: str, prompts: list, chat: bool, n_new: int,
                        threads: int) -> dict:
  """Per arithmetic: the share of llama.cpp's greedy tokens (the same GGUF, the same token ids)
  before the arithmetic's greedy output first differs, averaged over prompts (reported, not
  asserted: llama.cpp quantizes activations as Q8_K for its K-quants, and sums in other orders)."""
  from experiments.blocks.llama_runner import LlamaCpp
  from specjax.decode import _encode

  llm = LlamaCpp(path, threads)
  try:
    ids = _encode(models["w4a8"], prompts, chat)
    ref = [llm.decode(list(p), n_new)["tokens"] for p in ids]
  finally:
    llm.close()
  out = {}
  for name, m in models.items():
    toks = sj.generate(m, [list(p) for p in ids], max_new_tokens=n_new, stop_at_eos=False).tokens
    out[name] = float(np.mean([prefix_share(r, t) for r, t in zip(ref, toks)]))
  return out


def methods_on_w4a8(model, prompts: list, chat: bool, n_new: int, repeats: int,
                    names=METHODS) -> list:
  methods = {"autoregressive": "autoregressive", **{m: m for m in names}}
  records = bench.run_cases(model, [bench.Case([p], chat) for p in prompts], methods,
                            max_new_tokens=n_new, repeats=repeats, desc="w4a8 methods")
  table = bench.summarize(records)
  return [{"method": name, **table[name][bench.OVERALL]} for name in methods]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="2 prompts, 32 tokens, short curves")
  ap.add_argument("--model", default=MODEL, help="a GGUF model (default: %(default)s; "
                  "gemma3-270m: Q5_0 / Q8_0 / Q4_K / Q6_K blocks)")
  ap.add_argument("--prompts", type=int, default=10)
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--methods", default=",".join(METHODS),
                  help="methods by name to time on the W4A8 target (comma-separated; '' for none)")
  ap.add_argument("--llama-cpp", action="store_true",
                  help="also report greedy agreement with llama.cpp on the same file "
                  "(llama-cpp-python, an experiments-only tool)")
  ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
  ap.add_argument("--out", default=None, help="results stem (default results / results_quick)")
  args = ap.parse_args(argv)
  names = [m for m in args.methods.split(",") if m]
  n, n_new = (2, 32) if args.quick else (args.prompts, args.max_new_tokens)
  sizes = (1, 4, 16) if args.quick else (1, 2, 4, 8, 16, 32, 64)
  t_start = time.time()
  info = bench.machine_info()
  models = {name: sj.load_model(args.model, **kw) for name, kw in bench.ARITHMETICS.items()}
  templated = getattr(models["w4a8"].tokenizer, "chat_template", None) is not None
  sets = {"chat": (bench.load_prompt_set("mt_bench", n, fallback=True)[0], templated),
          "code": (bench.load_prompt_set("humaneval", n, fallback=True)[0], False)}
  res = {"command": bench.command_line(), "curves": cost_curves(models, sizes, 3 if args.quick else 9),
         "autoregressive": {}, "agreement": {}, "methods": {}, "chat_template": templated}
  if args.llama_cpp:
    from experiments.blocks.llama_runner import import_llama_cpp
    import_llama_cpp()  # says how to install it before anything runs
    res["llama_cpp"] = {}
  for group, (ps, chat) in sets.items():
    ps = list(ps)
    res["autoregressive"][group] = bench.alternating_autoregressive(
        models, ps, chat=chat, max_new_tokens=n_new, repeats=args.repeats)
    res["agreement"][group] = agreement(models["blocks"], models["w4a8"], ps, chat, n_new)
    if args.llama_cpp:
      res["llama_cpp"][group] = llama_cpp_agreement(models, weights.resolve(args.model), ps, chat,
                                                    n_new, args.threads)
    if names:
      res["methods"][group] = methods_on_w4a8(models["w4a8"], ps, chat, n_new,
                                              1 if args.quick else args.repeats, names)
  res["machine"] = bench.finish_machine_info(info, t_start)
  stem = args.out or ("results_quick" if args.quick else "results")
  bench.save_report(HERE, stem, res, report(res))
  print(report(res))


def report(res: dict) -> str:
  lines = [f"`{res['command']}`", "", bench.machine_summary(res["machine"]), "",
           "| arithmetic | " + " | ".join(f"c({t})" for t in next(iter(res["curves"].values())))
           + " | " + " | ".join(f"AR tok/s {g}" for g in res["autoregressive"]) + " |",
           "|---" * (1 + len(next(iter(res["curves"].values()))) + len(res["autoregressive"]))
           + "|"]
  for name, curve in res["curves"].items():
    lines.append(f"| {name} | " + " | ".join(f"{c:.2f}" for c in curve.values()) + " | "
                 + " | ".join(f"{res['autoregressive'][g][name]:.1f}" for g in res["autoregressive"])
                 + " |")
  lines += ["", "int8 activations pick float32 activations' token (teacher forced): "
            + ", ".join(f"{g} {a:.3f}" for g, a in res["agreement"].items())]
  if res.get("chat_template") is False:
    lines += ["", "(the model's tokenizer has no chat template: the chat prompts went in as text)"]
  for g, shares in res.get("llama_cpp", {}).items():
    lines += ["", f"{g}: share of llama.cpp's greedy tokens before each arithmetic's first "
              "difference (same file, same ids): "
              + ", ".join(f"{name} {v:.2f}" for name, v in shares.items())]
  if not res["methods"]:
    return "\n".join(lines) + "\n"
  lines += ["",
            "| method on W4A8 | " + " | ".join(f"{g} speedup (tau) | {g} identical"
                                              for g in res["methods"]) + " |",
            "|---" * (1 + 2 * len(res["methods"])) + "|"]
  groups = list(res["methods"])
  for i, row in enumerate(res["methods"][groups[0]]):
    cells = []
    for g in groups:
      r = res["methods"][g][i]
      cells += [f"{r.get('speedup', float('nan')):.2f}x ({r.get('tau', float('nan')):.2f})",
                str(r.get("identical"))]
    lines.append(f"| {row['method']} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
