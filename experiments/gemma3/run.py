"""Gemma 3 270M (Q4_K_M GGUF) on CPU: specjax's autoregressive decoding against transformers'
generate on the same file in the same run, then prompt lookup, lookahead and layer-skip (tau and
speedup over specjax's autoregressive decoding), greedy, batch 1.

    .venv/bin/python experiments/gemma3/run.py --quick        # 2 prompts, 64 tokens, 3 runs each
    .venv/bin/python experiments/gemma3/run.py --prompts 5 --new 128

Every timed number is the median of --repeats runs after a warm-up run (the first run of a program
compiles it; transformers' first generate warms its kernels too). Methods alternate with
autoregressive runs on each prompt, so load on a shared machine hits both sides of a speedup
alike. Every method's tokens are checked against autoregressive decoding (greedy, lossless), and
specjax's autoregressive tokens against transformers'. The load average is printed before and
after: numbers taken under load are slower than on an idle machine, and say so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import specjax as sj
from specjax import prompts, weights


def load_line() -> str:
  one, five, fifteen = os.getloadavg()
  return f"load average {one:.2f} {five:.2f} {fifteen:.2f} ({os.cpu_count()} cores)"


def timed(run, repeats: int):
  """run() once to warm up, then `repeats` times -> (last output, median wall seconds)."""
  run()
  walls, out = [], None
  for _ in range(repeats):
    t = time.perf_counter()
    out = run()
    walls.append(time.perf_counter() - t)
  return out, statistics.median(walls)


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="2 prompts, 64 new tokens, 3 repeats")
  ap.add_argument("--prompts", type=int, default=5)
  ap.add_argument("--new", type=int, default=128)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--set", default="humaneval", help="prompt set (specjax.prompts.load)")
  ap.add_argument("--exit-layer", type=int, default=6, help="layer-skip's draft depth (of 18)")
  ap.add_argument("--torch-threads", type=int, default=0, help="0: torch's default")
  ap.add_argument("--blocks", action="store_true",
                  help="add specjax autoregressive with weights='blocks' (the GGUF's own blocks)")
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results.json"))
  args = ap.parse_args(argv)
  if args.quick:
    args.prompts, args.new, args.repeats = 2, 64, 3

  import torch
  from transformers import AutoModelForCausalLM

  if args.torch_threads:
    torch.set_num_threads(args.torch_threads)
  print("#", load_line(), flush=True)
  t = time.perf_counter()
  model = sj.load_model("gemma3-270m")
  print(f"# specjax load {time.perf_counter() - t:.1f} s", flush=True)
  path = weights.resolve("gemma3-270m")
  t = time.perf_counter()
  ref = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                             dtype=torch.float32).eval()
  print(f"# transformers load {time.perf_counter() - t:.1f} s, torch threads "
        f"{torch.get_num_threads()}", flush=True)

  methods = {
      "prompt lookup (ngram 3, 10 tokens)": sj.PromptLookup(ngram=3, num_tokens=10),
      "lookahead (W 4, N 3, G 4)": sj.Lookahead(window=4, ngram=3, guess=4),
      f"layer-skip (exit {args.exit_layer}, gamma 3)": sj.SelfSpeculative(
          exit_layer=args.exit_layer, gamma=3),
  }
  blocks = sj.load_model("gemma3-270m", weights="blocks", tokenizer=False) if args.blocks else None
  ps = prompts.load(args.set, args.prompts, fallback=True)
  kw = dict(max_new_tokens=args.new, stop_at_eos=False)
  rows = {name: [] for name in ["transformers generate", "specjax autoregressive",
                                *(["specjax autoregressive, blocks"] if blocks else []), *methods]}
  for i, p in enumerate(ps):
    ids = model.tokenizer.encode(p)
    ar, ar_s = timed(lambda: sj.generate(model, [ids], **kw), args.repeats)
    x = torch.tensor([ids])

    def hf():
      with torch.no_grad():
        return ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.new,
                            do_sample=False, eos_token_id=None, pad_token_id=0)
    out, hf_s = timed(hf, args.repeats)
    same = out[0, len(ids):].tolist() == ar.tokens[0]
    rows["transformers generate"].append(dict(tok_s=args.new / hf_s, identical=same))
    rows["specjax autoregressive"].append(dict(tok_s=args.new / ar_s, speedup=1.0, tau=1.0))
    if blocks is not None:
      o, s = timed(lambda: sj.generate(blocks, [ids], **kw), args.repeats)
      rows["specjax autoregressive, blocks"].append(dict(
          tok_s=args.new / s, speedup=ar_s / s, tau=1.0, identical=o.tokens[0] == ar.tokens[0]))
    for name, m in methods.items():
      o, s = timed(lambda: sj.generate(model, [ids], m, **kw), args.repeats)
      _, ar_again = timed(lambda: sj.generate(model, [ids], **kw), 1)  # the same minutes of load
      rows[name].append(dict(tok_s=args.new / s, speedup=min(ar_s, ar_again) / s,
                             tau=o.stats["mean_accepted"], identical=o.tokens[0] == ar.tokens[0]))
    print(f"# prompt {i}: " + json.dumps({k: v[-1] for k, v in rows.items()}), flush=True)

  print("#", load_line(), flush=True)
  table = []
  for name, rs in rows.items():
    med = lambda k: statistics.median(r[k] for r in rs) if k in rs[0] else None
    table.append(dict(method=name, tok_s=med("tok_s"), speedup=med("speedup"), tau=med("tau"),
                      identical=all(r.get("identical", True) for r in rs)))
  print(f"\n{len(ps)} {args.set} prompts, {args.new} new tokens, greedy, batch 1, median of "
        f"{args.repeats} runs per prompt, median over prompts\n")
  print("| method | tok/s | speedup vs specjax AR | tau | tokens identical |")
  print("|---|---|---|---|---|")
  f = lambda v, fmt: "-" if v is None else fmt.format(v)
  for r in table:
    print(f"| {r['method']} | {f(r['tok_s'], '{:.1f}')} | {f(r['speedup'], '{:.2f}x')} | "
          f"{f(r['tau'], '{:.2f}')} | {'yes' if r['identical'] else 'NO'} |")
  with open(args.out, "w") as fh:
    json.dump(dict(args=vars(args), rows=rows, table=table, load=os.getloadavg()), fh, indent=1)


if __name__ == "__main__":
  main()
