"""Batched decoding (issue 46): B prompts in one call against the same prompts one call at a time,
per arithmetic of one checkpoint.

    .venv/bin/python experiments/batched/run.py [--quick] [--batch 16] [--max-new-tokens 64]
        [--arithmetics float32,blocks,w4a8] [--method autoregressive] [--temperature 1.0]
        [--model smollm2-135m]

In one process, for each arithmetic of SmolLM2-135M's GGUF (float32: the default load; blocks:
the file's own blocks with float32 activations; w4a8: the blocks with int8 activations), the
same B chat prompts (MT-Bench, round-robin over its categories; the built-in sample without
../shared/data/prompts) are decoded two ways: as one call of batch B, and as B calls of batch 1.
Sampling (temperature 1, a fixed seed), a fixed number of new tokens per row (EOS does not stop
a row), tok/s over whole calls (tokenizing, prefill and decoding; compiling in an untimed first
call of each shape). The two ways and the arithmetics alternate within every repeat, so load
falls on all alike; each keeps its fastest repeat. The ratio batched / one at a time is what the
issue's goal reads (>= 5x at B = 16 on W4A8).

With --split each way is also timed with one new token (the prefill and the first sample), and
the table gains the prefill's seconds, the decode steps' tok/s (the difference of the two calls),
and the prefill rows each way computes (one call packs the prompts end to end on a CPU; one at a
time pads each prompt to its length bucket).

Writes results.json / results.md (results_quick.* with --quick) here or in --out.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import specjax as sj  # noqa: E402
from specjax import bench  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = "smollm2-135m"


def timed_ways(models: dict, prompts: list, *, method: str, n_new: int, temperature: float,
               repeats: int) -> dict:
  """{arithmetic: {"batched": s, "single": s, "identical": ...}}: the fastest repeat of one call
  of all prompts and of one call per prompt; identical (greedy only, else None): whether every
  row of the batched call has the tokens of its own call (batch invariance, end to end)."""
  kw = dict(max_new_tokens=n_new, temperature=temperature, seed=0, chat=True, stop_at_eos=False)
  ways = {"batched": lambda m: sj.generate(m, prompts, method, **kw),
          "single": lambda m: [sj.generate(m, [p], method, **kw) for p in prompts]}
  best = {a: {w: float("inf") for w in ways} for a in models}
  for a, m in models.items():  # compile both shapes, untimed; greedy rows must agree
    batched, single = ways["batched"](m), ways["single"](m)
    same = [list(t) for t in batched.tokens] == [list(o.tokens[0]) for o in single]
    best[a]["identical"] = same if temperature == 0 else None
  for _ in range(repeats):
    for a, m in models.items():
      for w, run in ways.items():
        t0 = time.perf_counter()
        run(m)
        best[a][w] = min(best[a][w], time.perf_counter() - t0)
  return best


def prefill_rows(model, prompts: list) -> dict:
  """The prefill rows each way computes: one call packs the prompts end to end (a CPU; else it
  pads every prompt to the longest one's length bucket); one call per prompt pads each to its
  own."""
  from specjax.decode import _encode, _prefill
  from specjax.decode._generate import bucket_prompt_len
  from specjax.decode._method import Program
  lengths = [len(t) for t in _encode(model, prompts, True)]
  p = bucket_prompt_len(max(lengths))
  prog = Program(model.graphdef, model.config, sj.methods.Autoregressive(), p + 16, None)
  return {"tokens": sum(lengths), "batched": _prefill.rows_computed(prog, lengths, p),
          "padded": len(lengths) * p, "single": sum(bucket_prompt_len(n) for n in lengths)}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="batch 4, 16 tokens, 1 repeat")
  ap.add_argument("--batch", type=int, default=None, help="prompts per call (default 16)")
  ap.add_argument("--max-new-tokens", type=int, default=None, help="default 64")
  ap.add_argument("--repeats", type=int, default=None, help="default 3")
  ap.add_argument("--model", default=MODEL, help="a named model, a local HF directory or a .gguf")
  ap.add_argument("--arithmetics", default=",".join(bench.ARITHMETICS),
                  help="blocks and w4a8 need a GGUF model")
  ap.add_argument("--method", default="autoregressive", help="a registered method's name")
  ap.add_argument("--temperature", type=float, default=1.0)
  ap.add_argument("--split", action="store_true",
                  help="also time one new token: the prefill apart from the decode steps")
  ap.add_argument("--out", default=HERE, help="folder for results(_quick).json / .md")
  args = ap.parse_args(argv)
  args = bench.with_defaults(args, args.quick,
                             {"batch": 16, "max_new_tokens": 64, "repeats": 3},
                             {"batch": 4, "max_new_tokens": 16, "repeats": 1})
  names = [a for a in args.arithmetics.split(",") if a]
  unknown = sorted(set(names) - set(bench.ARITHMETICS))
  if unknown:
    ap.error(f"unknown arithmetic(s) {unknown}; choose from {sorted(bench.ARITHMETICS)}")
  t_start = time.time()
  info = bench.machine_info()
  prompts = list(bench.load_prompt_set("mt_bench", args.batch, fallback=True)[0])
  if len(prompts) < args.batch:
    ap.error(f"only {len(prompts)} prompts found, --batch {args.batch} needs that many")
  models = {a: sj.load_model(args.model, **bench.ARITHMETICS[a]) for a in names}
  times = timed_ways(models, prompts, method=args.method, n_new=args.max_new_tokens,
                     temperature=args.temperature, repeats=args.repeats)
  tokens = len(prompts) * args.max_new_tokens
  res = {"command": bench.command_line(), "model": args.model, "batch": len(prompts),
         "new_tokens": args.max_new_tokens, "method": args.method,
         "temperature": args.temperature, "repeats": args.repeats,
         "rows": [{"arithmetic": a, "batched_tok_s": tokens / t["batched"],
                   "single_tok_s": tokens / t["single"], "ratio": t["single"] / t["batched"],
                   "identical": t["identical"]}
                  for a, t in times.items()]}
  if args.split:
    res["prefill_rows"] = prefill_rows(next(iter(models.values())), prompts)
    first = timed_ways(models, prompts, method=args.method, n_new=1,
                       temperature=args.temperature, repeats=args.repeats)
    steps = len(prompts) * (args.max_new_tokens - 1)
    for row in res["rows"]:
      t, t1 = times[row["arithmetic"]], first[row["arithmetic"]]
      row.update({f"{w}_prefill_s": t1[w] for w in ("batched", "single")})
      row.update({f"{w}_decode_tok_s": steps / max(t[w] - t1[w], 1e-9)
                  for w in ("batched", "single")})
  res["machine"] = bench.finish_machine_info(info, t_start)
  bench.save_report(args.out, "results_quick" if args.quick else "results", res, report(res))
  print(report(res))


def report(res: dict) -> str:
  lines = [f"`{res['command']}`", "", bench.machine_summary(res["machine"]), "",
           f"{res['model']}, {res['method']}, temperature {res['temperature']}, "
           f"{res['batch']} MT-Bench prompts x {res['new_tokens']} new tokens, whole calls "
           f"(prefill included), fastest of {res['repeats']} repeat(s).", "",
           f"| arithmetic | batch {res['batch']} in one call, tok/s | one at a time, tok/s "
           "| batched / one at a time | rows identical (greedy) |", "|---|---|---|---|---|"]
  for r in res["rows"]:
    same = "-" if r["identical"] is None else str(r["identical"])
    lines.append(f"| {r['arithmetic']} | {r['batched_tok_s']:.1f} | {r['single_tok_s']:.1f} "
                 f"| {r['ratio']:.2f}x | {same} |")
  if "prefill_rows" not in res:
    return "\n".join(lines) + "\n"
  rows = res["prefill_rows"]
  lines += ["", f"The prompts: {rows['tokens']} tokens; prefill rows {rows['batched']} in one "
            f"call (padded to the longest prompt's bucket: {rows.get('padded', '-')}), "
            f"{rows['single']} one at a time.", "",
            "| arithmetic | prefill s, one call | prefill s, one at a time | decode tok/s, one "
            "call | decode tok/s, one at a time |", "|---|---|---|---|---|"]
  for r in res["rows"]:
    lines.append(f"| {r['arithmetic']} | {r['batched_prefill_s']:.2f} | "
                 f"{r['single_prefill_s']:.2f} | {r['batched_decode_tok_s']:.1f} | "
                 f"{r['single_decode_tok_s']:.1f} |")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
