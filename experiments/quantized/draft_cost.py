"""The quantized self-draft's cost q = one draft forward / one target decode step, per target
arithmetic (float32, the GGUF's blocks, W4A8) and draft bit width (4: Q4_1, 8: Q8_0), timed on
this device: the figures behind specjax/methods/defaults.py's QUANTIZED_COST, which sizes the
`quantized` method's gamma where nothing is recorded.

    .venv/bin/python experiments/quantized/draft_cost.py [--quick] [--reps 30] [--rounds 3]

Batch 1, 512 cache slots with 256 filled (`specjax.calibrate.measure_cost_ratio`: jitted forwards,
timed back to back); each (arithmetic, bits) pair is measured --rounds times, interleaved, and the
median kept. Writes draft_cost.md / .json here, or in --out (draft_cost_quick with --quick).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import specjax as sj  # noqa: E402
from specjax import bench, calibrate  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = "smollm2-135m"
BITS = (4, 8)


def measure(models: dict, reps: int, rounds: int) -> dict:
  """{arithmetic: {bits: {"q": median, "qs": [...], "target_step_ms": median}}}."""
  raw = {(a, b): [] for a in models for b in BITS}
  for _ in range(rounds):
    for (a, b), out in raw.items():
      out.append(calibrate.measure_cost_ratio(models[a], sj.QuantizedDraft(bits=b, gamma=3),
                                              reps=reps))
  res = {a: {} for a in models}
  for (a, b), outs in raw.items():
    qs = [o["c"] for o in outs]
    res[a][b] = {"q": statistics.median(qs), "qs": qs,
                 "target_step_ms": statistics.median(o["target_step_ms"] for o in outs),
                 "draft_step_ms": statistics.median(o["draft_step_ms"] for o in outs)}
  return res


def report(res: dict) -> str:
  lines = [f"`{res['command']}`", "", bench.machine_summary(res["machine"]), "",
           "| target | target step (ms) | " + " | ".join(f"q at {b} bits (draft ms)" for b in BITS)
           + " |", "|---" * (2 + len(BITS)) + "|"]
  for a, row in res["q"].items():
    step = row[BITS[0]]["target_step_ms"]
    lines.append(f"| {a} | {step:.2f} | " + " | ".join(
        f"{row[b]['q']:.2f} ({row[b]['draft_step_ms']:.2f})" for b in BITS) + " |")
  return "\n".join(lines) + "\n"


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="5 reps, 1 round")
  ap.add_argument("--reps", type=int, default=30)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--model", default=MODEL, help="a model name or path (a GGUF file)")
  ap.add_argument("--out", default=HERE, help="the folder for the results files")
  args = ap.parse_args(argv)
  reps, rounds = (5, 1) if args.quick else (args.reps, args.rounds)
  t_start = time.time()
  info = bench.machine_info()
  models = {a: sj.load_model(args.model, tokenizer=False, **kw)
            for a, kw in bench.ARITHMETICS.items()}
  res = {"command": bench.command_line(), "q": measure(models, reps, rounds)}
  res["machine"] = bench.finish_machine_info(info, t_start)
  stem = "draft_cost_quick" if args.quick else "draft_cost"
  bench.save_report(args.out, stem, res, report(res))
  print(report(res))


if __name__ == "__main__":
  main()
