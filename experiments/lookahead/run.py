"""Lookahead decoding (Fu et al., ICML 2024, "Break the Sequential Dependency of LLM Inference
Using Lookahead Decoding"): step compression against window W and n-gram size N, the paper's
scaling view (tau against the log of per-step FLOPs), and the speedup this machine's cost curve
allows.

    python experiments/lookahead/run.py [--quick] [--model NAME_OR_DIR] [--out DIR]
    python experiments/lookahead/run.py --render results_quick.json   # rewrite its .md / .png

For every (W, N) in the grid (G = W candidates per step, the paper's setting, unless --guess is
given), greedy, batch 1, the same prompts: one lookahead step runs T = 1 + (W + G)(N - 1) tokens
through the target, so per-step FLOPs grow as T. We report

  tau        step compression: generated tokens per lookahead step (the prefill call excluded),
             pooled over prompts;
  hit rate   steps whose pending token had a candidate n-gram in the pool;
  c(T)       this machine's cost of a T-token forward in one-token forwards
             (`bench.measure_cost_curve` at exactly these T);
  speedup    measured walltime ratio against autoregressive on the same prompt, the two run
             alternately (the fastest of --repeats runs each; median over prompts), beside the
             prediction tau / c(T) (drafting is free in lookahead: the n-grams ride in the same
             forward).

and per N a least-squares line tau = a + b log2(T), the paper's "tau grows linearly with
log(FLOPs)". Every greedy output is checked token-identical to autoregressive.
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
from specjax import bench

FULL = dict(windows="1,2,4,8,16", ngrams="2,3,4,5,6", guess=None, sets="mt_bench,humaneval",
            prompts=3, new=128, cost_reps=30, repeats=2)
QUICK = dict(FULL, windows="1,2,4,8", ngrams="3,5", prompts=1, new=64, repeats=1)


def log_fit(tokens: list[int], tau: list[float]) -> dict:
  """Least squares tau = a + b log2(T) and its R^2 (None with fewer than two distinct T)."""
  x = np.log2(np.asarray(tokens, float))
  y = np.asarray(tau, float)
  if len(set(tokens)) < 2:
    return {"a": None, "b": None, "r2": None}
  b, a = np.polyfit(x, y, 1)
  ss = float(np.sum((y - y.mean()) ** 2))
  r2 = 1 - float(np.sum((y - (a + b * x)) ** 2)) / ss if ss > 0 else 1.0
  return {"a": float(a), "b": float(b), "r2": r2}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="smollm2-135m", help="a model name or local HF dir / .gguf")
  ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
  ap.add_argument("--quick", action="store_true",
                  help="defaults for a short run: " + ", ".join(f"--{k.replace('_', '-')} {v}"
                                                              for k, v in QUICK.items()))
  ap.add_argument("--windows", help=f"lookahead windows W (default {FULL['windows']})")
  ap.add_argument("--ngrams", help=f"n-gram sizes N (default {FULL['ngrams']})")
  ap.add_argument("--guess", type=int, help="candidates verified per step G (default: G = W)")
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
  windows = sorted({int(w) for w in args.windows.split(",")})
  ngrams = sorted({int(n) for n in args.ngrams.split(",")})
  configs = [(w, n, args.guess or w) for n in ngrams for w in windows]
  info = bench.machine_info()
  t_start = time.time()

  target = sj.load_model(args.model)
  ps = bench.load_prompt_sets(args.sets, args.prompts)
  methods = {cfg: sj.Lookahead(window=cfg[0], ngram=cfg[1], guess=cfg[2]) for cfg in configs}
  sizes = sorted({m.tokens_per_step for m in methods.values()})
  print(f"{args.model}: {target}; {len(ps)} prompts x {args.new} tokens; (W, N, G) {configs}; "
        f"tokens per step {sizes}", flush=True)
  curve = bench.measure_cost_curve(target, sizes, reps=args.cost_reps)
  print("cost curve c(T):", {t: round(c, 2) for t, c in curve.items()}, flush=True)

  kw = dict(max_new_tokens=args.new, stop_at_eos=False, temperature=0.0)
  ar_tokens = [sj.generate(target, [p], sj.Autoregressive(), chat=chat, **kw).tokens[0]
               for _, p, chat in ps]  # the references (and the autoregressive compile)
  outs, ratios = {}, {}
  for cfg, m in methods.items():
    outs[cfg], ratios[cfg] = [], []
    for _, p, chat in ps:
      out, wall, ar_wall = bench.paired(lambda: sj.generate(target, [p], m, chat=chat, **kw),
                                  lambda: sj.generate(target, [p], sj.Autoregressive(), chat=chat,
                                                      **kw), args.repeats)
      outs[cfg].append(out)
      ratios[cfg].append(ar_wall / wall)
    new = sum(o.stats["new_tokens"] - 1 for o in outs[cfg])
    steps = sum(sum(o.stats["target_calls_per_row"]) - 1 for o in outs[cfg])
    print(f"  W={cfg[0]} N={cfg[1]} G={cfg[2]} (T={m.tokens_per_step}): tau "
          f"{new / max(1, steps):.3f}, speedup {statistics.median(ratios[cfg]):.2f}x", flush=True)

  rows = []
  for (w, n, g), m in methods.items():
    os_ = outs[(w, n, g)]
    steps = sum(sum(o.stats["target_calls_per_row"]) - 1 for o in os_)  # prefill excluded
    t = m.tokens_per_step
    tau = sum(o.stats["new_tokens"] - 1 for o in os_) / max(1, steps)
    rows.append({
        "window": w, "ngram": n, "guess": g, "tokens_per_step": t, "tau": tau,
        "pool_hit_rate": statistics.median(o.stats["pool_hit_rate"] for o in os_),
        "acceptance_rate": statistics.median(o.stats["acceptance_rate"] for o in os_),
        "cost": curve[t], "pred_speedup": tau / curve[t],
        "speedup": statistics.median(ratios[(w, n, g)]), "speedups": ratios[(w, n, g)],
        "identical": all(o.tokens[0] == ar_tokens[i] for i, o in enumerate(os_)),
    })
  fits = {n: log_fit([r["tokens_per_step"] for r in rows if r["ngram"] == n],
                     [r["tau"] for r in rows if r["ngram"] == n]) for n in ngrams}

  bench.finish_machine_info(info, t_start)
  data = {"experiment": "lookahead", "model": args.model, "args": vars(args), "machine": info,
          "prompts": [(s, p[:80], chat) for s, p, chat in ps], "cost_curve": curve,
          "rows": rows, "fits": fits}
  bench.publish(args.out, "results_quick" if args.quick else "results", data, markdown, plot)
  return data


def render(path: str) -> dict:
  """Rewrites a results JSON's .md and .png beside it (after a change to the tables or plots)."""
  return bench.rerender(path, markdown, plot)


