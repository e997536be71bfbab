"""DFlash's acceptance against block size (Chen, Liang, Liu 2026, "DFlash: Block Diffusion for Flash
Speculative Decoding"), with the trained drafter: what each block size buys in accepted tokens and
in speed, beside EAGLE and PARD's parallel draft model by name.

    python experiments/dflash/run.py [--quick] [--heads NAME_OR_FILE] [--out DIR]
        [--arithmetic w4a8] [--subset-from smollm2-135m-eagle]
    python experiments/dflash/run.py --render results_quick.json   # rewrite its .md / .png

For every block size b from 2 to the block the drafter was trained for, sj.DFlash(heads,
block_size=b) (a chain: the pending token and b - 1 drafted ones, one drafter forward and one
verify forward per step), greedy, batch 1, per prompt set (chat: MT-Bench; code: HumanEval):

  tau         tokens per verify step (the prefill call excluded), pooled over the set's prompts;
  predicted   the held-out prediction 1 + sum_{j < b} prod_{k < j} top1_k, top1_k being offset
              k + 1's agreement given offsets 1 .. k agreed (recorded by `specjax train dflash`);
  speedup     wall time of autoregressive over DFlash on the same prompt, the two run alternately
              (`bench.paired`: the fastest of --repeats each), median over the set's prompts;

and beside them the methods of --beside by name (EAGLE and PARD's parallel draft model: their
shipped drafters, their cost-curve sizes) the same way on the same prompts.
Every greedy output is checked token-identical to autoregressive.
Writes results.json / results.md / results.png (results_quick.* with --quick) to --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

import specjax as sj
from specjax import bench, prompts
from specjax import methods as sj_methods
from specjax.tree import chain_tau

FULL = dict(sets="mt_bench,humaneval", prompts=4, new=128, repeats=2)
QUICK = dict(FULL, prompts=2, new=64, repeats=1)


def predicted_tau(held: dict, block: int) -> float | None:
  """1 + the expected accepted drafts of a chain of `block` - 1 from the held-out top1_k; None
  where the heads recorded none."""
  if "top1_0" not in held:
    return None
  return chain_tau([float(held.get(f"top1_{k}", 0.0)) for k in range(block - 1)], block - 1)


def tau_of(outs) -> float:
  new = sum(o.stats["new_tokens"] - 1 for o in outs)
  steps = sum(sum(o.stats["target_calls_per_row"]) - 1 for o in outs)
  return new / max(1, steps)


def measure(target, methods: dict, ps, args) -> list[dict]:
  """One row per (method label, prompt set): tau, median speedup, identical to autoregressive."""
  kw = dict(max_new_tokens=args.new, stop_at_eos=False, temperature=0.0)
  ar = {p: sj.generate(target, [p], sj.Autoregressive(), chat=chat, **kw).tokens[0]
        for _, p, chat in ps}
  rows = []
  for label, m in methods.items():
    for group in dict.fromkeys(s for s, _, _ in ps):
      outs, ratios = [], []
      for s, p, chat in ps:
        if s != group:
          continue
        out, wall, ar_wall = bench.paired(
            lambda: sj.generate(target, [p], m, chat=chat, **kw),
            lambda: sj.generate(target, [p], sj.Autoregressive(), chat=chat, **kw), args.repeats)
        outs.append((p, out))
        ratios.append(ar_wall / wall)
      row = {"method": label, "set": group, "tau": tau_of([o for _, o in outs]),
             "speedup": statistics.median(ratios), "speedups": ratios,
             "identical": all(o.tokens[0] == ar[p] for p, o in outs)}
      rows.append(row)
      print(f"  {label:10s} {group:12s} tau {row['tau']:.3f}  speedup {row['speedup']:.2f}x"
            f"{'' if row['identical'] else '  NOT IDENTICAL'}", flush=True)
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="smollm2-135m", help="the target: a name, HF dir or .gguf")
  ap.add_argument("--arithmetic", default="float32", choices=sorted(bench.ARITHMETICS),
                  help="the target's arithmetic (blocks, w4a8: a GGUF target's own blocks)")
  ap.add_argument("--heads", default=None, help="DFlash heads (a shipped name or .npz; default "
                  "the target's shipped DFlash drafter)")
  ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
  ap.add_argument("--quick", action="store_true",
                  help="defaults for a short run: " + ", ".join(f"--{k} {v}"
                                                              for k, v in QUICK.items()))
  ap.add_argument("--sets", help=f"prompt sets or .txt/.jsonl files (default {FULL['sets']})")
  ap.add_argument("--prompts", type=int, help="prompts per set")
  ap.add_argument("--new", type=int, help="new tokens per prompt (no EOS stop)")
  ap.add_argument("--blocks", default=None, help="block sizes (default 2 .. the trained block)")
  ap.add_argument("--repeats", type=int, help="timed runs of each side per prompt, alternating")
  ap.add_argument("--beside", default="eagle,pard",
                  help="methods by name measured beside DFlash where the target has their "
                  "drafters (default eagle,pard: EAGLE, and PARD's parallel draft, target-"
                  "independent; '' for none)")
  ap.add_argument("--subset-from", default=None,
                  help="heads (a shipped name or .npz) whose vocabulary subset a second row per "
                  "block drafts over (DFlash(vocab=...), rows dflash/B/subset)")
  ap.add_argument("--render", help="rewrite the report (.md, .png) from this results JSON and exit")
  args = ap.parse_args(argv)
  if args.render:
    return render(args.render)
  bench.with_defaults(args, args.quick, FULL, QUICK)  # explicit options win over --quick
  info = bench.machine_info()
  t_start = time.time()

  target = sj.load_model(args.model, **bench.ARITHMETICS[args.arithmetic])
  heads = sj.load_heads(args.heads or f"{target.name}-dflash", target)
  trained = heads.config.block_size
  blocks = (sorted({int(b) for b in args.blocks.split(",")}) if args.blocks
            else list(range(2, trained + 1)))
  held = dict(heads.meta.get("held_out", {}))
  ps = prompts.load_prompt_sets(args.sets, args.prompts, fallback=True)
  print(f"{args.model}: {target}; heads {heads.config.describe()}; {len(ps)} prompts x "
        f"{args.new} tokens; blocks {blocks}", flush=True)
  methods = {f"dflash/{b}": sj.DFlash(heads, block_size=b) for b in blocks}
  if args.subset_from:
    vocab = sj.load_heads(args.subset_from, target).vocab
    if vocab is None:
      sys.exit(f"--subset-from {args.subset_from}: those heads draft over the whole vocabulary")
    methods.update({f"dflash/{b}/subset": sj.DFlash(heads, block_size=b, vocab=vocab)
                    for b in blocks})
  if args.heads is None:  # by name: the shipped drafter, sized from the cost curve
    methods["dflash"] = "dflash"
  for name in filter(None, args.beside.split(",")):
    if sj_methods.get(name).available(target):
      methods[name] = name
  rows = measure(target, methods, ps, args)
  for r in rows:
    if r["method"].startswith("dflash/"):  # dflash/B, or dflash/B/subset (not plotted)
      parts = r["method"].split("/")
      r["block" if len(parts) == 2 else "subset_block"] = int(parts[1])
      r["predicted"] = predicted_tau(held, int(parts[1]))

  bench.finish_machine_info(info, t_start)
  data = {"experiment": "dflash_block_size", "model": args.model,
          "arithmetic": args.arithmetic, "args": vars(args),
          "machine": info, "heads": heads.config.describe(), "trained_block": trained,
          "held_out": held, "training": {k: heads.meta.get(k) for k in
                                         ("steps", "batch_size", "seq_len", "lr", "loss_decay")},
          "prompts": [(s, p[:80], chat) for s, p, chat in ps], "rows": rows}
  bench.publish(args.out, "results_quick" if args.quick else "results", data, markdown, plot)
  return data


def render(path: str) -> dict:
  """Rewrites a results JSON's .md and .png beside it (after a change to the tables or plots)."""
  return bench.rerender(path, markdown, plot)


