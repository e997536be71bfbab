"""How far can copying take a prompt set? An oracle's bound, from greedy outputs (issue 29).

    .venv/bin/python experiments/hybrid/copy_bound.py [--prompts N] [--max-new-tokens T]
                                                      [--sets A,B] [--out copy_bound.json]

For each prompt (batch 1, greedy, chat template, `stop_at_eos=False`, SmolLM2-135M) it decodes
autoregressively and then replays the output against a copying oracle: at each verification step,
with i output tokens accepted, the oracle drafts the longest run y[i:i+L] that occurs anywhere in
the context so far (the prompt and y[:i], which is what prompt lookup and suffix decoding search),
at most K tokens, and the step accepts L + 1 (the run and the target's own next token). No real
copying drafter does better: prompt lookup and suffix decoding pick their run from the last
tokens, without seeing the answer. The oracle's tau (tokens per target forward) is reported for
K = 6 (the hybrid's default tree on this machine), 16 and unbounded.

With the same process's times of the autoregressive call (A) and of its first token alone (F: the
prompt's prefill), a method with tau t whose steps cost what one autoregressive step costs, and
whose drafting is free, takes F + (A - F) / t. So it is at most A / (F + (A - F) / t) times
faster than autoregressive decoding over the whole call, and A / F with t unbounded; and the
whole-call 2x that issue 29 asks for needs t >= (A - F) / (A / 2 - F), at least this much (more
where a wide verification costs more than one step). Reported per set: medians over prompts.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import specjax as sj  # noqa: E402
from specjax import bench  # noqa: E402
from specjax import decode  # noqa: E402

def _hybrid_run():
  """This folder's run.py (its prompt sets and writer), loaded by path under its own name."""
  spec = importlib.util.spec_from_file_location(
      "experiment_hybrid_run", os.path.join(os.path.dirname(os.path.abspath(__file__)), "run.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


SETS = ["spec_bench:summarization", "spec_bench:rag", "code_edit", "mt_bench"]
LIMITS = (6, 16, None)


def longest_copy(context: list[int], ahead: list[int], limit: int | None) -> int:
  """The longest prefix of `ahead` (at most `limit` tokens) that occurs in `context`."""
  best = 0
  cap = len(ahead) if limit is None else min(limit, len(ahead))
  if cap == 0:
    return 0
  first = ahead[0]
  for j, c in enumerate(context):
    if c != first:
      continue
    n = 1
    while n < cap and j + n < len(context) and context[j + n] == ahead[n]:
      n += 1
    best = max(best, n)
    if best == cap:
      break
  return best


def oracle_tau(prompt: list[int], out: list[int], limit: int | None) -> float:
  """Tokens per target forward of the copying oracle (module docstring) on output `out`."""
  i = steps = 0
  while i < len(out):
    i += longest_copy(prompt + out[:i], out[i:], limit) + 1
    steps += 1
  return len(out) / steps


def needed_tau(ar: float, first: float) -> float:
  """The least tau at which free drafting and one-step verification give a whole-call 2x."""
  return (ar - first) / (ar / 2 - first) if ar / 2 > first else math.inf


def run(args) -> dict:
  hybrid_run = _hybrid_run()
  model = sj.load_model("smollm2-135m")
  out = {"command": "python experiments/hybrid/copy_bound.py " + " ".join(sys.argv[1:]),
         "load_before": os.getloadavg(), "sets": {}}
  for kind in args.sets.split(","):
    rows = []
    for p in hybrid_run.load_set(kind, args.prompts):
      call = lambda n: sj.generate(model, [p], max_new_tokens=n, chat=True,  # noqa: E731
                                   stop_at_eos=False)
      o = call(args.max_new_tokens)  # compiles; greedy, so every run gives these tokens
      ar = min(bench.time_call(lambda: call(args.max_new_tokens), args.repeats))
      call(1)
      first = min(bench.time_call(lambda: call(1), args.repeats))
      ids = decode._encode(model, [p], True)[0]
      taus = {str(k): oracle_tau(ids, o.tokens[0], k) for k in LIMITS}
      free = ar / first
      rows.append(dict(prompt_tokens=len(ids), ar_s=ar, first_s=first, tau=taus,
                       bound=ar / (first + (ar - first) / taus["None"]), free_decode=free,
                       needed_tau=needed_tau(ar, first)))
      print(kind, json.dumps(rows[-1]), flush=True)
    med = lambda key: round(statistics.median(r[key] for r in rows), 2)  # noqa: E731
    out["sets"][kind] = dict(
        prompts=len(rows), prompt_tokens=med("prompt_tokens"), ar_s=med("ar_s"),
        first_s=med("first_s"),
        oracle_tau={str(k): round(statistics.median(r["tau"][str(k)] for r in rows), 2)
                    for k in LIMITS},
        bound=med("bound"), free_decode=med("free_decode"), needed_tau=med("needed_tau"),
        rows=rows)
    out["load_after"] = os.getloadavg()
    hybrid_run.save(out, args.out)
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--prompts", type=int, default=10)
  ap.add_argument("--sets", default=",".join(SETS), help="comma-separated prompt sets")
  ap.add_argument("--out", default="copy_bound.json", help="results file, beside this script")
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--repeats", type=int, default=2, help="timed runs per call (the fastest kept)")
  args = ap.parse_args()
  res = run(args)
  for kind, s in res["sets"].items():
    print(f"{kind}: prompt {s['prompt_tokens']} tokens, AR {s['ar_s']} s, first token "
          f"{s['first_s']} s; oracle tau {s['oracle_tau']}; whole-call bound {s['bound']}x "
          f"(free decoding {s['free_decode']}x); 2x needs tau >= {s['needed_tau']}")


if __name__ == "__main__":
  main()
