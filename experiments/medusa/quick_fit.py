"""A quick, small-data fit of Medusa heads for SmolLM2 on this CPU, then tau and speed on held-out
prompts. Not the shipped heads (those need the corpus and the shared trainer): a sanity check
that heads learn the target's continuations and that the tree turns that into tokens per call.

    PYTHONPATH=. python experiments/medusa/quick_fit.py
"""

import time

import numpy as np

import specjax as sj
from specjax import prompts as P
from specjax.training import medusa as tm

target = sj.load_model("smollm2-135m")
subset = sj.load_model("smollm2-135m-draft").vocab_subset  # 8192 most used tokens
mt = P.load("mt_bench", 80)
train_p, test_p = mt[:64], mt[64:72]
T0 = time.time()
out = sj.generate(target, train_p, max_new_tokens=96, chat=True, stop_at_eos=False)
rows = []
for p, toks in zip(train_p, out.tokens):
  ids = target.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                             add_generation_prompt=True, tokenize=True)
  ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
  seq = (ids + toks)[-128:]
  if len(seq) == 128:
    rows.append(seq)
toks = np.array(rows, np.int32)
print(f"self-distilled windows {toks.shape} in {time.time() - T0:.0f} s")
heads = sj.init_heads(target, "medusa", num_heads=3, vocab=subset)
T0 = time.time()
heads, losses = tm.fit(target, heads, toks, steps=150, lr=1e-3, batch_size=8)
print(f"fit {time.time() - T0:.0f} s, loss {losses[0]:.2f} -> {losses[-1]:.2f}")
# Held-out: the target's own text on unseen prompts.
out = sj.generate(target, test_p, max_new_tokens=64, chat=True, stop_at_eos=False)
held = []
for p, t in zip(test_p, out.tokens):
  ids = target.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                             add_generation_prompt=True, tokenize=True)
  ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
  held.append((ids + t)[-96:])
held = np.array([h for h in held if len(h) == 96], np.int32)
import jax.numpy as jnp
_, met = tm.medusa_loss(heads.params, heads.config, tm.teacher_hidden(target, held),
                        jnp.asarray(held), tm.lm_head_matrix(target, subset), jnp.asarray(subset))
print("held-out top-1 / top-5 per head:\n", tm.accuracy_table(met, 3).round(3))
from specjax import tree as T
acc1 = tm.accuracy_table(met, 3)
ar = sj.generate(target, test_p[:4], max_new_tokens=64, chat=True)
print(f"AR {ar.stats['tokens_per_second']:.1f} tok/s")
for paths in [[(0,), (1,), (0, 0)], T.default_tree(3, 4).paths, T.default_tree(3, 8).paths]:
  m = sj.Medusa(heads, tree=paths, acceptance="greedy")
  o = sj.generate(target, test_p[:4], m, max_new_tokens=64, chat=True)
  assert o.tokens == ar.tokens
  print(f"N={len(paths)}: tau {o.stats['mean_accepted']:.2f}, {o.stats['tokens_per_second']:.1f} "
        f"tok/s, head acceptance {np.round(o.stats['head_acceptance'], 2).tolist()}")
