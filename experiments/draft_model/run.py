"""Draft-model and layer-skip speculative decoding on SmolLM2-135M vs autoregressive (batch 1, CPU).

    .venv/bin/python experiments/draft_model/run.py [--prompts 5] [--new 128] [--hf]

For each prompt set (MT-Bench first turns with the chat template, HumanEval raw) and temperature
(0 and 0.7), every method decodes the same prompts back to back with the autoregressive baseline,
so load on a shared machine hits both alike. Reports the median per-prompt speedup, tau (tokens
per target call), alpha, and Leviathan's prediction from the measured cost ratio c:
tau / (gamma c + 1) (the paper's formula) and tau / (gamma c + v) with v the measured cost of the
verification relative to one decode step (at the mean width the method verified: gamma + 1, or
less for the adaptive variant, whose verification follows how far it drafted). --hf adds transformers' assisted
generation (the same target and draft weights, torch fp32, greedy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np

import specjax as sj
from specjax import bench, prompts
from specjax.methods.draft import leviathan_speedup, measure_cost_ratio

def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--prompts", type=int, default=5)
  ap.add_argument("--new", type=int, default=128)
  ap.add_argument("--gamma", type=int, default=3)
  ap.add_argument("--threshold", type=float, default=0.4,
                  help="adaptive variant: stop drafting under this draft confidence")
  ap.add_argument("--draft", default="smollm2-135m-draft", help="a named draft, or an exported draft asset (.npz)")
  ap.add_argument("--exit-layer", type=int, default=6)
  ap.add_argument("--temps", default="0,0.7")
  ap.add_argument("--sets", default="mt_bench,humaneval")
  ap.add_argument("--hf", action="store_true")
  ap.add_argument("--drafts", default="",
                  help="comma-separated drafts (names or .npz) to compare side by side with plain "
                  "draft-model rows at --gammas (replaces the default method set)")
  ap.add_argument("--gammas", default="3,5")
  args = ap.parse_args(argv)

  target = sj.load_model("smollm2-135m")

  def load_draft(name):
    # A shipped name or an exported asset (.npz, `specjax train draft --export`), built around
    # the target already loaded: it borrows the target's embeddings.
    return sj.load_model(name, target=target)

  draft = load_draft(args.draft)
  g = args.gamma
  if args.drafts:
    methods = {}
    for name in args.drafts.split(","):
      d = load_draft(name)
      label = os.path.basename(name)
      for gg in (int(x) for x in args.gammas.split(",")):
        methods[f"draft {label} g={gg}"] = sj.DraftModel(d, gamma=gg)
  else:
    methods = {
        f"draft g={g}": sj.DraftModel(draft, gamma=g),
        f"draft adaptive<={g + 2} thr={args.threshold}": sj.DraftModel(
            draft, gamma=g + 2, adaptive=True, threshold=args.threshold),
        f"layer-skip k={args.exit_layer} g={g}": sj.SelfSpeculative(
            exit_layer=args.exit_layer, gamma=g, vocab=draft.vocab_subset),
    }
  costs = {name: measure_cost_ratio(target, m, cache_len=512) for name, m in methods.items()}
  for name, c in costs.items():
    print(f"# {name}: c = {c['c']:.3f} (draft {c['draft_step_ms']:.1f} ms / target step "
          f"{c['target_step_ms']:.1f} ms), verify = {c['verify_over_step']:.2f} x step"
          + (" by width " + ", ".join(f"{w}: {v:.2f}" for w, v in c["verify_by_width"].items())
             if "verify_by_width" in c else ""), flush=True)

  rows = []
  for kind in args.sets.split(","):
    chat = kind != "humaneval"
    ps = prompts.load(kind, args.prompts)
    for temp in (float(t) for t in args.temps.split(",")):
      kw = dict(max_new_tokens=args.new, temperature=temp, chat=chat, stop_at_eos=False)
      res = {name: [] for name in ["autoregressive", *methods]}
      for i, p in enumerate(ps):
        base = sj.generate(target, [p], sj.Autoregressive(), seed=i, **kw).stats
        res["autoregressive"].append((1.0, base))
        for name, m in methods.items():  # a run that compiled is a warm-up (bench.paired)
          out, wall, ar_wall = bench.paired(
              lambda: sj.generate(target, [p], m, seed=i, **kw),
              lambda: sj.generate(target, [p], sj.Autoregressive(), seed=i, **kw), 1)
          res[name].append((ar_wall / wall, out.stats))
      for name, rs in res.items():
        st = [s for _, s in rs]
        row = {"set": kind, "temperature": temp, "method": name,
               "speedup": statistics.median(r for r, _ in rs),
               "tok_s": statistics.median(s["tokens_per_second"] for s in st),
               "tau": statistics.median(s["mean_accepted"] for s in st)}
        if name in methods:
          m, c = methods[name], costs[name]
          alpha = statistics.median(s["alpha"] for s in st)
          gam = statistics.median(s["drafted_per_step"] for s in st)
          row["verified"] = statistics.median(s["verified_per_step"] for s in st)
          row.update(alpha=alpha, drafted=gam, c=c["c"],
                     pred=leviathan_speedup(alpha, gam, c["c"]),
                     pred_v=leviathan_speedup(alpha, gam, c["c"], verify_cost(c, row)))
        rows.append(row)
        print(json.dumps(row), flush=True)

  if args.hf:
    rows += hf_assisted(target, draft, args)

  print("\n| set | T | method | speedup (median) | tok/s | tau | alpha | c | Leviathan pred. | pred. incl. verify |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    f = lambda k, fmt="{:.2f}": fmt.format(r[k]) if k in r else "-"
    print(f"| {r['set']} | {r['temperature']} | {r['method']} | {f('speedup')}x | {f('tok_s', '{:.1f}')} "
          f"| {f('tau')} | {f('alpha')} | {f('c', '{:.3f}')} | {f('pred')}x | {f('pred_v')}x |")


def verify_cost(c: dict, row: dict) -> float:
  """Measured verification cost (in decode steps) at the width this method used on average."""
  by_width = c.get("verify_by_width")
  if not by_width:
    return c["verify_over_step"]
  w = row["verified"]
  lo = min(max(int(np.floor(w)), min(by_width)), max(by_width))
  hi = min(lo + 1, max(by_width))
  return by_width[lo] + (w - lo) * (by_width[hi] - by_width[lo])  # linear between widths


def hf_assisted(target, draft, args):
  """transformers' assisted generation with the same weights (greedy), if torch is installed."""
  try:
    import time

    import torch
    import transformers
  except ImportError:
    print("# transformers/torch not installed: skipping the assisted-generation comparison")
    return []

  def to_hf(model, num_layers):
    cfg = model.config
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    p = model.params
    k, g, d, e = cfg.num_kv_heads, cfg.group_size, cfg.head_dim, cfg.hidden_size
    sd = {"model.embed_tokens.weight": np.asarray(p["embed"][...]),
          "model.norm.weight": np.asarray(p["final_norm"]["scale"][...])}
    for i in range(num_layers):
      lp = p["layers"][i]
      w = np.asarray(lp["attn"]["wqkv"][...]).transpose(1, 2, 3, 0)  # [K,G+2,D,E]
      pre = f"model.layers.{i}."
      sd[pre + "self_attn.q_proj.weight"] = w[:, :g].reshape(k * g * d, e)
      sd[pre + "self_attn.k_proj.weight"] = w[:, g].reshape(k * d, e)
      sd[pre + "self_attn.v_proj.weight"] = w[:, g + 1].reshape(k * d, e)
      sd[pre + "self_attn.o_proj.weight"] = np.asarray(lp["attn"]["wo"][...]).reshape(-1, e).T
      w_in = np.asarray(lp["mlp"]["w_in"][...])  # [E,2,F]
      sd[pre + "mlp.gate_proj.weight"] = w_in[:, 0].T
      sd[pre + "mlp.up_proj.weight"] = w_in[:, 1].T
      sd[pre + "mlp.down_proj.weight"] = np.asarray(lp["mlp"]["w_out"][...]).T
      sd[pre + "input_layernorm.weight"] = np.asarray(lp["attn_norm"]["scale"][...])
      sd[pre + "post_attention_layernorm.weight"] = np.asarray(lp["mlp_norm"]["scale"][...])
    missing, _ = hf.load_state_dict({n: torch.tensor(np.ascontiguousarray(v)) for n, v in sd.items()},
                                    strict=False)
    assert all("lm_head" in n for n in missing), missing
    hf.tie_weights()
    return hf

  torch.set_num_threads(os.cpu_count() or 1)
  hf_t, hf_d = to_hf(target, target.config.num_layers), to_hf(draft, draft.config.num_layers)
  variants = {  # transformers' assistant settings (generation_config of the assistant model)
      f"transformers assisted g={args.gamma}": dict(
          num_assistant_tokens=args.gamma, num_assistant_tokens_schedule="constant",
          assistant_confidence_threshold=0.0),
      "transformers assisted heuristic (5, +2/-1, conf 0.4)": dict(
          num_assistant_tokens=5, num_assistant_tokens_schedule="heuristic_transient",
          assistant_confidence_threshold=0.4),
  }
  rows = []
  for kind in args.sets.split(","):
    chat = kind != "humaneval"
    res = {name: [] for name in ["transformers AR", *variants]}
    same = 0
    ps = prompts.load(kind, args.prompts)
    for p in ps:
      ids = sj.decode._encode(target, [p], chat)[0]
      x = torch.tensor([ids])

      def run(extra):
        with torch.no_grad():
          hf_t.generate(x, max_new_tokens=4, do_sample=False, **extra)  # warm-up
          t0 = time.perf_counter()
          out = hf_t.generate(x, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                              **extra)
          return time.perf_counter() - t0, out[0, len(ids):].tolist()

      t_ar, toks = run({})
      res["transformers AR"].append((1.0, args.new / t_ar))
      for name, gc in variants.items():
        for k, v in gc.items():
          setattr(hf_d.generation_config, k, v)
        t, toks_a = run({"assistant_model": hf_d})
        res[name].append((t_ar / t, args.new / t))
        same += toks_a == toks
      mine = sj.generate(target, [p], max_new_tokens=args.new, chat=chat, stop_at_eos=False).tokens[0]
      same += toks[:len(mine)] == mine
    for name, rs in res.items():
      rows.append({"set": kind, "temperature": 0.0, "method": name,
                   "speedup": statistics.median(r for r, _ in rs),
                   "tok_s": statistics.median(t for _, t in rs)})
      print(json.dumps(rows[-1]), flush=True)
    print(f"# {kind}: transformers outputs identical to each other and to specjax AR in "
          f"{same}/{len(ps) * (len(variants) + 1)} comparisons", flush=True)
  return rows


if __name__ == "__main__":
  sys.exit(main())
