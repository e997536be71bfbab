"""Timing protocol, statistics and tables.

Protocol: every method runs the same prompts in the same process; each (method, prompt) pair is
compiled and warmed once, then timed `repeats` times; we report the median per prompt and the
median over prompts. Speedups are ratios of times measured in this same run, never against a
number from another day. Timing lives here and in experiments/, never in unit tests.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable, Sequence

import numpy as np


def median(xs: Sequence[float]) -> float:
  return float(statistics.median(xs)) if len(xs) else float("nan")


def time_call(fn: Callable[[], object], repeats: int) -> list[float]:
  out = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    out.append(time.perf_counter() - t0)
  return out


def measure_read_bandwidth(nbytes: int = 512 << 20, repeats: int = 7) -> float:
  """Best-of-n memory read bandwidth in bytes/s, from a jitted sum over a large float32 array
  (XLA uses every core, as the decode step does)."""
  import jax
  import jax.numpy as jnp

  x = jnp.ones((nbytes // 4,), jnp.float32)
  f = jax.jit(jnp.sum)
  f(x).block_until_ready()
  best = min(time_call(lambda: f(x).block_until_ready(), repeats))
  return nbytes / best


def measure_cost_curve(model, sizes=(1, 2, 4, 8, 16, 32, 64), *, cache_len: int = 512,
                       filled: int = 256, reps: int = 9) -> dict[int, float]:
  """c(T): the time of one T-token forward (model.apply, batch 1, a cache of `cache_len` slots
  with `filled` entries) over the time of a 1-token forward, medians of `reps` interleaved runs.
  This is the curve `specjax.tree.choose_budget` and the methods' predictions read."""
  import jax
  import jax.numpy as jnp

  from specjax import cache as kv

  sizes = sorted(set([1, *sizes]))
  fns = {}
  for t in sizes:
    cache = kv.rollback(model.init_cache(1, cache_len), jnp.array([filled]))
    toks = jnp.zeros((1, t), jnp.int32)
    pos = filled + jnp.arange(t)[None]
    mask = kv.causal_mask(cache.lengths, t, cache_len)
    f = jax.jit(lambda p, c, toks=toks, pos=pos, mask=mask: model.apply(p, toks, pos, c, mask)[0])
    jax.block_until_ready(f(model.params, cache))
    fns[t] = (f, cache)
  times = {t: [] for t in sizes}
  for _ in range(reps):
    for t in sizes:
      f, cache = fns[t]
      times[t].append(min(time_call(lambda: jax.block_until_ready(f(model.params, cache)), 1)))
  base = median(times[1])
  return {t: median(v) / base for t, v in times.items()}


def save_report(out_dir: str, stem: str, data: dict, markdown: str,
                plot: Callable | None = None) -> dict[str, str]:
  """Writes an experiment's raw results `stem.json`, its table `stem.md` and, when `plot` is
  given, `stem.png` (plot(fig) draws on a fresh matplotlib figure; the Agg backend, no display).
  Every file is written under a temporary name and renamed, so a killed run leaves the previous
  report whole. Returns {"json": path, "md": path[, "png": path]}."""
  import json

  os.makedirs(out_dir, exist_ok=True)
  paths = {"json": os.path.join(out_dir, f"{stem}.json"), "md": os.path.join(out_dir, f"{stem}.md")}

  def put(path, write):
    tmp = path + ".tmp"
    write(tmp)
    os.replace(tmp, path)

  put(paths["json"], lambda p: open(p, "w").write(json.dumps(data, indent=1, default=_jsonable)))
  put(paths["md"], lambda p: open(p, "w").write(markdown.rstrip() + "\n"))
  if plot is not None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(7, 4.5))
    plot(fig)
    fig.tight_layout()
    paths["png"] = os.path.join(out_dir, f"{stem}.png")
    put(paths["png"], lambda p: fig.savefig(p, dpi=110, format="png"))
    plt.close(fig)
  return paths


def _jsonable(x):
  if isinstance(x, np.generic):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  return str(x)


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
  """rows of dicts; columns (key, header, format) -> an aligned plain-text table."""
  cells = [[h for _, h, _ in columns]]
  for r in rows:
    cells.append([("-" if r.get(k) is None else format(r[k], f)) for k, _, f in columns])
  widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
  lines = ["  ".join(c[i].rjust(widths[i]) if i else c[i].ljust(widths[i])
                     for i in range(len(columns))) for c in cells]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return "\n".join(lines)


