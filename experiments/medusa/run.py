"""Medusa (Cai et al. 2024) on this CPU: per-head accuracy, tau and speedup by tree size, and
Medusa-2's typical acceptance against its threshold epsilon.

    python experiments/medusa/run.py [--quick] [--model NAME_OR_DIR] [--heads auto|random|NAME|PATH]
                                     [--out DIR]
    python experiments/medusa/run.py --render results.json   # rewrite results.md / .png from it

1. Accuracy per head, top-1 / top-5: from the heads' training header (held-out corpus text), and
   measured here on the benchmark prompts: the target's greedy responses teacher-forced through
   the target, head k at response position t scored on token t + k + 2.
2. The cost curve c(T) of this machine (`bench.measure_cost_curve`), the trees `build_tree` grows
   from per-rank accuracies (held-out when the heads carry them, else Medusa's Vicuna-7B prior)
   for each --nodes size, and the size `choose_budget` picks; predicted tau and speedup
   (1 + E[accepted]) / c(N + 1).
3. Each tree decoding MT-Bench first turns (chat) and HumanEval prompts (raw), batch 1,
   alternating with the autoregressive baseline on the same prompt (same process; the fastest of
   --repeats runs each): median speedup over prompts, tau, and token identity with
   autoregressive at temperature 0.
4. Typical acceptance (`acceptance="typical"`: a candidate x passes when p(x) > min(epsilon,
   delta exp(-H(p))); lossy) on the chosen tree, for each epsilon with delta = sqrt(epsilon) (the
   Medusa code's pairing: 0.09 / 0.3), at --typical-temp (0.7): tau, and how far the output
   moves from greedy: the fraction of generated tokens that are not the target's argmax given
   their own prefix (teacher-forced; plain sampling at the same temperature is the reference),
   and the tokens generated before the first difference from greedy autoregressive output. The
   same methods at temperature 0 must equal greedy autoregressive decoding.
Writes results.json / results.md / results.png (results_quick.* with --quick) to --out.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import numpy as np

import specjax as sj
from specjax import bench, shipped
from specjax import tree as T

FULL = dict(prompts=4, new=128, nodes="4,8,16,32,64", temps="0,0.7", sets="mt_bench,humaneval",
            epsilons="0.01,0.03,0.09,0.2,0.3", typical_temp=0.7, cost_sizes="1,2,4,8,16,32,64,65",
            cost_reps=30, repeats=2)
QUICK = dict(FULL, prompts=2, new=64, nodes="4,16", temps="0", cost_sizes="1,2,4,8,16,32",
             repeats=1)


def resolve_heads(spec: str, target, model_name: str):
  """--heads value -> (Heads, label): "auto" = the shipped Medusa heads for this model when their
  asset exists, else random; "random" = `sj.init_heads(target, "medusa")` (each head starts as
  the target's LM head); anything else a shipped name or a .npz path."""
  if spec == "auto":
    found = [d for d in shipped.DRAFTERS.values()
               if d.kind == "medusa" and d.target == model_name and os.path.isfile(d.path)]
    spec = found[0].name if found else "random"
  if spec == "random":
    return sj.init_heads(target, "medusa", seed=0), "random medusa heads (untrained)"
  return sj.load_heads(spec, target), f"medusa heads {os.path.basename(spec)}"


class TeacherForcer:
  """One full target forward over a prompt + response: the target's argmax [T] and the heads'
  top-5 token ids [T,K,5] at every position. Sequences are padded to a multiple of 128 tokens
  (the causal mask keeps padding out of earlier positions), so a run compiles once or twice."""

  def __init__(self, target, heads):
    import jax
    import jax.numpy as jnp

    from specjax import cache as kv
    from specjax.heads import medusa_hidden
    from specjax.model import head_rows

    v = target.config.vocab_size
    ids = jnp.asarray(heads.vocab if heads.vocab is not None else np.arange(v), jnp.int32)
    rows = head_rows(target.config, target.params, ids)  # [Vh,E]

    def fwd(params, hp, toks):  # toks [1,S]
      s = toks.shape[1]
      cache = target.init_cache(1, s)
      pos = jnp.arange(s, dtype=jnp.int32)[None]
      logits, hidden, _ = target.apply(params, toks, pos, cache, kv.causal_mask(cache.lengths, s, s))
      z = medusa_hidden(hp, hidden[0])  # [S,K,E]
      top = jax.lax.top_k(jnp.einsum("ske,ve->skv", z, rows), 5)[1]  # [S,K,5]
      return jnp.argmax(logits[0], axis=-1), ids[top]

    self.fn = jax.jit(fwd)
    self.target, self.heads = target, heads

  def __call__(self, seq: list[int]):
    s = -(-len(seq) // 128) * 128
    toks = np.zeros((1, s), np.int32)
    toks[0, :len(seq)] = seq
    greedy, top = self.fn(self.target.params, self.heads.params, toks)
    return np.asarray(greedy)[:len(seq)], np.asarray(top)[:len(seq)]


def head_accuracy(forced: list[tuple[int, np.ndarray, np.ndarray, list[int]]], k: int) -> np.ndarray:
  """forced: (prompt length P, top [T,K,5], _, sequence) per prompt -> [K,5] P(rank r right):
  head j's prediction at position t (P - 1 <= t) is scored on token t + j + 2 of the response."""
  hits, total = np.zeros((k, 5)), np.zeros(k)
  for p, top, _, seq in forced:
    n = len(seq)
    for j in range(k):
      t = np.arange(p - 1, n - j - 2)
      if len(t) == 0:
        continue
      want = np.asarray(seq)[t + j + 2]
      hits[j] += (top[t, j, :] == want[:, None]).sum(0)
      total[j] += len(t)
  return hits / np.maximum(total, 1)[:, None]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="smollm2-135m", help="a model name or local HF dir / .gguf")
  ap.add_argument("--heads", default="auto", help="auto | random | a shipped name | heads .npz")
  ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
  ap.add_argument("--render", help="rewrite the report (.md, .png) from this results JSON and exit")
  ap.add_argument("--quick", action="store_true",
                  help="defaults for a short run: " + ", ".join(f"--{k.replace('_', '-')} {v}"
                                                              for k, v in QUICK.items()))
  ap.add_argument("--prompts", type=int, help="prompts per set")
  ap.add_argument("--new", type=int, help="new tokens per prompt (no EOS stop)")
  ap.add_argument("--nodes", help=f"tree sizes (default {FULL['nodes']}; the chosen one is added)")
  ap.add_argument("--temps", help="temperatures of the tree sweep")
  ap.add_argument("--sets", help="prompt sets or .txt/.jsonl files (default mt_bench,humaneval)")
  ap.add_argument("--epsilons", help=f"typical acceptance thresholds (default {FULL['epsilons']}; "
                  "'' skips the typical part)")
  ap.add_argument("--typical-temp", type=float, help="temperature of the typical runs (0.7)")
  ap.add_argument("--cost-sizes", help="token counts of the cost curve")
  ap.add_argument("--cost-reps", type=int, help="interleaved repetitions per timed forward")
  ap.add_argument("--repeats", type=int, help="timed runs per prompt of each tree and of "
                  "autoregressive, alternating; the fastest of each is kept (2; --quick: 1)")
  args = ap.parse_args(argv)
  if args.render:
    return render(args.render)
  bench.with_defaults(args, args.quick, FULL, QUICK)  # explicit options win over --quick
  info = bench.machine_info()
  t_start = time.time()

  target = sj.load_model(args.model)
  heads, heads_label = resolve_heads(args.heads, target, args.model)
  k = heads.config.num_heads
  held = heads.meta.get("held_out", {})
  acc = T.per_rank_accuracy(heads.meta, k)
  acc_source = "held-out (training header)"
  if acc is None:
    acc, acc_source = T.prior_accuracies(k, 5), "Medusa's Vicuna-7B prior (no held-out numbers)"
  ps = bench.load_prompt_sets(args.sets, args.prompts)
  print(f"{args.model}: {target}; {heads_label}; {len(ps)} prompts x {args.new} tokens", flush=True)

  cost = bench.measure_cost_curve(target, [int(x) for x in args.cost_sizes.split(",")],
                                  reps=args.cost_reps)
  print("cost curve c(T):", {t: round(c, 2) for t, c in cost.items()}, flush=True)
  pick = T.choose_budget(cost, acc, max_nodes=min(64, max(cost) - 1))
  sizes = sorted({int(n) for n in args.nodes.split(",")} | {pick["num_nodes"]})
  trees = {n: T.build_tree(acc, n) for n in sizes}
  pred = {n: (1 + T.expected_accepted(trees[n], acc), T.interpolate_cost(cost, n + 1)) for n in sizes}
  print(f"budget chooser: N = {pick['num_nodes']} (predicted tau {pick['tau']:.2f}, "
        f"{pick['speedup']:.2f}x)", flush=True)

  # Greedy references: autoregressive outputs, and through them the heads' accuracy on the
  # benchmark's own responses (teacher-forced).
  kw = dict(max_new_tokens=args.new, stop_at_eos=False)
  ids = [sj.decode._encode(target, [p], chat)[0] for _, p, chat in ps]
  greedy = [sj.generate(target, [x], **kw).tokens[0] for x in ids]
  forcer = TeacherForcer(target, heads)
  forced = [(len(x), *forcer(x + g)[::-1], x + g) for x, g in zip(ids, greedy)]  # (P, top, argmax, seq)
  bench_acc = head_accuracy(forced, k)
  acc_rows = [{"head": i, "predicts": f"t+{i + 2}", "top1": held.get(f"top1_{i}"),
               "top5": held.get(f"top5_{i}"), "bench_top1": float(bench_acc[i, 0]),
               "bench_top5": float(bench_acc[i].sum())} for i in range(k)]
  for r in acc_rows:
    print(f"  head {r['head']} ({r['predicts']}): held-out {r['top1']} / {r['top5']}; benchmark "
          f"{r['bench_top1']:.3f} / {r['bench_top5']:.3f}", flush=True)

  methods = {n: sj.Medusa(heads, tree=trees[n], top_k=5) for n in sizes}
  rows = []
  for temp in (float(t) for t in args.temps.split(",")):
    for kind in dict.fromkeys(s for s, _, _ in ps):
      res = {n: [] for n in sizes}
      for i, (s, p, chat) in enumerate(ps):
        if s != kind:
          continue
        for n, m in methods.items():
          # Method and autoregressive alternately, the fastest of each (the least disturbed);
          # a run that compiled its program is a warm-up (bench.paired).
          out, wall, ar_wall = bench.paired(
              lambda: sj.generate(target, [ids[i]], m, seed=i, temperature=temp, **kw),
              lambda: sj.generate(target, [ids[i]], seed=i, temperature=temp, **kw), args.repeats)
          res[n].append((ar_wall / wall, 1 + out.stats["accepted_per_step"],
                         out.tokens[0] == greedy[i] if temp == 0 else None))
      for n in sizes:
        rs = res[n]
        same = [r[2] for r in rs if r[2] is not None]
        rows.append({"set": kind, "temperature": temp, "nodes": n, "chosen": n == pick["num_nodes"],
                     "speedup": statistics.median(r[0] for r in rs),
                     "tau": statistics.median(r[1] for r in rs),
                     "pred_tau": pred[n][0], "cost": pred[n][1],
                     "pred_speedup": pred[n][0] / pred[n][1],
                     "identical": all(same) if same else None})
        r = rows[-1]
        print(f"  {kind:10s} T={temp} N={n:3d}{'*' if r['chosen'] else ' '} speedup "
              f"{r['speedup']:.2f}x tau {r['tau']:.2f} (pred tau {r['pred_tau']:.2f}, c "
              f"{r['cost']:.2f}, pred {r['pred_speedup']:.2f}x) identical={r['identical']}",
              flush=True)

  typical = typical_sweep(target, heads, trees[pick["num_nodes"]], ps, ids, greedy, forcer, args)

  bench.finish_machine_info(info, t_start)
  data = {"experiment": "medusa", "model": args.model, "heads": heads_label, "args": vars(args),
          "machine": info, "date": info["date"], "accuracy": acc_rows,
          "accuracy_source": acc_source, "cost_curve": cost, "chosen_nodes": pick["num_nodes"],
          "rows": rows, "typical": typical}
  return write(args.out, "results_quick" if args.quick else "results", data)


def typical_sweep(target, heads, tree, ps, ids, greedy, forcer, args) -> list[dict]:
  """Typical acceptance per epsilon (delta = sqrt(epsilon)) at args.typical_temp, beside lossless
  references at the same temperature: autoregressive sampling and Medusa's exact rule."""
  eps = [float(e) for e in args.epsilons.split(",") if e.strip()]
  if not eps:
    return []
  temp = args.typical_temp
  kw = dict(max_new_tokens=args.new, stop_at_eos=False)
  methods = {"autoregressive (sampling)": (sj.Autoregressive(), None),
             "medusa exact": (sj.Medusa(heads, tree=tree, top_k=5), None)}
  for e in eps:
    methods[f"typical eps={e:g}"] = (sj.Medusa(heads, tree=tree, top_k=5, acceptance="typical",
                                               epsilon=e, delta=math.sqrt(e)), e)
  rows = []
  for name, (m, e) in methods.items():
    diff = n_tok = 0
    prefix, walls, ar_t, same0 = [], [], [], []
    acc = rounds = 0
    for i in range(len(ps)):
      # Autoregressive sampling on the same prompt right after: one load for both sides of the
      # ratio (for the autoregressive row itself, the ratio of two identical runs: the noise).
      out, wall, ar_wall = bench.paired(
          lambda: sj.generate(target, [ids[i]], m, temperature=temp, seed=i, **kw),
          lambda: sj.generate(target, [ids[i]], sj.Autoregressive(), temperature=temp, seed=i,
                              **kw), 1)
      toks = out.tokens[0]
      walls.append(wall)
      ar_t.append(ar_wall)
      if not name.startswith("autoregressive"):
        acc += out.stats["accepted_tokens"]
        rounds += out.stats["draft_rounds"]
      argmax = forcer(ids[i] + toks)[0]
      p = len(ids[i])
      diff += int(np.sum(np.asarray(toks) != argmax[p - 1:p - 1 + len(toks)]))
      n_tok += len(toks)
      prefix.append(next((j for j, (a, b) in enumerate(zip(toks, greedy[i])) if a != b), len(toks)))
      if e is not None:  # the lossy rule must still be greedy at T = 0 (same program)
        g0 = sj.generate(target, [ids[i]], m, temperature=0.0, seed=i, **kw)
        same0.append(g0.tokens[0] == greedy[i])
    rows.append({"method": name, "epsilon": e, "delta": None if e is None else math.sqrt(e),
                 "temperature": temp, "tau": 1 + acc / rounds if rounds else 1.0,
                 "differ_from_argmax": diff / max(1, n_tok), "tokens": n_tok,
                 "prefix_equal_to_greedy": statistics.median(prefix), "walls": walls,
                 "speedup": statistics.median(a / w for a, w in zip(ar_t, walls)),
                 "identical_at_T0": all(same0) if same0 else None})
    r = rows[-1]
    print(f"  {r['method']}: tau {r['tau']:.2f}, {100 * r['differ_from_argmax']:.1f}% of tokens "
          f"not the argmax, {r['prefix_equal_to_greedy']} tokens = greedy, speedup "
          f"{r['speedup']:.2f}x, = greedy at T=0: {r['identical_at_T0']}", flush=True)
  return rows


def write(out_dir: str, stem: str, data: dict) -> dict:
  bench.publish(out_dir, stem, data, markdown, plot)
  return data


def render(path: str) -> dict:
  """Rewrites a results JSON's report (also the first version's JSON, which had no typical or
  benchmark-accuracy parts) through bench.save_report, beside the JSON."""
  data, out, stem = bench.read_saved(path)
  data.setdefault("typical", [])
  data.setdefault("heads", data.get("args", {}).get("heads", "?"))
  data.setdefault("model", data.get("args", {}).get("model", "?"))
  data["cost_curve"] = {int(t): c for t, c in data["cost_curve"].items()}
  return write(out, stem, data)


def _f(x, fmt=".3f"):
  return "-" if x is None else format(x, fmt)


def markdown(data: dict) -> str:
  m = data.get("machine", {})
  a = data.get("args", {})
  lines = [f"Model {data['model']}; {data['heads']}; {a.get('prompts')} prompts per set x "
           f"{a.get('new')} new tokens, batch 1; "
           + (bench.machine_summary(m) if m else data.get("date", "?")) + ".", "",
           "| head | predicts | held-out top-1 | held-out top-5 | benchmark top-1 | benchmark top-5 |",
           "|---|---|---|---|---|---|"]
  for r in data["accuracy"]:
    lines.append(f"| {r['head']} | t+{r['head'] + 2} | {_f(r.get('top1'))} | {_f(r.get('top5'))} | "
                 f"{_f(r.get('bench_top1'))} | {_f(r.get('bench_top5'))} |")
  cc = data["cost_curve"]
  lines += ["", "Cost curve c(T): " + ", ".join(f"{t}: {c:.2f}" for t, c in sorted(cc.items())),
            "", "| set | T | nodes | speedup | tau | predicted tau | c(N+1) | predicted speedup | = AR |",
            "|---|---|---|---|---|---|---|---|---|"]
  for r in data["rows"]:
    lines.append(f"| {r['set']} | {r['temperature']} | {r['nodes']}"
                 f"{' (chosen)' if r['chosen'] else ''} | {r['speedup']:.2f}x | {r['tau']:.2f} | "
                 f"{r['pred_tau']:.2f} | {r['cost']:.2f} | {r['pred_speedup']:.2f}x | "
                 f"{'-' if r['identical'] is None else r['identical']} |")
  if data["typical"]:
    t = data["typical"][0]["temperature"]
    lines += ["", f"Typical acceptance on the chosen tree ({data['chosen_nodes']} nodes), T={t:g}, "
              "delta = sqrt(epsilon); references: lossless sampling at the same temperature:", "",
              "| method | epsilon | delta | tau | tokens not the target's argmax | tokens before "
              "first difference from greedy AR (median) | speedup vs AR sampling | = greedy AR at T=0 |",
              "|---|---|---|---|---|---|---|---|"]
    for r in data["typical"]:
      lines.append(f"| {r['method']} | {_f(r['epsilon'], 'g')} | {_f(r['delta'], '.2f')} | "
                   f"{r['tau']:.2f} | {100 * r['differ_from_argmax']:.1f}% of {r['tokens']} | "
                   f"{r['prefix_equal_to_greedy']} | {r['speedup']:.2f}x | "
                   f"{'-' if r['identical_at_T0'] is None else ('yes' if r['identical_at_T0'] else 'NO')} |")
  return "\n".join(lines)


def plot(fig, data: dict) -> None:
  """tau and speedup by tree size (measured markers, predicted lines, per set at the first
  temperature), and typical acceptance's tau and distance from greedy against epsilon."""
  fig.set_size_inches(11, 4.5)
  ax1 = fig.add_subplot(1, 2, 1)
  rows = data["rows"]
  t0 = rows[0]["temperature"] if rows else 0
  for j, s in enumerate(dict.fromkeys(r["set"] for r in rows)):
    rs = sorted((r for r in rows if r["set"] == s and r["temperature"] == t0), key=lambda r: r["nodes"])
    n = [r["nodes"] for r in rs]
    ax1.plot(n, [r["tau"] for r in rs], "o", color=f"C{j}", label=f"{s} tau")
    ax1.plot(n, [r["speedup"] for r in rs], "^", color=f"C{j}", label=f"{s} speedup")
    if j == 0:
      ax1.plot(n, [r["pred_tau"] for r in rs], "-", color="grey", lw=1, label="predicted tau")
      ax1.plot(n, [r["pred_speedup"] for r in rs], "--", color="grey", lw=1,
               label="predicted speedup")
  ax1.axhline(1.0, color="grey", lw=0.5)
  ax1.set(xscale="log", xlabel="tree nodes N", title=f"trees by size (T={t0:g})")
  nodes = sorted({r["nodes"] for r in rows})
  ax1.minorticks_off()
  ax1.set_xticks(nodes, [str(n) for n in nodes])
  ax1.legend(fontsize=7)
  ax2 = fig.add_subplot(1, 2, 2)
  ty = [r for r in data["typical"] if r["epsilon"] is not None]
  if ty:
    e = [r["epsilon"] for r in ty]
    ax2.plot(e, [r["tau"] for r in ty], "o-", label="tau (typical)")
    ax2.set(xscale="log", xlabel="epsilon (delta = sqrt(epsilon))", ylabel="tau",
            title=f"typical acceptance, T={ty[0]['temperature']:g}")
    ax2.minorticks_off()
    ax2.set_xticks(e, [f"{x:g}" for x in e])
    ax3 = ax2.twinx()
    ax3.plot(e, [100 * r["differ_from_argmax"] for r in ty], "s--", color="C3",
             label="% tokens not argmax")
    for r in data["typical"]:
      if r["epsilon"] is None:
        ax3.axhline(100 * r["differ_from_argmax"], color="C3", lw=0.6, ls=":")
    ax3.set_ylabel("% tokens not argmax (dotted: plain sampling)")
    ax2.legend(fontsize=7, loc="upper left")
    ax3.legend(fontsize=7, loc="upper right")
  else:
    ax2.set_axis_off()
    ax2.text(0.5, 0.5, "no typical-acceptance runs in this report", ha="center")


if __name__ == "__main__":
  sys.exit(0 if main() is not None else 1)
