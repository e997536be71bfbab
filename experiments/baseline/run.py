"""specjax autoregressive vs transformers' PyTorch generate on the same weights (SmolLM2-135M,
fp32, greedy, batch 1, 128 new tokens), plus the fraction of the memory-bandwidth bound.

    .venv/bin/python experiments/baseline/run.py [--repeats 5] [--json out.json]
"""

import argparse
import json

from specjax import bench, prompts


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", default="smollm2-135m")
  ap.add_argument("--num-prompts", type=int, default=3)
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--json", default="")
  a = ap.parse_args()
  ps = prompts.load("mt_bench", a.num_prompts)
  r = bench.bench_vs_transformers(a.model, ps, max_new_tokens=a.max_new_tokens, repeats=a.repeats)
  print(json.dumps({k: v for k, v in r.items()}, indent=1))
  print(f"\nspecjax {r['specjax_tok_s']:.1f} tok/s, transformers {r['transformers_tok_s']:.1f} tok/s, "
        f"ratio {r['ratio']:.2f}x; bound {r['bound_tok_s']:.1f} tok/s "
        f"({r['weight_bytes'] / 1e6:.0f} MB / {r['read_bandwidth_GBs']:.1f} GB/s), "
        f"specjax at {100 * r['fraction_of_bound']:.0f}% of it")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(r, f, indent=1)


if __name__ == "__main__":
  main()
