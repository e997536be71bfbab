"""Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding"): measured
tokens per target call and walltime against the paper's formulas, for drafts of every quality.

    python experiments/leviathan/run.py [--quick] [--model NAME_OR_DIR] [--out DIR]
    python experiments/leviathan/run.py --render results_quick.json   # rewrite its .md / .png

Drafts, from useless to perfect: a random model with the target's vocabulary; layer-skip
(`sj.SelfSpeculative`, the target's first k layers) at several depths; the shipped draft (or, for
a model without one, `shipped.draft_from_target(target, 1)`, labelled); the target as its own
draft (alpha = 1 at greedy). For each draft and gamma g, batch 1, the same prompts:

  alpha    the acceptance rate of drafted tokens, accepted / (accepted + rejections), pooled over
           prompts and gammas (one number per draft and temperature, as in the paper), and per
           cell (the same, one gamma only);
  tau      measured tokens per target call in the speculative loop, 1 + accepted / rounds (the
           prefill call excluded, a last round cut by max_new_tokens counted in full: the
           quantity E models);
  E        the paper's expected tokens per call (1 - a^(g+1)) / (1 - a), and tau's relative error
           against it; also E from the smallest gamma's alpha alone (an out-of-sample check:
           under i.i.d. acceptance one alpha predicts every gamma);
  speedup  measured walltime ratio against autoregressive on the same prompt, the two run
           alternately (the fastest of --repeats runs each; median over prompts), against the
           prediction E / (g c + c_v(g+1)), with c = one draft step / one target step
           (`draft_cost`: timed alternately) and c_v(T) the measured cost of a T-token target
           forward (`bench.measure_cost_curve`). The paper's denominator is
           g c + 1: it assumes verifying g + 1 tokens costs one step, which a CPU does not give.

Writes results.json / results.md / results.png (results_quick.* with --quick) to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import numpy as np

import specjax as sj
from specjax import bench, shipped

DRAFT_KINDS = ("random", "layerskip", "draft", "self")
FULL = dict(gammas="1,2,3,4,5,6,7,8", drafts=",".join(DRAFT_KINDS), exit_layers="0.25,0.5,0.75,0.9",
            sets="mt_bench,humaneval", prompts=3, new=128, temps="0,1", cost_reps=30, repeats=2)
QUICK = dict(FULL, gammas="1,3,6", exit_layers="0.8", prompts=1, new=64, temps="0", repeats=1)


def expected_tau(alpha: float, gamma: int) -> float:
  """Leviathan's E[tokens per call] = (1 - a^(g+1)) / (1 - a) (g + 1 at a = 1)."""
  a = min(max(float(alpha), 0.0), 1.0)
  return gamma + 1.0 if a >= 1.0 else (1 - a ** (gamma + 1)) / (1 - a)


def exit_layers(spec: str, num_layers: int) -> list[int]:
  """"0.5,0.8" (fractions of the depth) or "8,15" (layers) -> distinct exit layers in [1, L-1]."""
  out = []
  for x in spec.split(","):
    v = float(x)
    k = int(round(v * num_layers)) if v < 1 else int(v)
    k = min(max(k, 1), num_layers - 1)
    if k not in out:
      out.append(k)
  return out


def shipped_draft(model_name: str):
  """The registered draft model for `model_name` whose asset exists, or None."""
  for d in shipped.DRAFTERS.values():
    if d.kind == "draft" and d.target == model_name and os.path.isfile(d.path):
      return d.name
  return None


