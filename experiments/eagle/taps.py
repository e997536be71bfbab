"""How much an EAGLE head with fused features relies on each tap: held-out agreement ablated.

    python experiments/eagle/taps.py --heads runs/eagle3f.npz [--model smollm2-135m]
        [--corpus specjax/assets/corpus/smollm2-135m] [--unroll 4] [--windows 32] [--json OUT]

A head trained with `--taps` reads g = fuse_w^T [taps; f] + fuse_b (specjax/heads.py). This
scores the corpus's held-out response windows (the trainer's split: same --held-out and --seed)
with the head as trained, with each tap's block of fuse_w zeroed, and with every tap zeroed (the
head then reads its trained mix of the last feature alone), and prints the top-1 agreement with
the target at each draft depth (depth d drafts on the head's own features, teacher-forced tokens:
`training/eagle.py make_loss`, no feature noise). If zeroing the taps costs nothing, the fused
features bought nothing; the drop is what they carry. Acceptance-only: nothing is timed.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def held_out_top1(target, heads, tokens, mask, unroll: int, batch_size: int = 4) -> list[float]:
  """Top-1 agreement per depth 1..unroll over windows [N,T] (mask: the corpus's, True where the
  next token is a response token), averaged over every counted position."""
  import jax
  import jax.numpy as jnp

  from specjax.training import eagle as te
  from specjax.training.heads import response_valid

  valid = response_valid(mask)
  loss_fn = jax.jit(te.make_loss(target, heads, noise=0.0, unroll=unroll))
  frozen = te.frozen_arrays(target, heads)
  hits = np.zeros(unroll)
  counts = np.zeros(unroll)
  pad = -len(tokens) % batch_size
  tokens = np.concatenate([tokens, np.zeros((pad, tokens.shape[1]), np.int32)])
  valid = np.concatenate([valid, np.zeros((pad, valid.shape[1]), bool)])
  t = tokens.shape[1]
  for i in range(0, len(tokens), batch_size):
    tok, ok = tokens[i:i + batch_size], valid[i:i + batch_size]
    _, m = loss_fn(heads.params, {"tokens": jnp.asarray(tok), "mask": jnp.asarray(ok)},
                   jax.random.PRNGKey(0), frozen)
    for d in range(unroll):
      okd = np.concatenate([ok, np.zeros((len(ok), d), bool)], axis=1)[:, 1 + d:t + d]
      n = int(okd.sum())
      hits[d] += float(m["top1" if d == 0 else f"top1_{d + 1}"]) * max(n, 1)
      counts[d] += n
  return (hits / np.maximum(counts, 1)).tolist()


def ablated(heads, which: list[int]):
  """heads with the fuse_w blocks of taps `which` (indices into heads.config.taps) zeroed."""
  import dataclasses

  import jax.numpy as jnp

  e = heads.config.hidden_size
  w = np.array(heads.params["fuse_w"], np.float32)
  for j in which:
    w[:, j * e:(j + 1) * e] = 0.0
  params = dict(heads.params, fuse_w=jnp.asarray(w, heads.params["fuse_w"].dtype))
  return dataclasses.replace(heads, params=params)


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--heads", required=True, help="an EAGLE heads file trained with --taps")
  ap.add_argument("--model", default="smollm2-135m")
  ap.add_argument("--corpus", default="specjax/assets/corpus/smollm2-135m")
  ap.add_argument("--unroll", type=int, default=4, help="draft depths to score")
  ap.add_argument("--windows", type=int, default=32, help="held-out windows (the trainer's 32)")
  ap.add_argument("--seq-len", type=int, default=256)
  ap.add_argument("--held-out", type=float, default=0.02)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)

  import specjax as sj
  from specjax.errors import InputError
  from specjax.training import corpus as corpus_lib

  target = sj.load_model(args.model) if isinstance(args.model, str) else args.model
  heads = sj.load_heads(args.heads, target)
  taps = heads.config.taps
  if heads.config.kind != "eagle" or not taps:
    raise InputError(f"{args.heads}: not an EAGLE head with fused features (train one with "
                     f"`specjax train eagle --taps ...`)")
  corpus = corpus_lib.load(args.corpus)
  corpus.check_compatible(target)
  tok, mask = corpus.windows(args.seq_len, "heldout", args.held_out, args.seed)
  tok, mask = tok[:args.windows], mask[:args.windows]
  rows = {"as trained": []}
  rows.update({f"tap {t} zeroed": [j] for j, t in enumerate(taps)})
  if len(taps) > 1:
    rows["every tap zeroed"] = list(range(len(taps)))
  out = {"heads": args.heads, "taps": list(taps), "windows": int(len(tok)), "top1": {}}
  print(f"{args.heads}: taps {list(taps)}, {len(tok)} held-out windows of {args.seq_len}")
  print("| fuse | " + " | ".join(f"top-1 depth {d + 1}" for d in range(args.unroll)) + " |")
  print("|---|" + "---|" * args.unroll)
  for name, which in rows.items():
    acc = held_out_top1(target, ablated(heads, which), tok, mask, args.unroll)
    out["top1"][name] = [round(a, 4) for a in acc]
    print(f"| {name} | " + " | ".join(f"{a:.3f}" for a in acc) + " |")
    sys.stdout.flush()
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
  return out


if __name__ == "__main__":
  main()