def markdown(data: dict) -> str:
  m = data["machine"]
  lines = [f"Model {data['model']}; {len(data['prompts'])} prompts x {data['args']['new']} new "
           f"tokens, greedy, batch 1; {bench.machine_summary(m)}.", "",
           "| W | N | G | tokens per step T | tau (tokens / step) | pool hit rate | "
           "c(T) | predicted tau / c(T) | speedup measured | = AR |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in data["rows"]:
    lines.append(f"| {r['window']} | {r['ngram']} | {r['guess']} | {r['tokens_per_step']} | "
                 f"{r['tau']:.3f} | {r['pool_hit_rate']:.2f} | {r['cost']:.2f} | "
                 f"{r['pred_speedup']:.2f}x | {r['speedup']:.2f}x | "
                 f"{'yes' if r['identical'] else 'NO'} |")
  lines += ["", "Fit per N, tau = a + b log2(T) (the paper: step compression linear in "
            "log(FLOPs) per step):", "", "| N | a | b (tau per doubling of T) | R^2 |",
            "|---|---|---|---|"]
  for n, f in data["fits"].items():
    if f["b"] is None:
      lines.append(f"| {n} | - | - | - |")
    else:
      lines.append(f"| {n} | {f['a']:.3f} | {f['b']:.3f} | {f['r2']:.2f} |")
  return "\n".join(lines)


def plot(fig, data: dict) -> None:
  """Left: tau against tokens per step (log2 axis: per-step FLOPs), one line per N with its fit;
  right: measured speedup (markers) and tau / c(T) (lines) against T."""
  fig.set_size_inches(11, 4.5)
  ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
  for j, (n, f) in enumerate(data["fits"].items()):
    rs = sorted((r for r in data["rows"] if r["ngram"] == int(n)), key=lambda r: r["tokens_per_step"])
    t = np.array([r["tokens_per_step"] for r in rs], float)
    col = f"C{j}"
    ax1.plot(t, [r["tau"] for r in rs], "o", color=col, label=f"N={n}")
    for r in rs:
      ax1.annotate(f"W{r['window']}", (r["tokens_per_step"], r["tau"]), fontsize=6,
                   textcoords="offset points", xytext=(3, 3))
    if f["b"] is not None:
      ax1.plot(t, f["a"] + f["b"] * np.log2(t), "-", color=col, lw=1)
    ax2.plot(t, [r["pred_speedup"] for r in rs], "-", color=col, lw=1)
    ax2.plot(t, [r["speedup"] for r in rs], "o", color=col, label=f"N={n}")
  sizes = sorted({r["tokens_per_step"] for r in data["rows"]})
  for ax in (ax1, ax2):
    ax.set_xscale("log", base=2)
    ax.minorticks_off()
    ax.set_xticks(sizes, [str(t) for t in sizes])
    ax.set_xlabel("tokens per step T (per-step FLOPs, log scale)")
  ax1.set(ylabel="tau (tokens per step)", title="step compression vs per-step FLOPs")
  ax2.set(ylabel="speedup over autoregressive", title="measured (o), tau / c(T) (line)")
  ax2.axhline(1.0, color="grey", lw=0.5)
  ax1.legend(fontsize=7)


if __name__ == "__main__":
  sys.exit(0 if main() is not None else 1)
