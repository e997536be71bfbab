"""Cost of one Medusa step on this device vs one autoregressive step (SmolLM2-135M, batch 1).

Untrained heads (each starts as the target's LM head), so nearly every step emits one token and
wall time / target calls is the cost of a step: heads + top-k + the (N+1)-token tree forward +
verification + committing the path. Compares heads that score the whole vocabulary through the
target's LM head with heads that score the shipped draft's 8192-token subset.

    PYTHONPATH=. python experiments/medusa/step_cost.py [--quick]
"""

import argparse


import specjax as sj
from specjax import tree as T

ap = argparse.ArgumentParser()
ap.add_argument("--quick", action="store_true")
ap.add_argument("--nodes", default="4,8,16,32")
args = ap.parse_args()

target = sj.load_model("smollm2-135m")
prompts = ["Explain how a hash table works.", "def quicksort(xs):"]
max_new = 32 if args.quick else 64
subset = sj.load_model("smollm2-135m-draft").vocab_subset


def per_step_ms(method, reps=2):
  best = None
  for _ in range(reps):
    tot_ms, calls = 0.0, 0
    for p in prompts:
      out = sj.generate(target, [p], method, max_new_tokens=max_new, stop_at_eos=False)
      tot_ms += 1e3 * out.stats["wall_time_s"]
      calls += sum(out.stats["target_calls_per_row"]) - 1  # loop steps (prefill excluded, roughly)
    v = tot_ms / calls
    best = v if best is None else min(best, v)
  return best


ar = per_step_ms(sj.Autoregressive())
print(f"autoregressive: {ar:.1f} ms/step")
for n in map(int, args.nodes.split(",")):
  tree = T.default_tree(4, n)
  for name, vocab in [("full head", None), ("subset 8192", subset)]:
    heads = sj.init_heads(target, "medusa", num_heads=4, vocab=vocab)
    ms = per_step_ms(sj.Medusa(heads, tree=tree, acceptance="greedy"))
    print(f"medusa N={n:2d} ({name}): {ms:.1f} ms/step = {ms / ar:.2f} x AR step")
