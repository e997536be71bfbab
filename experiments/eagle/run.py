"""EAGLE-2 (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic Draft
Trees") and DeepSeek-V3's multi-token prediction: tau against the tree budget and depth, EAGLE-1's
static tree against EAGLE-2's dynamic tree, and MTP's acceptance per depth.

    python experiments/eagle/run.py [--quick] [--model NAME_OR_DIR] [--heads auto|random|NAME|PATH]
                                    [--mtp-heads auto|random|NAME|PATH] [--out DIR]
    python experiments/eagle/run.py --render results_quick.json   # rewrite its .md / .png

Heads: "auto" takes the shipped heads for --model when their asset exists (e.g.
smollm2-135m-eagle), else random untrained heads (`sj.init_heads(target, kind, seed=0)`),
labelled as such everywhere: with random heads every tau is ~1 and the rows only show that the
machinery runs and what a step costs. Batch 1, the same prompts for every configuration:

  EAGLE-2   `sj.Eagle(heads, tree="dynamic", depth, top_k, num_nodes)`: num_nodes swept at one
            depth, and depth swept at one num_nodes;
  EAGLE-1   `sj.Eagle(heads, tree=...)` with a static tree of the same node count (the tree
            `specjax.tree.build_tree` grows from Medusa-style prior per-depth accuracies);
  MTP       `sj.MTP(heads)`: a chain of K modules, acceptance per depth beside DeepSeek-V3's
            reported 85-90% for its second token (its one module's draft; our depth 1).

Reported: tau = 1 + accepted / rounds (tokens per target call in the loop), acceptance per depth
(P(depth d accepted | depth d-1 accepted), from the methods' exact accepted-depth histograms),
the measured speedup against autoregressive on the same prompt (the two alternating, the fastest
of --repeats runs each, median over prompts) and the verification-only prediction tau / c(N + 1)
from this machine's cost curve (the head's own cost left out). Greedy outputs are checked
token-identical to autoregressive.
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
from specjax import bench, shipped
from specjax import tree as trees

FULL = dict(nodes="8,16,32,60", depth=5, depths="3,5,7", depth_nodes=32, top_k=8,
            static_nodes="16,32,60", temps="0,0.7", sets="mt_bench,humaneval", prompts=3, new=128,
            cost_reps=30, repeats=2, mtp_modules=2)
QUICK = dict(FULL, depths="3,7", static_nodes="32", temps="0", prompts=1, new=64, repeats=1)
DEEPSEEK_V3_SECOND_TOKEN = (0.85, 0.90)  # DeepSeek-V3 technical report, section 5.4.3


def resolve_heads(spec: str, kind: str, target, model_name: str, **init_kw):
  """--heads value -> (Heads, label). "auto": the shipped heads of this kind for `model_name`
  if their asset exists, else random; "random": `sj.init_heads(target, kind, seed=0)`; anything
  else: a shipped name or a .npz path for `sj.load_heads`."""
  if spec == "auto":
    found = [d for d in shipped.DRAFTERS.values()
               if d.kind == kind and d.target == model_name and os.path.isfile(d.path)]
    spec = found[0].name if found else "random"
  if spec == "random":
    return (sj.init_heads(target, kind, seed=0, **init_kw),
            f"random {kind} heads (untrained: no trained heads for this model yet)")
  heads = sj.load_heads(spec, target)
  return heads, f"{kind} heads {os.path.basename(spec)}"


def depth_acceptance(hist) -> list[float]:
  """hist[n] = rounds that accepted n draft tokens -> P(depth d accepted | depth d-1 accepted)
  for d = 1 .. len(hist) - 1 (nan where no round reached depth d - 1)."""
  h = np.asarray(hist, float)
  reached = h[::-1].cumsum()[::-1]
  return [float(reached[d] / reached[d - 1]) if reached[d - 1] else float("nan")
          for d in range(1, len(h))]


def pooled(outs) -> tuple[float, np.ndarray]:
  """Outputs of one configuration over several prompts -> (tau = 1 + accepted / rounds, their
  summed accepted-depth histogram)."""
  acc = sum(o.stats["accepted_tokens"] for o in outs)
  rounds = sum(o.stats["draft_rounds"] for o in outs)
  return 1 + acc / max(1, rounds), np.sum([o.stats["accepted_depth_hist"] for o in outs], axis=0)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="smollm2-135m", help="a model name or local HF dir / .gguf")
  ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
  ap.add_argument("--heads", default="auto", help="EAGLE heads: auto | random | name | .npz")
  ap.add_argument("--mtp-heads", default="auto", help="MTP heads: auto | random | name | .npz")
  ap.add_argument("--quick", action="store_true",
                  help="defaults for a short run: " + ", ".join(f"--{k.replace('_', '-')} {v}"
                                                              for k, v in QUICK.items()))
  ap.add_argument("--nodes", help=f"EAGLE-2 num_nodes swept at --depth (default {FULL['nodes']})")
  ap.add_argument("--depth", type=int, help=f"depth of the num_nodes sweep (default {FULL['depth']})")
  ap.add_argument("--depths", help=f"depths swept at --depth-nodes (default {FULL['depths']})")
  ap.add_argument("--depth-nodes", type=int, help="num_nodes of the depth sweep")
  ap.add_argument("--top-k", type=int, help=f"EAGLE-2 top_k (default {FULL['top_k']})")
  ap.add_argument("--static-nodes", help="EAGLE-1 static tree sizes (depth --depth; '' for none)")
  ap.add_argument("--mtp-modules", type=int, help="modules of random MTP heads (default 2)")
  ap.add_argument("--temps", help="temperatures (a new temperature does not recompile)")
  ap.add_argument("--sets", help="prompt sets or .txt/.jsonl files (default mt_bench,humaneval)")
  ap.add_argument("--prompts", type=int, help="prompts per set")
  ap.add_argument("--new", type=int, help="new tokens per prompt (no EOS stop)")
  ap.add_argument("--cost-reps", type=int, help="interleaved repetitions per timed forward")
  ap.add_argument("--repeats", type=int, help="timed runs per prompt of each method and of "
                  "autoregressive, alternating; the fastest of each is kept (2; --quick: 1)")
  ap.add_argument("--render", help="rewrite the report (.md, .png) from this results JSON and exit")
  args = ap.parse_args(argv)
  if args.render:
    return render(args.render)
  bench.with_defaults(args, args.quick, FULL, QUICK)  # explicit options win over --quick
  ints = lambda s: sorted({int(x) for x in str(s).split(",") if x.strip()})
  temps = [float(t) for t in args.temps.split(",")]
  info = bench.machine_info()
  t_start = time.time()

  target = sj.load_model(args.model)
  eagle, eagle_label = resolve_heads(args.heads, "eagle", target, args.model)
  mtp, mtp_label = resolve_heads(args.mtp_heads, "mtp", target, args.model,
                                 num_heads=args.mtp_modules)
  ps = bench.load_prompt_sets(args.sets, args.prompts)

  k = args.top_k
  methods = {}  # label -> (method, row fields)
  for n in ints(args.nodes):
    methods[f"EAGLE-2 d={args.depth} N={n}"] = (
        sj.Eagle(eagle, tree="dynamic", depth=args.depth, top_k=min(k, n), num_nodes=n),
        {"kind": "EAGLE-2 dynamic", "depth": args.depth, "nodes": n, "sweep": "nodes"})
  for d in ints(args.depths):
    label = f"EAGLE-2 d={d} N={args.depth_nodes}"
    if label in methods:
      methods[label][1]["sweep"] = "both"
      continue
    methods[label] = (sj.Eagle(eagle, tree="dynamic", depth=d, top_k=min(k, args.depth_nodes),
                               num_nodes=args.depth_nodes),
                      {"kind": "EAGLE-2 dynamic", "depth": d, "nodes": args.depth_nodes,
                       "sweep": "depth"})
  for n in ints(args.static_nodes):
    t = trees.build_tree(trees.prior_accuracies(args.depth), n)
    methods[f"EAGLE-1 static N={n}"] = (
        sj.Eagle(eagle, tree=t), {"kind": "EAGLE-1 static", "depth": t.max_depth, "nodes": n,
                                  "sweep": "static"})
  g = mtp.config.num_heads
  methods[f"MTP K={g}"] = (sj.MTP(mtp), {"kind": "MTP", "depth": g, "nodes": g, "sweep": "mtp"})
  print(f"{args.model}: {target}; {eagle_label}; {mtp_label}; {len(ps)} prompts x {args.new} "
        f"tokens; T {temps}; {', '.join(methods)}", flush=True)

  curve = bench.measure_cost_curve(target, [f["nodes"] + 1 for _, f in methods.values()],
                                   reps=args.cost_reps)
  print("cost curve c(T):", {t: round(c, 2) for t, c in curve.items()}, flush=True)

  kw = dict(max_new_tokens=args.new, stop_at_eos=False)
  ar_tokens = {}
  for t in temps:  # the reference outputs (and the autoregressive program's compile)
    for i, (_, p, chat) in enumerate(ps):
      out = sj.generate(target, [p], sj.Autoregressive(), temperature=t, seed=i, chat=chat, **kw)
      ar_tokens[(t, i)] = out.tokens[0]

  rows = []
  for label, (m, fields) in methods.items():
    for t in temps:
      outs, ratios = [], []
      for i, (_, p, chat) in enumerate(ps):
        out, wall, ar_wall = bench.paired(
            lambda: sj.generate(target, [p], m, temperature=t, seed=i, chat=chat, **kw),
            lambda: sj.generate(target, [p], sj.Autoregressive(), temperature=t, seed=i,
                                chat=chat, **kw), args.repeats)
        outs.append(out)
        ratios.append(ar_wall / wall)
      tau, hist = pooled(outs)
      c = curve[fields["nodes"] + 1]
      rows.append(dict(fields, method=label, temperature=t, tau=tau,
                       tau_incl_prefill=statistics.median(o.stats["mean_accepted"] for o in outs),
                       depth_acceptance=depth_acceptance(hist), accepted_depth_hist=hist.tolist(),
                       cost=c, pred_speedup=tau / c, speedup=statistics.median(ratios),
                       speedups=ratios,
                       identical=(all(o.tokens[0] == ar_tokens[(t, i)] for i, o in enumerate(outs))
                                  if t == 0 else None)))
      r = rows[-1]
      print(f"  {label} T={t:g}: tau {tau:.3f}, speedup {r['speedup']:.2f}x (verify-only pred "
            f"{r['pred_speedup']:.2f}x), by depth "
            + "/".join(f"{x:.2f}" for x in r["depth_acceptance"]), flush=True)

  bench.finish_machine_info(info, t_start)
  data = {"experiment": "eagle", "model": args.model, "args": vars(args), "machine": info,
          "heads": {"eagle": eagle_label, "mtp": mtp_label,
                    "eagle_meta": eagle.meta, "mtp_meta": mtp.meta},
          "prompts": [(s, p[:80], chat) for s, p, chat in ps], "cost_curve": curve,
          "rows": rows, "deepseek_v3_second_token": DEEPSEEK_V3_SECOND_TOKEN}
  bench.publish(args.out, "results_quick" if args.quick else "results", data, markdown, plot)
  return data


def _fmt(xs) -> str:
  return "/".join("-" if np.isnan(x) else f"{x:.2f}" for x in xs)


def render(path: str) -> dict:
  """Rewrites a results JSON's .md and .png beside it (after a change to the tables or plots)."""
  return bench.rerender(path, markdown, plot)


