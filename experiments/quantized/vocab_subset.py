"""The quantized self-draft with and without a draft vocabulary subset (`QuantizedDraft(vocab=)`),
batch 1, greedy, one process; the target float32, or another arithmetic of the file
(`--arithmetic w4a8`: the GGUF's blocks with int8 activations).

    .venv/bin/python experiments/quantized/vocab_subset.py [--model smollm2-135m|gemma3-270m]
        [--arithmetic float32|blocks|w4a8] [--size N] [--prompts N] [--max-new N] [--repeats N]

The subset is the N most frequent next tokens of text: SmolLM2's shipped draft's own subset
(8192 tokens, from its training corpus) for SmolLM2; for another model, the shipped SmolLM2
corpus's answers decoded to text and tokenised with that model's tokenizer (so no corpus of
its own is needed; tokens never seen there fill the subset up to N in id order). Autoregressive
decoding, QuantizedDraft(gamma=4) and QuantizedDraft(gamma=4, vocab=subset) alternate on every
prompt (MT-Bench, or the built-in sample), each program compiled before it is timed; the fastest
of --repeats runs per prompt and configuration is kept, and the speedup is the median over
prompts of autoregressive's time over the method's. Every output is checked against
autoregressive decoding's, token for token.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import specjax as sj  # noqa: E402
from specjax import bench  # noqa: E402
from specjax.training import corpus as corpus_mod  # noqa: E402

CORPUS = os.path.join(os.path.dirname(__file__), "..", "..", "specjax", "assets", "corpus",
                      "smollm2-135m")


def subset(model, size: int) -> np.ndarray:
  """The `size` most frequent tokens of the SmolLM2 corpus's text under model's tokenizer."""
  if model.name == "smollm2-135m" and size == 8192:
    return np.asarray(sj.load_model("smollm2-135m-draft", target=model).vocab_subset)
  smol = model if model.name == "smollm2-135m" else sj.load_model("smollm2-135m")
  tok, _ = corpus_mod.load(CORPUS).windows(256, "train", 0.02, 0)
  counts = np.zeros(model.config.vocab_size, np.int64)
  for row in tok[:600]:
    np.add.at(counts, model.tokenizer.encode(smol.tokenizer.decode(row)), 1)
  print(f"subset: {int((counts > 0).sum())} distinct tokens in {int(counts.sum())} of corpus text")
  return np.argsort(-counts, kind="stable")[:size]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default="smollm2-135m")
  ap.add_argument("--arithmetic", default="float32", choices=sorted(bench.ARITHMETICS))
  ap.add_argument("--size", type=int, default=None, help="subset size (8192 for SmolLM2, 16384)")
  ap.add_argument("--prompts", type=int, default=4)
  ap.add_argument("--max-new", type=int, default=128)
  ap.add_argument("--repeats", type=int, default=3)
  a = ap.parse_args(argv)
  model = sj.load_model(a.model, **bench.ARITHMETICS[a.arithmetic])
  size = a.size or (8192 if a.model == "smollm2-135m" else 16384)
  vocab = subset(model, size)
  ps, chat = bench.load_prompt_set("mt_bench", a.prompts, fallback=True)
  chat = chat and getattr(model.tokenizer, "chat_template", None) is not None  # (Gemma's: none)
  configs = {"autoregressive": sj.Autoregressive(), "quantized": sj.QuantizedDraft(gamma=4),
             f"quantized, {len(vocab)}-token subset": sj.QuantizedDraft(gamma=4, vocab=vocab)}
  kw = dict(max_new_tokens=a.max_new, chat=chat, stop_at_eos=False)
  for m in configs.values():
    sj.generate(model, [ps[0]], m, **dict(kw, max_new_tokens=8))  # compile
  speed = {n: [] for n in configs}
  taus = {n: [] for n in configs}
  accs = {n: [] for n in configs}
  for p in ps:
    best = {}
    for rep in range(a.repeats):
      for name, m in configs.items():
        out = sj.generate(model, [p], m, **kw)
        if name == "autoregressive":
          ref = out.tokens
        assert out.tokens == ref, f"{name} differs from autoregressive decoding"
        best[name] = min(best.get(name, float("inf")), out.stats["wall_time_s"])
        if rep == 0 and name != "autoregressive":
          taus[name].append(out.stats["mean_accepted"])
          accs[name].append(out.stats["acceptance_by_position"])
    for name in configs:
      speed[name].append(best["autoregressive"] / best[name])
  print(f"{a.model} ({a.arithmetic}), {len(ps)} MT-Bench prompts, {a.max_new} new tokens, "
        f"load average {os.getloadavg()[0]:.2f}; every output identical to autoregressive "
        "decoding")
  print("| configuration | speedup (median) | per prompt | tau | acceptance by position |")
  print("|---|---|---|---|---|")
  for name in list(configs)[1:]:
    acc = np.round(np.mean(accs[name], axis=0), 2).tolist()
    print(f"| {name} | {bench.median(speed[name]):.2f}x | "
          f"{', '.join(f'{s:.2f}' for s in speed[name])} | {np.mean(taus[name]):.2f} | {acc} |")


if __name__ == "__main__":
  main()
