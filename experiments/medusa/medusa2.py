"""Medusa-2 (issue 29): how close the adapted model stays to the original, and its heads against
Medusa-1's, on SmolLM2-135M.

    python experiments/medusa/medusa2.py [--asset smollm2-135m-medusa2] [--prompts 8] [--new 128]

A Medusa-2 asset is LoRA adapters for the target plus Medusa heads for the adapted model
(`specjax train medusa2`): decoding with it is exact with respect to the ADAPTED model, which is
a different model from the original. This measures how different:

1. KL: the mean per-token KL(original || adapted) over the held-out responses of the corpus it
   was trained on (the split the trainer held out: same seed and fraction), teacher-forced.
2. Greedy agreement: over chat (MT-Bench) and code (HumanEval) prompts, the fraction of
   --new-token greedy outputs identical to the original model's, and the share of tokens before
   the first difference.
3. The heads: held-out top-1 / top-5 per head from the asset's header, beside the shipped
   Medusa-1 heads' (their training headers; the same held-out split when both came from the same
   corpus and seed).

Decoding speed and tau come from experiments/medusa/run.py with `--model ASSET --heads ASSET`
(see experiments/medusa/README.md, "Medusa-2"). Writes medusa2.json / medusa2.md here.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import specjax as sj  # noqa: E402
from specjax import bench, lora, shipped  # noqa: E402
from specjax.training import corpus as corpus_mod  # noqa: E402
from specjax.training import medusa, medusa2  # noqa: E402
from specjax.training.heads import response_valid  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "..", "..", "specjax", "assets", "corpus", "smollm2-135m")


def _pair(p) -> str:
  return "-" if p is None else f"{p[0]:.3f} / {p[1]:.3f}"


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--asset", default="smollm2-135m-medusa2", help="shipped name or .npz")
  ap.add_argument("--medusa1", default="smollm2-135m-medusa", help="Medusa-1 heads to compare")
  ap.add_argument("--prompts", type=int, default=8, help="prompts per set (greedy agreement)")
  ap.add_argument("--new", type=int, default=128, help="new tokens per greedy output")
  ap.add_argument("--windows", type=int, default=32, help="held-out corpus windows for the KL")
  a = ap.parse_args()
  info, t0 = bench.machine_info(), time.time()
  original = sj.load_model("smollm2-135m")
  path = a.asset if a.asset.endswith(".npz") else shipped.get(a.asset).path
  adapted = lora.adapted_model(path, original)
  heads = sj.load_heads(path, adapted)
  m1 = sj.load_heads(a.medusa1, original)
  meta = heads.meta
  c = corpus_mod.load(CORPUS)
  tok, mask = c.windows(meta.get("seq_len", 256), "heldout", 0.02, 0)
  tok, mask = tok[:a.windows], mask[:a.windows]
  kl = medusa2.closeness(original, adapted, tok, response_valid(mask))
  rows = []
  for spec in ("mt_bench", "humaneval"):
    ps, chat = bench.load_prompt_set(spec, a.prompts)
    kw = dict(max_new_tokens=a.new, chat=chat, stop_at_eos=False)
    ref = sj.generate(original, list(ps), **kw).tokens
    out = sj.generate(adapted, list(ps), **kw).tokens
    whole, share = bench.agreement(out, ref)
    rows.append({"prompts": spec, "n": len(ref), "identical": whole, "tokens_before_diff": share})
    print(rows[-1], flush=True)
  k = heads.config.num_heads
  acc = {"medusa2": medusa.accuracy_table(meta.get("held_out", {}), k).tolist(),
         "medusa1": medusa.accuracy_table(m1.meta.get("held_out", {}),
                                          m1.config.num_heads).tolist()}
  info = bench.finish_machine_info(info, t0)
  train = {x: meta.get(x) for x in ("steps", "lr", "kl_weight", "backbone_lr", "warmup_heads",
                                    "init", "batch_size", "seq_len")}
  lines = [bench.machine_summary(info), "", f"`{info['command']}`", "",
           f"Asset `{os.path.basename(path)}`: {k} heads, LoRA {lora.read_adapters(path)[1]['lora']}; "
           f"trained {train}.", "",
           f"- KL(original || adapted), mean per token over {kl['positions']} held-out response "
           f"positions: **{kl['kl']:.4f}** nats", ""]
  lines += ["| prompts | outputs | identical to the original's | tokens before the first difference |",
            "|---|---|---|---|"]
  lines += [f"| {r['prompts']} | {r['n']} x {a.new} | {r['identical']:.2f} | {r['tokens_before_diff']:.2f} |"
            for r in rows]
  lines += ["", "| head | Medusa-1 held-out top-1 / top-5 | Medusa-2 held-out top-1 / top-5 |",
            "|---|---|---|"]
  for i in range(k):
    one = acc["medusa1"][i] if i < len(acc["medusa1"]) else None
    lines.append(f"| {i} (t+{i + 2}) | {_pair(one)} | {_pair(acc['medusa2'][i])} |")
  md = "\n".join(lines) + "\n"
  print(md)
  bench.save_report(HERE, "medusa2", {"machine": info, "kl": kl, "greedy": rows, "accuracy": acc,
                                      "training": train}, md)


if __name__ == "__main__":
  main()