def build_drafts(target, model_name: str, kinds: list[str], layers: list[int]) -> dict:
  """label -> (factory(gamma) -> method, note). Every factory gives the same method type per
  label, so c is measured once per label."""
  out = {}
  cfg = target.config
  for kind in kinds:
    if kind == "random":
      # A 1-layer, 64-wide random model over the target's vocabulary: near-uniform logits, so
      # its argmax agrees with the target's about 1 / V of the time, and it costs little.
      rcfg = dataclasses.replace(cfg, num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2,
                                 head_dim=16, intermediate_size=128, tie_word_embeddings=True)
      rnd = sj.Model.random(rcfg, seed=0, dtype=target.dtype)
      out["random"] = (lambda g, d=rnd: sj.DraftModel(d, gamma=g),
                       "random 1-layer 64-wide model, target's vocabulary")
    elif kind == "layerskip":
      for k in layers:
        out[f"layer-skip k={k}"] = (lambda g, k=k: sj.SelfSpeculative(exit_layer=k, gamma=g),
                                    f"target's first {k} of {cfg.num_layers} layers + head")
    elif kind == "draft":
      name = shipped_draft(model_name)
      if name:
        d = sj.load_model(name)
        out[name] = (lambda g, d=d: sj.DraftModel(d, gamma=g), f"shipped draft {name}")
      else:
        d = shipped.draft_from_target(target, num_layers=1, name="first-layer draft")
        out["draft_from_target(1)"] = (lambda g, d=d: sj.DraftModel(d, gamma=g),
                                       "no shipped draft for this model: the target's first "
                                       "layer as a separate draft")
    elif kind == "self":
      out["target itself"] = (lambda g: sj.DraftModel(target, gamma=g),
                              "the target as its own draft (alpha = 1 at greedy)")
    else:
      raise SystemExit(f"--drafts: unknown kind {kind!r}; use {', '.join(DRAFT_KINDS)}")
  return out


def draft_cost(target, method, *, reps: int, cache_len: int = 512, filled: int = 256) -> dict:
  """c = one draft step / one target decode step, both one-token forwards at `filled` of
  `cache_len` slots, timed alternately and the median of the per-pair ratios kept.

  `measure_cost_ratio` times all target steps, then all draft steps: on this shared CPU the load
  moved between the two and gave c = 1.7 for the target as its own draft (1 by construction);
  alternating exposes both to the same load. The draft step is the method's own
  `_draft_forward` (the one the decode loop runs), compiled on its own."""
  import jax
  import jax.numpy as jnp

  from specjax import cache as kv
  from specjax.decode import Program

  lengths = jnp.full((1,), filled, jnp.int32)
  tok = jnp.zeros((1, 1), jnp.int32)
  prog = Program(target.graphdef, target.config, method, cache_len)
  arrays = method.arrays(target)
  if isinstance(method, sj.DraftModel):
    d = method.draft.config
    dcache = kv.init(d.num_layers, 1, cache_len, d.num_kv_heads, d.head_dim, method.draft.dtype)
  else:
    dcache = target.init_cache(1, cache_len)
  tcache = kv.rollback(target.init_cache(1, cache_len), lengths)
  mask = kv.causal_mask(lengths, 1, cache_len)
  step = jax.jit(lambda p, c: target.apply(p, tok, lengths[:, None], c, mask)[0])
  draft = jax.jit(lambda p, a, c: method._draft_forward(prog, p, a, c, tok, lengths)[0])
  calls = {"step": lambda: step(target.params, tcache),
           "draft": lambda: draft(target.params, arrays, dcache)}
  for f in calls.values():
    jax.block_until_ready(f())
  times = {k: [] for k in calls}
  for _ in range(reps):
    for k, f in calls.items():
      t0 = time.perf_counter()
      jax.block_until_ready(f())
      times[k].append(time.perf_counter() - t0)
  ratios = [d / t for d, t in zip(times["draft"], times["step"])]
  return {"c": statistics.median(ratios), "draft_step_ms": 1e3 * statistics.median(times["draft"]),
          "target_step_ms": 1e3 * statistics.median(times["step"])}


def rejections(s: dict) -> int:
  """Rounds that rejected a drafted token, recovered exactly from the method's stats
  (alpha = accepted / (accepted + rejected); alpha = 0 means every round rejected)."""
  acc, alpha = s["accepted_tokens"], s["alpha"]
  return s["draft_rounds"] if acc == 0 else int(round(acc * (1 - alpha) / alpha))