def markdown(data: dict) -> str:
  m = data["machine"]
  lines = [f"Model {data['model']}; EAGLE: {data['heads']['eagle']}; MTP: {data['heads']['mtp']}; "
           f"{len(data['prompts'])} prompts x {data['args']['new']} new tokens, batch 1; "
           f"{bench.machine_summary(m)}.", "",
           "| method | T | depth | nodes N | tau | acceptance by depth | c(N+1) | "
           "verify-only pred. tau/c(N+1) | speedup measured | = AR |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in data["rows"]:
    ident = "-" if r["identical"] is None else ("yes" if r["identical"] else "NO")
    lines.append(f"| {r['method']} | {r['temperature']:g} | {r['depth']} | {r['nodes']} | "
                 f"{r['tau']:.3f} | {_fmt(r['depth_acceptance'])} | {r['cost']:.2f} | "
                 f"{r['pred_speedup']:.2f}x | {r['speedup']:.2f}x | {ident} |")
  lo, hi = data["deepseek_v3_second_token"]
  for r in data["rows"]:
    if r["kind"] == "MTP" and r["depth_acceptance"]:
      lines += ["", f"MTP at T={r['temperature']:g}: depth-1 (second token) acceptance "
                f"{r['depth_acceptance'][0]:.3f}; DeepSeek-V3 reports {lo:.0%}-{hi:.0%}."]
  return "\n".join(lines)


def plot(fig, data: dict) -> None:
  """tau by num_nodes (EAGLE-2 dynamic line, EAGLE-1 static markers), tau by depth, and MTP's
  acceptance per depth beside DeepSeek-V3's band; greedy rows (the first temperature)."""
  fig.set_size_inches(13, 4.2)
  t0 = data["rows"][0]["temperature"]
  rows = [r for r in data["rows"] if r["temperature"] == t0]
  ax1, ax2, ax3 = (fig.add_subplot(1, 3, i) for i in (1, 2, 3))
  dyn = sorted((r for r in rows if r["sweep"] in ("nodes", "both")), key=lambda r: r["nodes"])
  ax1.plot([r["nodes"] for r in dyn], [r["tau"] for r in dyn], "o-", label="EAGLE-2 dynamic")
  st = sorted((r for r in rows if r["kind"] == "EAGLE-1 static"), key=lambda r: r["nodes"])
  ax1.plot([r["nodes"] for r in st], [r["tau"] for r in st], "s--", label="EAGLE-1 static")
  ax1.set(xscale="log", xlabel="draft nodes N", ylabel="tau (tokens per target call)",
          title=f"tau by tree budget (T={t0:g})")
  nodes = sorted({r["nodes"] for r in dyn + st})
  ax1.minorticks_off()
  ax1.set_xticks(nodes, [str(n) for n in nodes])
  ax1.legend(fontsize=7)
  dn = data["args"]["depth_nodes"]  # the depth sweep, and the node sweep's point at its size
  dep = sorted((r for r in rows if r["kind"] == "EAGLE-2 dynamic" and r["nodes"] == dn),
               key=lambda r: r["depth"])
  ax2.plot([r["depth"] for r in dep], [r["tau"] for r in dep], "o-")
  ax2.set_xticks([r["depth"] for r in dep])
  ax2.set(xlabel="depth", ylabel="tau",
          title=f"EAGLE-2 tau by depth (N={dep[0]['nodes'] if dep else '-'})")
  mt = [r for r in rows if r["kind"] == "MTP"]
  if mt:
    acc = mt[0]["depth_acceptance"]
    ax3.bar(range(1, len(acc) + 1), [0 if np.isnan(a) else a for a in acc], label="measured")
    ax3.set_xticks(range(1, len(acc) + 1))
  lo, hi = data["deepseek_v3_second_token"]
  ax3.axhspan(lo, hi, color="C1", alpha=0.3, label="DeepSeek-V3, 2nd token")
  ax3.set(xlabel="MTP depth", ylabel="P(accepted | previous accepted)", ylim=(0, 1),
          title="MTP acceptance per depth")
  ax3.legend(fontsize=7)


if __name__ == "__main__":
  sys.exit(0 if main() is not None else 1)