def bench_methods(model, prompts: list, methods: dict, *, max_new_tokens: int = 128,
                  repeats: int = 3, temperature: float = 0.0, chat: bool = False,
                  baseline: str | None = None, progress: bool = True) -> list[dict]:
  """Times each method on each prompt (batch 1). Returns one row per method with median tok/s,
  tau, speedup over `baseline` (default: the first method) and the per-prompt raw times."""
  import specjax as sj
  from tqdm.auto import tqdm

  baseline = baseline or next(iter(methods))
  per = {name: {"times": [], "tokens": [], "tau": [], "stats": []} for name in methods}
  work = [(name, i) for i in range(len(prompts)) for name in methods]
  for name, i in tqdm(work, desc="bench", disable=not progress):
    method = methods[name]
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, chat=chat, stop_at_eos=False)
    sj.generate(model, [prompts[i]], method, **kw)  # compile + warm
    outs = []
    times = time_call(lambda: outs.append(sj.generate(model, [prompts[i]], method, **kw)), repeats)
    per[name]["times"].append(median(times))
    per[name]["tokens"].append(outs[-1].stats["new_tokens"])
    per[name]["tau"].append(outs[-1].stats["mean_accepted"])
    per[name]["stats"].append(outs[-1].stats)
  base_t = np.array(per[baseline]["times"])
  rows = []
  for name, d in per.items():
    t = np.array(d["times"])
    rows.append({
        "method": name,
        "tok_s": median(list(np.array(d["tokens"]) / t)),
        "tau": median(d["tau"]),
        "speedup": median(list(base_t / t)),  # per-prompt ratio, then median
        "ms_per_token": 1e3 * median(list(t / np.array(d["tokens"]))),
        "raw": d,
    })
  return rows


def bench_vs_transformers(model_name: str = "smollm2-135m", prompts: list[str] | None = None, *,
                          max_new_tokens: int = 128, repeats: int = 3, progress: bool = True) -> dict:
  """specjax autoregressive vs transformers' PyTorch generate on the same weights and prompts,
  greedy, batch 1, fixed length; plus the fraction of the memory-bandwidth bound."""
  import torch
  import transformers
  from tqdm.auto import tqdm

  import specjax as sj
  from specjax import weights

  model = sj.load_model(model_name)
  path = weights.resolve(model_name)
  if os.path.isdir(path):
    tm = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
  else:
    tm = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
  tm.eval()
  prompts = prompts or ["The capital of France is", "def fibonacci(n):",
                        "Explain in one paragraph why the sky is blue."]
  ids = [model.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
  sj_t, hf_t = [], []
  for p in tqdm(ids, desc="specjax vs transformers", disable=not progress):
    kw = dict(max_new_tokens=max_new_tokens, stop_at_eos=False)
    sj.generate(model, [p], **kw)
    sj_t.append(median(time_call(lambda: sj.generate(model, [p], **kw), repeats)))
    x = torch.tensor([p])
    am = torch.ones_like(x)
    with torch.no_grad():
      gen = lambda: tm.generate(x, attention_mask=am, max_new_tokens=max_new_tokens,
                                min_new_tokens=max_new_tokens, do_sample=False)
      gen()
      hf_t.append(median(time_call(gen, repeats)))
  bw = measure_read_bandwidth()
  sj_tps = max_new_tokens / median(sj_t)
  hf_tps = max_new_tokens / median(hf_t)
  bound_tps = bw / model.num_param_bytes
  return {
      "model": model_name, "dtype": model.dtype.name, "max_new_tokens": max_new_tokens,
      "prompts": len(ids), "repeats": repeats, "torch_threads": torch.get_num_threads(),
      "specjax_tok_s": sj_tps, "transformers_tok_s": hf_tps, "ratio": sj_tps / hf_tps,
      "weight_bytes": model.num_param_bytes, "read_bandwidth_GBs": bw / 1e9,
      "bound_tok_s": bound_tps, "fraction_of_bound": sj_tps / bound_tps,
      "specjax_s": sj_t, "transformers_s": hf_t,
  }
