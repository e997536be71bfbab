"""A draft model on GGUF blocks of its own, beside a target on its GGUF's blocks (issue 46, item 4).

    .venv/bin/python experiments/draft_blocks/run.py [--prompts 5] [--new 128] [--gammas 2,3,4]
        [--qtypes Q8_0,Q4_1] [--sets mt_bench,humaneval] [--out DIR]

The target is SmolLM2-135M on its Q4_1 GGUF's blocks (`weights="blocks"`, float32 activations:
the fastest exact autoregressive decoding here). The shipped draft (`smollm2-135m-draft`) is
built on it three ways: float32 (with $SPECJAX_DRAFTER_BLOCKS=0), and rounded to Q8_0 and Q4_1 blocks
of its own (`specjax.packing.to_blocks`, gguf's reference quantizer; its vocabulary subset's head
rows too), so its one- and few-token forwards run on the same blocks kernel as the target. Each
variant drafts at each gamma; `draft (named)` is `sj.generate(model, p, "draft")` with its
defaults (the Q8_0 draft `load_model` now builds beside a blocks target, gamma from the cost
curve and the bytes it reads). Every method is timed against autoregressive decoding on the same prompts in one
process (`specjax.bench.run_cases`: baseline runs around each method run, median per-prompt
ratio), greedy, batch 1, fixed length; every row must be token-identical to autoregressive
decoding (the target verifies, so a rounded draft changes tau, never the text).

Writes results.json / results.md into --out (default: this folder).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import specjax as sj  # noqa: E402
from specjax import bench, packing, prompts  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def methods_for(draft, qtypes, gammas) -> dict:
  variants = {"float32": draft, **{q: packing.to_blocks(draft, q, head=draft.vocab_subset is None)
                                   for q in qtypes}}
  out = {"autoregressive": sj.Autoregressive(), "draft (named)": "draft"}
  for label, d in variants.items():
    for g in gammas:
      out[f"draft {label}, gamma {g}"] = sj.DraftModel(d, gamma=g)
  return out


def render(res: dict) -> str:
  lines = ["# A draft model on blocks of its own", "",
           f"{bench.machine_summary(res['info'])}", "",
           f"Target: SmolLM2-135M on its GGUF's Q4_1 blocks; autoregressive "
           f"{res['ar_tok_s']:.1f} tok/s (median over prompts). {res['prompts']} prompt(s) per "
           f"set, {res['new']} new tokens, greedy, batch 1. Command: `{res['info']['command']}`.", ""]
  rows = [dict(method=m, **{f"{s}_{k}": c[k] for s, c in by_set.items() for k in c})
          for m, by_set in res["summary"].items()]
  sets = list(next(iter(res["summary"].values())))
  cols = [("method", "method", "s")]
  for s in sets:
    cols += [(f"{s}_speedup", f"{s} speedup", ".2f"), (f"{s}_tau", f"{s} tau", ".2f"),
             (f"{s}_identical", f"{s} identical", "")]
  lines.append(bench.markdown_table(rows, cols))
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--prompts", type=int, default=5)
  ap.add_argument("--new", type=int, default=128)
  ap.add_argument("--gammas", default="2,3,4")
  ap.add_argument("--qtypes", default="Q8_0,Q4_1")
  ap.add_argument("--sets", default="mt_bench,humaneval")
  ap.add_argument("--repeats", type=int, default=1)
  ap.add_argument("--out", default=HERE)
  args = ap.parse_args(argv)
  t0 = time.time()
  info = bench.machine_info()
  info["command"] = bench.command_line(argv and [__file__, *argv])
  target = sj.load_model("smollm2-135m", weights="blocks")
  # The float32 draft: as load_model built it before drafters beside blocks took blocks.
  os.environ[packing.DRAFTER_ENV] = "0"
  draft = sj.load_model("smollm2-135m-draft", target=target)
  del os.environ[packing.DRAFTER_ENV]
  methods = methods_for(draft, [q for q in args.qtypes.split(",") if q],
                        [int(g) for g in args.gammas.split(",")])
  cases = []
  for s in args.sets.split(","):
    ps, chat = prompts.load_prompt_set(s, args.prompts, fallback=True)
    cases += [bench.Case([p], chat, group=s) for p in ps]
  records = bench.run_cases(target, cases, methods, max_new_tokens=args.new,
                            repeats=args.repeats, desc="draft_blocks")
  table = bench.summarize(records)
  summary = {m: {s: {"speedup": c["speedup"], "tau": c["tau"], "identical": c.get("identical")}
                 for s, c in by_set.items()} for m, by_set in table.items()}
  ar = [r["tok_s"] for r in records if r["method"] == "autoregressive"]
  res = {"info": bench.finish_machine_info(info, t0), "prompts": args.prompts, "new": args.new,
         "ar_tok_s": bench.median(ar), "summary": summary, "records": records}
  bench.save_report(args.out, "results", res, render(res))
  print(render(res))
  return res


if __name__ == "__main__":
  main()
