"""Decoding on the GGUF's own blocks against float32, a quantized self-draft on top, and llama.cpp
on the same file (issue 28).

    .venv/bin/python experiments/blocks/run.py [--quick] [--repeats 3] [--max-new-tokens 128]
    .venv/bin/python experiments/blocks/run.py --llama-cpp      # adds llama.cpp (llama-cpp-python)

Loads SmolLM2-135M twice in one process: float32 (the default, on the fp32 CPU kernel) and
`weights="blocks"` (the Q4_1 / Q8_0 blocks as stored, through the blocks kernel; the same
weights, so the same tokens under greedy decoding). For chat (MT-Bench) and code (HumanEval)
prompts, batch 1 and 4, greedy and temperature 0.7, it times each configuration:

    float32 autoregressive | blocks autoregressive | blocks + quantized self-draft
    | blocks + quantized self-draft drafted by prompt lookup (multi-level) | llama.cpp (batch 1)

alternating configurations within every repeat (the machine's load falls on all of them alike)
and keeping the fastest repeat of each (the least disturbed). tok/s counts generated tokens over
the whole call (tokenising, prefill and decoding; compilation excluded by an untimed first round).
Ratios are against float32 autoregressive in the same process; `x blocks AR` against blocks
autoregressive. Greedy rows also give the share of each configuration's tokens that equal float32
autoregressive decoding's up to its first difference (`same as AR`: 1.00 for every exact method).

llama.cpp runs the same GGUF file through llama-cpp-python (llama_runner.py here, shared with
experiments/spec_bench) with 2 threads (`--threads`) on the same token ids (the chat template
applied by the model's own tokenizer), generating exactly as many tokens (no EOS stop), greedy
(top-k 1) or at T with top-k / top-p / min-p off. It computes
with 8-bit activations (Q4_1 x Q8_1), so it is not the float32 model and its greedy tokens may
differ. Every llama.cpp call evaluates its whole prompt, as every sj.generate call does (its
cache is reset first). Beside tok/s, the autoregressive configurations and llama.cpp report the
first token's time and the rate after it (specjax: a one-token call timed beside the full one;
llama.cpp: its own timers). Install it with

    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python    # builds llama.cpp from source

Writes results.json / results.md here (results_quick.* with --quick).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import specjax as sj  # noqa: E402
from experiments.blocks.llama_runner import LlamaCpp  # noqa: E402
from specjax import bench, weights  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = "smollm2-135m"


def specjax_runner(model, method):
  """A configuration that decodes with sj.generate: (prompts, chat, T, n_new, seed) -> rows."""
  def run(group, chat, temperature, n_new, seed):
    out = sj.generate(model, group, method, max_new_tokens=n_new, chat=chat,
                      temperature=temperature, seed=seed, stop_at_eos=False)
    return [list(map(int, t)) for t in out.tokens], out.stats
  return run


def llama_cpp_runner(model, threads: int):
  """A configuration that decodes with llama.cpp on the same GGUF, one prompt at a time
  (experiments/blocks/llama_runner.py)."""
  llm = LlamaCpp(weights.resolve(MODEL), threads)

  def run(group, chat, temperature, n_new, seed):
    rows, eval_s, evals, prompt_s = [], 0.0, 0, 0.0
    for p in group:
      ids = sj.decode._encode(model, [p], chat)[0]  # the ids sj.generate feeds
      out = llm.decode(ids, n_new, temperature, seed)
      rows.append(out["tokens"])
      eval_s, evals = eval_s + out["eval_s"], evals + out["evals"]
      prompt_s += out["prompt_s"]
    # llama.cpp's own timers: the prompt's evaluation, and the decoding after the first token.
    return rows, {"first_token_s": prompt_s, "decode_tok_s": evals / eval_s if eval_s else None,
                  "llama_cpp_version": llm.version}
  run.close = llm.close
  return run


def configurations(fp32, blocks, llama_threads: int | None):
  out = [("float32 autoregressive", specjax_runner(fp32, sj.Autoregressive())),
         ("blocks autoregressive", specjax_runner(blocks, sj.Autoregressive())),
         ("blocks + quantized draft", specjax_runner(blocks, sj.QuantizedDraft())),
         ("blocks + quantized draft + lookup (multi-level)",
          specjax_runner(blocks, sj.QuantizedDraft(gamma=6, lookup=4)))]
  if llama_threads:
    out.append((f"llama.cpp, {llama_threads} threads", llama_cpp_runner(fp32, llama_threads)))
  return out


# Configurations whose first token is also timed alone (a one-token call: tokenising, prefill,
# the first sample), so that their decoding rate after it can stand beside llama.cpp's own.
FIRST_TOKEN = ("float32 autoregressive", "blocks autoregressive")


def time_cell(configs, prompts, chat, batch, temperature, n_new, repeats) -> list[dict]:
  """One (prompt set, batch, temperature) cell: every configuration, alternating, fastest run."""
  groups = [prompts[i:i + batch] for i in range(0, len(prompts) - batch + 1, batch)]
  labels = [label for label, _ in configs if batch == 1 or not label.startswith("llama.cpp")]
  best = {label: [] for label in labels}
  first = {label: [] for label in labels}  # seconds to the first token, per group
  decode = {label: [] for label in labels}  # tok/s after the first token, per group
  stats, tokens = {}, {label: [] for label in labels}
  for group in groups:
    times = {label: float("inf") for label in labels}
    t_first = {label: float("inf") for label in labels}
    fastest = {}
    for r in range(repeats + 1):  # the first round compiles and warms: not timed
      for label, run in configs:
        if label not in times:
          continue
        t0 = time.perf_counter()
        rows, st = run(group, chat, temperature, n_new, r)
        dt = time.perf_counter() - t0
        if label in FIRST_TOKEN:
          t1 = time.perf_counter()
          run(group, chat, temperature, 1, r)
          if r:
            t_first[label] = min(t_first[label], time.perf_counter() - t1)
        if r and dt < times[label]:
          times[label], fastest[label] = dt, st
        if r == 1:
          tokens[label] += rows
    for label in times:
      best[label].append(batch * n_new / times[label])
      st = fastest[label]
      stats[label] = st
      if label in FIRST_TOKEN:
        first[label].append(t_first[label])
        decode[label].append(batch * (n_new - 1) / (times[label] - t_first[label]))
      elif st.get("decode_tok_s") is not None:  # llama.cpp's own timers
        first[label].append(st["first_token_s"])
        decode[label].append(st["decode_tok_s"])
  base, blocks_ar = bench.median(best[labels[0]]), bench.median(best[labels[1]])
  out = []
  for label in labels:
    s, v = stats[label], bench.median(best[label])
    same = bench.agreement(tokens[label], tokens[labels[0]])[1] if temperature == 0 else None
    out.append({"config": label, "tok_s": v, "ratio": v / base, "ratio_blocks": v / blocks_ar,
                "first_token_ms": 1e3 * bench.median(first[label]) if first[label] else None,
                "decode_tok_s": bench.median(decode[label]) if decode[label] else None,
                "alpha": s.get("alpha"), "tau": s.get("mean_accepted"),
                "acceptance_by_position": s.get("acceptance_by_position"),
                "same_as_ar": same,
                **{k: s[k] for k in s if k.startswith("llama_cpp")}})
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--quick", action="store_true", help="2 prompts per set, 64 tokens, batch 1")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--num-prompts", type=int, default=4)
  ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,4)")
  ap.add_argument("--llama-cpp", action="store_true", help="add llama.cpp on the same GGUF")
  ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
  ap.add_argument("--out", default=None, help="results file stem (default results[_quick])")
  a = ap.parse_args()
  n_new = 64 if a.quick else a.max_new_tokens
  n_prompts = 2 if a.quick else a.num_prompts
  batches = tuple(int(b) for b in a.batches.split(",")) if a.batches else \
      ((1,) if a.quick else (1, 4))
  info, t_start = bench.machine_info(), time.time()
  fp32 = sj.load_model(MODEL)
  blocks = sj.load_model(MODEL, weights="blocks")
  configs = configurations(fp32, blocks, a.threads if a.llama_cpp else None)
  results = []
  for spec in ("mt_bench", "humaneval"):
    ps, chat = bench.load_prompt_set(spec, max(n_prompts, max(batches)))
    for batch in batches:
      for temperature in (0.0, 0.7):
        for row in time_cell(configs, list(ps)[:max(n_prompts, batch)], chat, batch,
                             temperature, n_new, a.repeats):
          results.append({"prompts": spec, "batch": batch, "temperature": temperature, **row})
          print(results[-1], flush=True)
  for _, run in configs:
    getattr(run, "close", lambda: None)()
  info = bench.finish_machine_info(info, t_start)
  cols = [("prompts", "prompts", "s"), ("batch", "batch", "d"), ("temperature", "T", ".1f"),
          ("config", "configuration", "s"), ("tok_s", "tok/s", ".1f"),
          ("ratio", "x float32 AR", ".2f"), ("ratio_blocks", "x blocks AR", ".2f"),
          ("first_token_ms", "first token (ms)", ".0f"),
          ("decode_tok_s", "tok/s after the first", ".1f"),
          ("alpha", "draft acceptance", ".3f"), ("tau", "tokens per target call", ".2f"),
          ("same_as_ar", "same as AR (greedy)", ".2f")]
  md = f"{bench.machine_summary(info)}\n\n`{info['command']}`\n\n" + bench.markdown_table(results, cols)
  print(md)
  bench.save_report(HERE, a.out or ("results_quick" if a.quick else "results"),
                    {"machine": info, "results": results}, md)


if __name__ == "__main__":
  main()
