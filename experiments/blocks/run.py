"""Decoding on the GGUF's own blocks against float32, and a quantized self-draft on top (issue 28).

    .venv/bin/python experiments/blocks/run.py [--quick] [--repeats 3] [--max-new-tokens 128]

Loads SmolLM2-135M twice in one process: float32 (the default, on the fp32 CPU kernel) and
`weights="blocks"` (the Q4_1 / Q8_0 blocks as stored, through the blocks kernel; the same
weights, so the same tokens under greedy decoding). For chat (MT-Bench) and code (HumanEval)
prompts, batch 1 and 4, greedy and temperature 0.7, it times each configuration:

    float32 autoregressive | blocks autoregressive | blocks + quantized self-draft (if registered)

alternating configurations within every repeat (the machine's load falls on all of them alike)
and keeping the fastest repeat of each (the least disturbed). tok/s counts generated tokens.
Ratios are against float32 autoregressive in the same process. Writes results.json / results.md
here (results_quick.* with --quick).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import specjax as sj  # noqa: E402
from specjax import bench, methods  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def configurations(fp32, blocks) -> list[tuple[str, object, object]]:
  out = [("float32 autoregressive", fp32, sj.Autoregressive()),
         ("blocks autoregressive", blocks, sj.Autoregressive())]
  if methods.canonical("quantized") is not None:
    out.append(("blocks + quantized draft", blocks, methods.build("quantized", blocks)))
  return out


def time_cell(configs, prompts, chat, batch, temperature, n_new, repeats) -> list[dict]:
  """One (prompt set, batch, temperature) cell: every configuration, alternating, fastest run."""
  rows = [prompts[i:i + batch] for i in range(0, len(prompts) - batch + 1, batch)]
  best = {label: [] for label, _, _ in configs}
  stats = {}
  for group in rows:
    times = {label: float("inf") for label, _, _ in configs}
    for r in range(repeats + 1):  # the first round compiles and warms: not timed
      for label, model, method in configs:
        t0 = time.perf_counter()
        out = sj.generate(model, group, method, max_new_tokens=n_new, chat=chat,
                          temperature=temperature, seed=r, stop_at_eos=False)
        dt = time.perf_counter() - t0
        if r:
          times[label] = min(times[label], dt)
          stats[label] = out.stats
    for label in times:
      best[label].append(batch * n_new / times[label])
  base = bench.median(best[configs[0][0]])
  return [{"config": label, "tok_s": bench.median(v), "ratio": bench.median(v) / base,
           "alpha": stats[label].get("alpha"), "tau": stats[label].get("mean_accepted")} for label, v in best.items()]


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--quick", action="store_true", help="2 prompts per set, 64 tokens, batch 1")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--num-prompts", type=int, default=4)
  a = ap.parse_args()
  n_new = 64 if a.quick else a.max_new_tokens
  n_prompts = 2 if a.quick else a.num_prompts
  batches = (1,) if a.quick else (1, 4)
  info, t_start = bench.machine_info(), time.time()
  fp32 = sj.load_model("smollm2-135m")
  blocks = sj.load_model("smollm2-135m", weights="blocks")
  configs = configurations(fp32, blocks)
  results = []
  for spec in ("mt_bench", "humaneval"):
    ps, chat = bench.load_prompt_set(spec, max(n_prompts, max(batches)))
    for batch in batches:
      for temperature in (0.0, 0.7):
        for row in time_cell(configs, list(ps), chat, batch, temperature, n_new, a.repeats):
          results.append({"prompts": spec, "batch": batch, "temperature": temperature, **row})
          print(results[-1], flush=True)
  info = bench.finish_machine_info(info, t_start)
  cols = [("prompts", "prompts", "s"), ("batch", "batch", "d"), ("temperature", "T", ".1f"),
          ("config", "configuration", "s"), ("tok_s", "tok/s", ".1f"),
          ("ratio", "x float32 AR", ".2f"), ("alpha", "draft acceptance", ".3f"),
          ("tau", "tokens per target call", ".2f")]
  md = f"{bench.machine_summary(info)}\n\n`{info['command']}`\n\n" + bench.markdown_table(results, cols)
  print(md)
  bench.save_report(HERE, "results_quick" if a.quick else "results",
                    {"machine": info, "results": results}, md)


if __name__ == "__main__":
  main()