def depth_acceptance(hist: list[int], gamma: int, prefills: int) -> list[float]:
  """P(drafted token j accepted | tokens 1..j-1 accepted), j = 1..gamma, from `accept_hist`
  (steps by tokens emitted; the prefill's one-token steps removed). Under Leviathan's i.i.d.
  model every entry equals alpha; a profile that moves with depth means it is not. The histogram
  records emitted tokens, so a last round cut short by max_new_tokens reads as a rejection at
  the cut (at most one round per prompt: why the target as its own draft can show 0.97)."""
  h = np.zeros(gamma + 2)
  h[:len(hist)] = hist[:gamma + 2]
  h[1] -= prefills
  n = h[1:]  # n[j] = rounds that accepted j drafted tokens
  reached = n[::-1].cumsum()[::-1]  # rounds that accepted >= j
  return [float(reached[j] / reached[j - 1]) if reached[j - 1] else float("nan")
          for j in range(1, gamma + 1)]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="smollm2-135m", help="a model name or local HF dir / .gguf")
  ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
  ap.add_argument("--quick", action="store_true",
                  help="defaults for a short run: " + ", ".join(f"--{k.replace('_', '-')} {v}"
                                                              for k, v in QUICK.items()))
  ap.add_argument("--gammas", help=f"comma-separated (default {FULL['gammas']})")
  ap.add_argument("--drafts", help="subset of " + ",".join(DRAFT_KINDS) + " (default all)")
  ap.add_argument("--exit-layers", help="layer-skip depths: fractions of the depth (< 1) or "
                  f"layer counts (default {FULL['exit_layers']})")
  ap.add_argument("--sets", help="prompt sets or .txt/.jsonl files (default mt_bench,humaneval)")
  ap.add_argument("--prompts", type=int, help="prompts per set")
  ap.add_argument("--new", type=int, help="new tokens per prompt (no EOS stop)")
  ap.add_argument("--temps", help="temperatures (a new temperature does not recompile)")
  ap.add_argument("--cost-reps", type=int, help="interleaved repetitions per timed forward")
  ap.add_argument("--repeats", type=int, help="timed runs per prompt of each method and of "
                  "autoregressive, alternating; the fastest of each is kept (2; --quick: 1)")
  ap.add_argument("--render", help="rewrite the report (.md, .png) from this results JSON and exit")
  args = ap.parse_args(argv)
  if args.render:
    return render(args.render)
  bench.with_defaults(args, args.quick, FULL, QUICK)  # explicit options win over --quick
  gammas = sorted({int(g) for g in args.gammas.split(",")})
  temps = [float(t) for t in args.temps.split(",")]
  info = bench.machine_info()
  t_start = time.time()

  target = sj.load_model(args.model)
  drafts = build_drafts(target, args.model, args.drafts.split(","),
                        exit_layers(args.exit_layers, target.config.num_layers))
  ps = bench.load_prompt_sets(args.sets, args.prompts)
  print(f"{args.model}: {target}; {len(ps)} prompts x {args.new} tokens; drafts: "
        f"{', '.join(drafts)}; gammas {gammas}; T {temps}", flush=True)

  curve = bench.measure_cost_curve(target, [g + 1 for g in gammas], reps=args.cost_reps)
  print("cost curve c_v(T):", {t: round(c, 2) for t, c in curve.items()}, flush=True)
  costs = {}
  for label, (make, _) in drafts.items():
    costs[label] = draft_cost(target, make(1), reps=3 * args.cost_reps)
    print(f"  {label}: c = {costs[label]['c']:.3f} (draft step {costs[label]['draft_step_ms']:.2f} "
          f"ms, target step {costs[label]['target_step_ms']:.2f} ms)", flush=True)

  kw = dict(max_new_tokens=args.new, stop_at_eos=False)
  ar_tokens = {}
  for t in temps:  # the reference outputs (and the autoregressive program's compile)
    for i, (_, p, chat) in enumerate(ps):
      out = sj.generate(target, [p], sj.Autoregressive(), temperature=t, seed=i, chat=chat, **kw)
      ar_tokens[(t, i)] = out.tokens[0]

  cells = []
  for label, (make, _) in drafts.items():
    for g in gammas:
      m = make(g)
      for t in temps:
        outs, ratios = [], []
        for i, (_, p, chat) in enumerate(ps):
          out, wall, ar_wall = bench.paired(
              lambda: sj.generate(target, [p], m, temperature=t, seed=i, chat=chat, **kw),
              lambda: sj.generate(target, [p], sj.Autoregressive(), temperature=t, seed=i,
                                  chat=chat, **kw), args.repeats)
          outs.append(out)
          ratios.append(ar_wall / wall)
        cells.append({"draft": label, "gamma": g, "temperature": t, "outs": outs,
                      "ratios": ratios})
      for c in cells[-len(temps):]:
        acc = sum(o.stats["accepted_tokens"] for o in c["outs"])
        rounds = sum(o.stats["draft_rounds"] for o in c["outs"])
        print(f"  {label} g={g} T={c['temperature']:g}: tau {1 + acc / max(1, rounds):.2f}, "
              f"speedup {statistics.median(c['ratios']):.2f}x", flush=True)

  rows, summary = [], []
  for label in drafts:
    for t in temps:
      mine = [c for c in cells if c["draft"] == label and c["temperature"] == t]
      acc = sum(o.stats["accepted_tokens"] for c in mine for o in c["outs"])
      rej = sum(rejections(o.stats) for c in mine for o in c["outs"])
      alpha = acc / max(1, acc + rej)
      summary.append({"draft": label, "temperature": t, "alpha": alpha, "c": costs[label]["c"],
                      "note": drafts[label][1]})
      for c in mine:
        g, outs = c["gamma"], c["outs"]
        a_c = sum(o.stats["accepted_tokens"] for o in outs)
        r_c = sum(rejections(o.stats) for o in outs)
        rounds = sum(o.stats["draft_rounds"] for o in outs)
        tau = 1 + a_c / max(1, rounds)
        e = expected_tau(alpha, g)
        cv = curve[g + 1]
        hist = np.sum([np.pad(o.stats["accept_hist"], (0, g + 2))[:g + 2] for o in outs], axis=0)
        ratios = c["ratios"]
        rows.append({
            "draft": label, "gamma": g, "temperature": t, "alpha": alpha,
            "alpha_cell": a_c / max(1, a_c + r_c), "tau": tau, "E": e, "rel_err": (tau - e) / e,
            "E_cell": expected_tau(a_c / max(1, a_c + r_c), g),
            "tau_incl_prefill": statistics.median(o.stats["mean_accepted"] for o in outs),
            "depth_acceptance": depth_acceptance(hist.tolist(), g, len(outs)),
            "c": costs[label]["c"], "c_verify": cv,
            "pred_speedup": e / (g * costs[label]["c"] + cv),
            "pred_speedup_paper": e / (g * costs[label]["c"] + 1.0),
            "speedup": statistics.median(ratios), "speedups": ratios,
            "identical": (all(o.tokens[0] == ar_tokens[(t, i)] for i, o in enumerate(outs))
                          if t == 0 else None),
            "rounds": rounds, "accepted": a_c, "rejected": r_c,
        })

  for label in drafts:  # out of sample: the smallest gamma's alpha predicts every other gamma
    for t in temps:
      mine = [r for r in rows if r["draft"] == label and r["temperature"] == t]
      a0 = min(mine, key=lambda r: r["gamma"])["alpha_cell"]
      for r in mine:
        r["E_from_g_min"] = expected_tau(a0, r["gamma"])
        r["rel_err_from_g_min"] = (r["tau"] - r["E_from_g_min"]) / r["E_from_g_min"]

  bench.finish_machine_info(info, t_start)
  data = {"experiment": "leviathan", "model": args.model, "args": vars(args), "machine": info,
          "prompts": [(s, p[:80], chat) for s, p, chat in ps], "cost_curve": curve,
          "costs": costs, "drafts": summary, "rows": rows}
  bench.publish(args.out, "results_quick" if args.quick else "results", data, markdown, plot)
  return data


