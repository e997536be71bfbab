"""Prompt lookup draft length on this CPU: the forward cost curve, then AR vs PromptLookup(3, k)
for k in {3, 5, 10} on Spec-Bench summarization and RAG prompts, in one process (batch 1, greedy,
chat template, 128 new tokens; best of 2 timed runs after a warm-up).

    .venv/bin/python experiments/training_free/pld_sweep.py [--prompts 2]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import run as tf  # noqa: E402  (the training-free experiment's prompt loader and cost curve)

import specjax as sj  # noqa: E402


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--prompts", type=int, default=2)
  ap.add_argument("--max-new", type=int, default=128)
  a = ap.parse_args()
  m = sj.load_model("smollm2-135m")
  curve = tf.cost_curve(m, [1, 2, 4, 6, 8, 11, 16], reps=5)
  print("forward ms by tokens:", {k: round(v, 1) for k, v in curve.items()}, flush=True)
  ps = tf.load_prompts(a.prompts)
  methods = {"ar": sj.Autoregressive(), "pld k=3": sj.PromptLookup(3, 3),
             "pld k=5": sj.PromptLookup(3, 5), "pld k=10": sj.PromptLookup(3, 10)}
  for cat in ("summarization", "rag"):
    for prompt, chat in ps.get(cat, []):
      kw = dict(max_new_tokens=a.max_new, chat=chat)
      for me in methods.values():
        sj.generate(m, [prompt], me, **kw)
      res = {}
      for name, me in methods.items():
        outs = [sj.generate(m, [prompt], me, **kw) for _ in range(2)]
        res[name] = (min(o.stats["wall_time_s"] for o in outs), outs[-1].stats["mean_accepted"])
      base = res["ar"][0]
      print(cat, "  ".join(f"{n}: {base / t:.2f}x tau {tau:.2f}" for n, (t, tau) in res.items()),
            flush=True)


if __name__ == "__main__":
  main()