def markdown(data: dict) -> str:
  sets = list(dict.fromkeys(r["set"] for r in data["rows"]))
  by = {(r["method"], r["set"]): r for r in data["rows"]}
  t = data.get("training", {})
  lines = [f"Target {data['model']} ({data.get('arithmetic', 'float32')}); {data['heads']}; "
           f"trained {t.get('steps')} steps of "
           f"{t.get('batch_size')} x {t.get('seq_len')} tokens (loss decay "
           f"{t.get('loss_decay')}); {len(data['prompts'])} prompts x {data['args']['new']} new "
           f"tokens, greedy, batch 1; {bench.machine_summary(data['machine'])}.", "",
           "| method | predicted tau (held-out) | " + " | ".join(
               f"{s} tau | {s} speedup" for s in sets) + " | = AR |",
           "|---|---|" + "---|---|" * len(sets) + "---|"]
  for method in dict.fromkeys(r["method"] for r in data["rows"]):
    rs = [by[(method, s)] for s in sets if (method, s) in by]
    pred = rs[0].get("predicted")
    cells = " | ".join(f"{by[(method, s)]['tau']:.3f} | {by[(method, s)]['speedup']:.2f}x"
                       if (method, s) in by else "- | -" for s in sets)
    lines.append(f"| {method} | {'-' if pred is None else f'{pred:.3f}'} | {cells} | "
                 f"{'yes' if all(r['identical'] for r in rs) else 'NO'} |")
  held = data.get("held_out", {})
  ks = sorted(int(k.split("_")[1]) for k in held if k.startswith("top1_"))
  if ks:
    lines += ["", "Held-out per-offset acceptance (offset k + 1 right given offsets 1 .. k "
              "right; top-5 likewise):", "",
              "| offset | " + " | ".join(str(k + 1) for k in ks) + " |",
              "|---|" + "---|" * len(ks),
              "| top-1 | " + " | ".join(f"{held[f'top1_{k}']:.3f}" for k in ks) + " |",
              "| top-5 | " + " | ".join(f"{held.get(f'top5_{k}', float('nan')):.3f}"
                                        for k in ks) + " |"]
  return "\n".join(lines)