def render(path: str) -> dict:
  """Rewrites a results JSON's .md and .png beside it (after a change to the tables or plots)."""
  return bench.rerender(path, markdown, plot)


def markdown(data: dict) -> str:
  m = data["machine"]
  lines = [f"Model {data['model']}; {len(data['prompts'])} prompts x {data['args']['new']} new "
           f"tokens, batch 1; {bench.machine_summary(m)}.", "",
           "Cost curve c_v(T) (a T-token target forward / a 1-token forward): "
           + ", ".join(f"{t}: {c:.2f}" for t, c in sorted(data["cost_curve"].items(),
                                                         key=lambda kv: int(kv[0]))), "",
           "| draft | T | alpha | c (draft step / target step) | what |", "|---|---|---|---|---|"]
  for s in data["drafts"]:
    lines.append(f"| {s['draft']} | {s['temperature']:g} | {s['alpha']:.3f} | {s['c']:.3f} | {s['note']} |")
  lines += ["", "| draft | T | gamma | alpha (this gamma) | tau measured | E = (1-a^(g+1))/(1-a) | "
            "rel. error | E from the smallest gamma's alpha (rel. error) | accept. by depth | "
            "speedup measured | predicted E/(gc+c_v(g+1)) | paper's E/(gc+1) | = AR |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in data["rows"]:
    da = "/".join("-" if np.isnan(x) else f"{x:.2f}" for x in r["depth_acceptance"])
    ident = "-" if r["identical"] is None else ("yes" if r["identical"] else "NO")
    lines.append(f"| {r['draft']} | {r['temperature']:g} | {r['gamma']} | {r['alpha_cell']:.3f} | "
                 f"{r['tau']:.3f} | {r['E']:.3f} | {100 * r['rel_err']:+.1f}% | "
                 f"{r['E_from_g_min']:.3f} ({100 * r['rel_err_from_g_min']:+.1f}%) | {da} | "
                 f"{r['speedup']:.2f}x | {r['pred_speedup']:.2f}x | {r['pred_speedup_paper']:.2f}x | "
                 f"{ident} |")
  bad = [r for r in data["rows"] if abs(r["rel_err"]) > 0.10]
  lines += ["", f"tau within 10% of E in {len(data['rows']) - len(bad)} of {len(data['rows'])} cells"
            + (": outside in " + ", ".join(f"{r['draft']} g={r['gamma']} T={r['temperature']:g} "
                                          f"({100 * r['rel_err']:+.0f}%)" for r in bad) if bad else ".")]
  return "\n".join(lines)


def plot(fig, data: dict) -> None:
  """Left: tau (markers) against E from the draft's alpha (lines) by gamma; right: measured
  speedup (markers) against the prediction (lines). One colour per draft, greedy rows only
  where several temperatures ran (solid T=0, dashed the rest)."""
  fig.set_size_inches(11, 4.5)
  ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
  colours = {}
  for r in data["rows"]:
    colours.setdefault(r["draft"], f"C{len(colours)}")
  for (label, t) in dict.fromkeys((r["draft"], r["temperature"]) for r in data["rows"]):
    rs = sorted((r for r in data["rows"] if r["draft"] == label and r["temperature"] == t),
                key=lambda r: r["gamma"])
    g = [r["gamma"] for r in rs]
    ls = "-" if t == 0 else "--"
    name = f"{label}" + (f" T={t:g}" if t else "")
    ax1.plot(g, [r["E"] for r in rs], ls, color=colours[label], lw=1)
    ax1.plot(g, [r["tau"] for r in rs], "o", color=colours[label], ms=4, label=name)
    ax2.plot(g, [r["pred_speedup"] for r in rs], ls, color=colours[label], lw=1)
    ax2.plot(g, [r["speedup"] for r in rs], "o", color=colours[label], ms=4)
  ax1.set(xlabel="gamma", ylabel="tokens per target call", title="tau: measured (o), E (line)")
  ax2.set(xlabel="gamma", ylabel="speedup over autoregressive",
          title="speedup: measured (o), predicted (line)")
  ax2.axhline(1.0, color="grey", lw=0.5)
  ax1.legend(fontsize=7)


if __name__ == "__main__":
  sys.exit(0 if main() is not None else 1)