def plot(fig, data: dict) -> None:
  """Left: tau against block size, measured per set (markers) and predicted (line); right: the
  speedup over autoregressive, with EAGLE's (dashed) and PARD's (dotted) as lines per set."""
  fig.set_size_inches(11, 4.5)
  ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
  rows = [r for r in data["rows"] if "block" in r]
  sets = list(dict.fromkeys(r["set"] for r in data["rows"]))
  blocks = sorted({r["block"] for r in rows})
  pred = {r["block"]: r.get("predicted") for r in rows}
  if all(v is not None for v in pred.values()):
    ax1.plot(blocks, [pred[b] for b in blocks], "k-", lw=1, label="held-out prediction")
  for j, s in enumerate(sets):
    rs = sorted((r for r in rows if r["set"] == s), key=lambda r: r["block"])
    ax1.plot([r["block"] for r in rs], [r["tau"] for r in rs], "o-", color=f"C{j}", label=s)
    ax2.plot([r["block"] for r in rs], [r["speedup"] for r in rs], "o-", color=f"C{j}", label=s)
    for name, ls in (("eagle", "--"), ("pard", ":")):
      other = [r for r in data["rows"] if r["method"] == name and r["set"] == s]
      if other:
        ax2.axhline(other[0]["speedup"], color=f"C{j}", ls=ls, lw=1,
                    label=f"{'EAGLE' if name == 'eagle' else 'PARD'}, {s}")
  ax1.set(xlabel="block size (pending token + drafted)", ylabel="tau (tokens per step)",
          title="accepted length vs block size")
  ax2.axhline(1.0, color="grey", lw=0.5)
  ax2.set(xlabel="block size", ylabel="speedup over autoregressive", title="speed")
  for ax in (ax1, ax2):
    ax.set_xticks(blocks)
    ax.legend(fontsize=7)
  fig.tight_layout()


if __name__ == "__main__":
  np.set_printoptions(precision=3)
  main()
