"""One prepared check for an accelerator lent for a few minutes (issue 47): does every method run,
stay lossless, and how fast, on one GPU.

    python experiments/accelerator/run.py [--quick] [--out DIR] [--sections a,b] [--budget S]
        [--shapes llama3-8b,smollm2-135m,gemma3-270m] [--methods a,b] [--sizes 1,2,...]
        [--new N] [--reps N]

Random weights in the shapes of real models (nothing big travels; no network, no `gguf`):

    device              what it ran on (jax's devices, versions, torch / CUDA)
    lossless            every registered method (specjax.exactness.build_method: small settings,
                        random drafters) on a tiny random model, batch 4 of mixed prompt lengths,
                        against autoregressive decoding: float32 at matmul precision "highest"
                        and bfloat16, each judged by the tie-aware criterion of
                        specjax/exactness.py (strict identity recorded beside it)
    cost_curve          c(T) = time(T-token forward) / time(1-token forward), T = 1 .. 256, bf16,
                        batch 1, a cache of 512 slots with 256 filled, per shape
    ar_vs_roofline      autoregressive tokens/s (batch 1, bf16, prefill of a short prompt
                        included) against the memory roofline: the device's measured copy
                        bandwidth over the bytes a token must read (weights, plus the KV cache
                        at the mean context); a second roofline counts the whole static cache,
                        which the model's attention reads through its mask
    profile             one autoregressive generation under jax's profiler: kernel time per token
                        against wall time per token, and the kernels that take it
    ar_vs_transformers  the same weights in transformers (Llama-family shapes) with
                        `generate(cache_implementation="static")`, same dtype, same prompt and
                        length, on the same device; skipped, with the reason, where torch
                        cannot reach the device jax runs on
    methods             every method's time per round (one propose/verify/accept step) on the
                        SmolLM2 shape in bf16, against an autoregressive step; tau there comes
                        from random drafters and means nothing, so `tau_cpu` is read from the
                        CPU Spec-Bench run with the shipped drafters
                        (experiments/spec_bench/chat_code/results.json), labelled as such

Writes results.json (after every section, so a run cut short keeps what it measured) and
results.md into --out (results_quick.* with --quick). --budget: seconds after which the remaining
work is skipped and recorded as such (default 450 on a device, none with --quick). --quick runs
every section at tiny sizes (few methods; shapes cut to two layers) on a CPU in about a minute.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import sys
import time
import traceback

# Before jax starts: XLA would take 75% of GPU memory at once, leaving too little for torch's
# copy of the 8B model (ar_vs_transformers); named methods choose no defaults from a measured
# curve here (every method is built with explicit settings).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("SPECJAX_CALIBRATION", "0")

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import specjax as sj  # noqa: E402
from specjax import arch, bench, calibrate, exactness  # noqa: E402
from specjax import methods as registry  # noqa: E402

SECTIONS = ("device", "lossless", "cost_curve", "ar_vs_roofline", "profile", "ar_vs_transformers",
            "methods")
SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
QUICK_SIZES = (1, 4, 16)

# HF config.json fields of the models whose shapes are timed (random weights: none travel), the
# 8B first: the goals are set for it, and a run short of time skips the shapes last in line.
SHAPES = {
    "llama3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                      rms_norm_eps=1e-5, tie_word_embeddings=False),
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=True),
    "gemma3-270m": dict(model_type="gemma3_text", vocab_size=262144, hidden_size=640,
                        intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
                        rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window=512,
                        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
                        query_pre_attn_scalar=256, rms_norm_eps=1e-6, tie_word_embeddings=True),
}
# --quick: the same families and features (tied or not, GQA ratio, Gemma's windows and q/k norms)
# at two layers and a small width.
QUICK_SHAPES = {
    "llama3-8b": dict(SHAPES["llama3-8b"], vocab_size=512, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2),
    "smollm2-135m": dict(SHAPES["smollm2-135m"], vocab_size=512, hidden_size=72,
                         intermediate_size=96, num_hidden_layers=2),
    "gemma3-270m": dict(SHAPES["gemma3-270m"], vocab_size=512, hidden_size=64,
                        intermediate_size=128, num_hidden_layers=2, head_dim=16, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention"],
                        query_pre_attn_scalar=16),
}
SPEC_BENCH = os.path.join(ROOT, "experiments", "spec_bench", "chat_code", "results.json")


@dataclasses.dataclass
class Run:
  """What every section reads: the options, the time budget, the results so far."""
  quick: bool
  out: str
  shapes: dict
  sizes: tuple
  methods: list
  new: int
  reps: int
  deadline: float | None
  results: dict

  @property
  def prompt_len(self) -> int:
    """Prompt tokens of the batch-1 sections (ar_vs_roofline, ar_vs_transformers, methods)."""
    return 8 if self.quick else 32

  def over(self) -> bool:
    return self.deadline is not None and time.time() > self.deadline

  def save(self) -> None:
    stem = "results_quick" if self.quick else "results"
    bench.save_report(self.out, stem, self.results, render(self.results))


SKIPPED = "skipped: past the time budget (--budget)"


def error(e: BaseException) -> dict:
  return {"error": f"{type(e).__name__}: {e}"[:2000],
          "where": traceback.format_exc(limit=-3)[-2000:]}


# ----------------------------------------------------------------------------- models


def config(shape: str, hf: dict) -> sj.ModelConfig:
  return arch.from_hf_dict(dict(hf), source=f"{shape} (shape only)")


def random_model(cfg: sj.ModelConfig, dtype=jnp.bfloat16, seed: int = 0, scale: float = 0.02):
  """A model with sj.Model.random's kind of weights (N(0, scale) matrices, unit norm scales, zero
  biases; not its exact draws), made with one compiled draw per distinct weight shape.

  Drawing the whole model in one jitted program (as nnx builds it) gives XLA one random-number
  kernel per weight array to compile: 130 for the 8B shape, which took 85 s on an H200
  (2026-11-30), longer than timing it. Here the draws for every array of one shape and dtype share
  a program (a handful per model), so building costs a few compiles and the draws themselves."""
  from flax import nnx

  from specjax.model import Decoder, path_key

  cfg.validate()
  graphdef, abstract = nnx.split(nnx.eval_shape(
      lambda: Decoder(cfg, dtype=dtype, rngs=nnx.Rngs(seed))))
  base = jax.random.key(seed)
  leaves, tree = jax.tree_util.tree_flatten_with_path(abstract)
  values = []
  for i, (path, leaf) in enumerate(leaves):
    name = str(path_key(path)[-1])
    if leaf.ndim == 1 and name == "scale":
      values.append(jnp.ones(leaf.shape, leaf.dtype))
    elif name == "bias" or name.startswith("b_") or name in ("bqkv", "bo"):
      values.append(jnp.zeros(leaf.shape, leaf.dtype))
    else:
      values.append(_draw(jax.random.fold_in(base, i), leaf.shape, jnp.dtype(leaf.dtype), scale))
  return sj.Model(cfg, graphdef, jax.tree_util.tree_unflatten(tree, values), name="random",
                  dtype=dtype)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _draw(key, shape, dtype, scale):
  """scale * N(0, 1) of one shape and dtype: compiled once per (shape, dtype, scale)."""
  return scale * jax.random.normal(key, shape, dtype)


def tiny_target(dtype, seed: int = 0):
  """The lossless suite's tiny target (tests/helpers/models.py's tiny_model's shape and weight
  scale, so its logits spread wide; drawn by random_model), its weights cast to dtype."""
  cfg = sj.ModelConfig(arch="llama", vocab_size=61, hidden_size=32, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, intermediate_size=48,
                       max_position_embeddings=512, rope_theta=10000.0)
  m = random_model(cfg, jnp.float32, seed, scale=0.3)
  if jnp.dtype(dtype) == jnp.float32:
    return m
  params = jax.tree_util.tree_map(lambda x: x.astype(dtype), m.params)
  return sj.Model(cfg, m.graphdef, params, dtype=dtype)


def prompts(n: int, vocab: int, lo: int, hi: int, seed: int = 1) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, vocab, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def timed_generate(model, ids, method, new: int, reps: int):
  """(first output, best wall seconds of `reps` runs after a warm-up run that compiles)."""
  out = sj.generate(model, ids, method, max_new_tokens=new, stop_at_eos=False)
  best = float("inf")
  for _ in range(reps):
    o = sj.generate(model, ids, method, max_new_tokens=new, stop_at_eos=False)
    best = min(best, o.stats["wall_time_s"])
  return out, best


# ----------------------------------------------------------------------------- sections


def section_device(run: Run) -> dict:
  import flax
  import jaxlib

  dev = jax.devices()[0]
  info = {"platform": dev.platform, "device_kind": dev.device_kind, "count": jax.device_count(),
          "jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__,
          "machine": bench.machine_info(), "xla_flags": os.environ.get("XLA_FLAGS", "")}
  with contextlib.suppress(Exception):
    stats = dev.memory_stats() or {}
    info["memory_gib"] = round(stats.get("bytes_limit", 0) / 2 ** 30, 1) or None
  try:
    import torch
    info["torch"] = torch.__version__
    info["torch_cuda"] = bool(torch.cuda.is_available())
    if info["torch_cuda"]:
      info["torch_device"] = torch.cuda.get_device_name(0)
  except Exception as e:  # noqa: BLE001
    info["torch"] = f"not usable: {type(e).__name__}: {e}"
  with contextlib.suppress(Exception):
    import transformers
    info["transformers"] = transformers.__version__
  return info


def section_lossless(run: Run) -> dict:
  """Every method in float32 (matmul precision "highest") and bfloat16 on the tiny target."""
  rows = []
  ids = prompts(4, 61, 3, 16)
  for dtype, precision in ((jnp.float32, "highest"), (jnp.bfloat16, None)):
    ctx = jax.default_matmul_precision(precision) if precision else contextlib.nullcontext()
    with ctx:
      target = tiny_target(dtype)
      ref = sj.generate(target, ids, max_new_tokens=run.new, stop_at_eos=False).tokens
      for name in run.methods:
        row = {"method": name, "dtype": jnp.dtype(dtype).name, "precision": precision or "default"}
        if run.over():
          rows.append(dict(row, status=SKIPPED))
          continue
        t0 = time.time()
        try:
          method = exactness.build_method(name, target)
          out = sj.generate(target, ids, method, max_new_tokens=run.new, stop_at_eos=False)
          report = exactness.check_greedy(target, ids, ref, out.tokens, dtype=dtype)
          row.update(status="ok" if report.ok else "FAILED", identical=report.identical,
                     ties=len(report.divergences) - len(report.failures),
                     failures=len(report.failures), tau=out.stats["mean_accepted"],
                     settings=repr(method), report=report.to_dict())
        except Exception as e:  # noqa: BLE001 (one method's error must not end the check)
          row.update(status="ERROR", **error(e))
        row["seconds"] = round(time.time() - t0, 1)
        rows.append(row)
        print(f"  lossless {row['dtype']:8s} {name:15s} {row['status']}", flush=True)
  return {"target": "tiny random llama (V=61, E=32, 2 layers; tests/helpers/models.py tiny_model)",
          "batch": len(ids), "new_tokens": run.new, "rows": rows,
          "all_ok": all(r["status"] == "ok" for r in rows)}


def copy_bandwidth(nbytes: int, reps: int = 10) -> float:
  """Bytes/s moved by a jitted elementwise copy (read + write) of an nbytes float32 array."""
  x = jnp.ones((nbytes // 4,), jnp.float32)
  f = jax.jit(lambda x: x * 2)
  jax.block_until_ready(f(x))
  best = min(bench.time_call(lambda: jax.block_until_ready(f(x)), reps))
  return 2 * nbytes / best


def read_bytes_per_token(model, context: float) -> dict:
  """Bytes a batch-1 decode step must read: every weight once (an untied embedding only its
  row), plus K and V at `context` positions."""
  c = model.config
  itemsize = jnp.dtype(model.dtype).itemsize
  weights = model.num_param_bytes
  if not c.tie_word_embeddings:
    weights -= (c.vocab_size - 1) * c.hidden_size * itemsize
  kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * itemsize
  return {"weights": int(weights), "kv_per_position": int(kv), "kv": int(kv * context)}


def shape_sections(run: Run, wanted: list[str]) -> None:
  """cost_curve, ar_vs_roofline and ar_vs_transformers into run.results, one shape at a time
  (one random model per shape, dropped before the next: the 8B shape takes 16 GB in bf16)."""
  res = {s: run.results.setdefault(s, {}) for s in wanted}
  bw = None
  if "ar_vs_roofline" in wanted:
    bw = copy_bandwidth((64 << 20) if run.quick else (2 << 30))
    res["ar_vs_roofline"]["copy_bandwidth_gbs"] = round(bw / 1e9, 1)
  prompt_len = run.prompt_len
  for shape, hf in run.shapes.items():
    if run.over():
      for s in wanted:
        res[s][shape] = {"status": SKIPPED}
      continue
    print(f"  shape {shape}", flush=True)
    try:
      cfg = config(shape, hf)
      t0 = time.time()
      model = random_model(cfg)
      jax.block_until_ready(jax.tree_util.tree_leaves(model.params))
      built = round(time.time() - t0, 1)
    except Exception as e:  # noqa: BLE001
      for s in wanted:
        res[s][shape] = {"status": "ERROR", **error(e)}
      continue
    ids = prompts(1, cfg.vocab_size, prompt_len, prompt_len + 1, seed=3)
    ours = None
    if "cost_curve" in wanted:
      res["cost_curve"][shape] = _cost_curve(run, model)
      run.save()
    if "ar_vs_roofline" in wanted and not run.over():
      res["ar_vs_roofline"][shape], ours = _roofline(run, model, ids, bw)
      res["ar_vs_roofline"][shape]["build_s"] = built
      run.save()
    if "profile" in wanted and not run.over():
      res["profile"][shape] = _profile(run, model, ids)
      run.save()
    if "ar_vs_transformers" in wanted and not run.over():
      res["ar_vs_transformers"][shape] = _vs_transformers(run, shape, hf, model, ids, ours)
    for s in wanted:
      res[s].setdefault(shape, {"status": SKIPPED})
    run.save()
    del model


def _cost_curve(run: Run, model) -> dict:
  try:
    reps = 3 if run.quick else 5
    secs = calibrate.measure_seconds(model, run.sizes, cache_len=256 + max(run.sizes),
                                     filled=256, reps=reps)
    return {"status": "ok", "ms": {t: round(1000 * s, 4) for t, s in secs.items()},
            "c": {t: round(s / secs[1], 3) for t, s in secs.items()},
            "c_envelope": {t: round(v, 3) for t, v in calibrate.curve_of(secs).items()},
            "reps": reps, "cache": [256 + max(run.sizes), 256]}
  except Exception as e:  # noqa: BLE001
    return {"status": "ERROR", **error(e)}


def _roofline(run: Run, model, ids, bw) -> tuple[dict, list | None]:
  try:
    out, wall = timed_generate(model, ids, sj.Autoregressive(), run.new, run.reps)
    tok_s = run.new / wall
    reads = read_bytes_per_token(model, len(ids[0]) + run.new / 2)
    static = reads["weights"] + reads["kv_per_position"] * out.stats["cache_len"]
    roof = bw / (reads["weights"] + reads["kv"])
    return {"status": "ok", "tokens_per_s": round(tok_s, 2), "ms_per_token": round(1000 / tok_s, 3),
            "prompt_tokens": len(ids[0]), "new_tokens": run.new, "prefill_included": True,
            "bytes_per_token": reads["weights"] + reads["kv"], "weight_bytes": reads["weights"],
            "roofline_tokens_per_s": round(roof, 2), "fraction_of_roofline": round(tok_s / roof, 3),
            "static_cache_len": out.stats["cache_len"],
            "compile_s": round(out.stats["compile_time_s"], 1),
            "fraction_of_static_roofline": round(tok_s / (bw / static), 3)}, out.tokens[0]
  except Exception as e:  # noqa: BLE001
    return {"status": "ERROR", **error(e)}, None


def _profile(run: Run, model, ids) -> dict:
  """One autoregressive generation (compiled by ar_vs_roofline where it ran) under jax's
  profiler: the kernels' time per token beside the wall time per token, and the kernels that
  take it. What the device does in a step that the weights' read time does not explain."""
  import glob
  import tempfile

  try:
    method = sj.Autoregressive()
    sj.generate(model, ids, method, max_new_tokens=run.new, stop_at_eos=False)
    with tempfile.TemporaryDirectory() as d:
      with jax.profiler.trace(d):
        out = sj.generate(model, ids, method, max_new_tokens=run.new, stop_at_eos=False)
      files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
      if not files:
        return {"status": "ERROR", "error": "the profiler wrote no .xplane.pb"}
      times, lines = kernel_times(jax.profiler.ProfileData.from_file(files[0]))
    if not times:
      return {"status": "ERROR", "error": "no kernel events found", "lines": lines}
    new = run.new
    total = sum(sum(v) for v in times.values()) / 1e6
    wall = 1000 * out.stats["wall_time_s"]
    top = sorted(times.items(), key=lambda kv: -sum(kv[1]))[:12]
    return {"status": "ok", "source": lines, "tokens": new,
            "wall_ms_per_token": round(wall / new, 4),
            "kernel_ms_per_token": round(total / new, 4),
            "busy_fraction": round(total / wall, 3),
            "kernels_per_token": round(sum(len(v) for v in times.values()) / new, 1),
            "top": [{"kernel": k[:90], "ms_per_token": round(sum(v) / 1e6 / new, 4),
                     "per_token": round(len(v) / new, 2), "mean_us": round(np.mean(v) / 1e3, 2)}
                    for k, v in top]}
  except Exception as e:  # noqa: BLE001
    return {"status": "ERROR", **error(e)}


def kernel_times(data) -> tuple[dict[str, list[float]], list[str]]:
  """Durations (ns) per kernel name in a jax profile, and the lines they came from: on an
  accelerator its device planes' stream lines (the kernels and copies as the device ran them);
  with none (a CPU), the host's XLA client threads (their ops as the host ran them)."""
  picked = [(p.name, ln) for p in data.planes if p.name.startswith("/device:")
            for ln in p.lines if ln.name.startswith("Stream")]
  if not picked:
    picked = [(p.name, ln) for p in data.planes if p.name == "/host:CPU"
              for ln in p.lines if ln.name.startswith("tf_XLAPjRt")]
  times: dict[str, list[float]] = {}
  for _, ln in picked:
    for ev in ln.events:
      if not ev.name.startswith(("ThreadpoolListener", "ThunkExecutor")):  # CPU: enclosing spans
        times.setdefault(ev.name, []).append(float(ev.duration_ns))
  return times, [f"{plane}: {ln.name}" for plane, ln in picked]


def hf_state_dict(model, torch, device) -> dict:
  """A Llama-family specjax model's params as HF LlamaForCausalLM tensors (the inverse of
  specjax/arch/llama.py's params_from_hf), shared with jax through DLPack where it can (no copy
  on the GPU), else copied through the host."""
  from specjax.model import path_key

  c = model.config
  e, h, k, d, g = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.group_size
  flat = {path_key(p): x for p, x in jax.tree_util.tree_flatten_with_path(model.params)[0]}

  def t(x):
    try:
      return torch.from_dlpack(x).to(device)
    except Exception:  # noqa: BLE001 (an old torch or a dtype DLPack lacks)
      return torch.from_numpy(np.asarray(x, np.float32)).to(device=device, dtype=torch.bfloat16
                                                            if x.dtype == jnp.bfloat16 else None)

  sd = {"model.embed_tokens.weight": t(flat[("embed",)]),
        "model.norm.weight": t(flat[("final_norm", "scale")])}
  for i in range(c.num_layers):
    L, p = ("layers", i), f"model.layers.{i}."
    qkv = t(flat[L + ("attn", "wqkv")])  # [E,K,G+2,D]
    sd[p + "self_attn.q_proj.weight"] = qkv[:, :, :g].reshape(e, h * d).T
    sd[p + "self_attn.k_proj.weight"] = qkv[:, :, g].reshape(e, k * d).T
    sd[p + "self_attn.v_proj.weight"] = qkv[:, :, g + 1].reshape(e, k * d).T
    sd[p + "self_attn.o_proj.weight"] = t(flat[L + ("attn", "wo")]).reshape(h * d, e).T
    w_in = t(flat[L + ("mlp", "w_in")])  # [E,2,F]
    sd[p + "mlp.gate_proj.weight"] = w_in[:, 0].T
    sd[p + "mlp.up_proj.weight"] = w_in[:, 1].T
    sd[p + "mlp.down_proj.weight"] = t(flat[L + ("mlp", "w_out")]).T
    sd[p + "input_layernorm.weight"] = t(flat[L + ("attn_norm", "scale")])
    sd[p + "post_attention_layernorm.weight"] = t(flat[L + ("mlp_norm", "scale")])
  sd["lm_head.weight"] = sd["model.embed_tokens.weight"] if c.tie_word_embeddings else \
      t(flat[("lm_head",)]).T
  return sd


def _vs_transformers(run: Run, shape: str, hf: dict, model, ids, ours) -> dict:
  platform = jax.devices()[0].platform
  try:
    import torch
    import transformers
  except Exception as e:  # noqa: BLE001
    return {"status": f"skipped: torch / transformers not importable ({type(e).__name__}: {e})"}
  if hf["model_type"] != "llama":
    return {"status": "skipped: only Llama-family shapes are converted to transformers here"}
  if platform == "gpu" or platform == "cuda":
    if not torch.cuda.is_available():
      return {"status": "skipped: jax runs on a GPU but this torch has no CUDA"}
    device = "cuda"
  elif platform == "cpu":
    device = "cpu"
  else:
    return {"status": f"skipped: torch cannot run on jax's platform {platform!r}"}
  try:
    cfg = transformers.LlamaConfig(**{k: v for k, v in hf.items() if k != "model_type"},
                                   eos_token_id=None, bos_token_id=None, pad_token_id=0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no float32 copy of 8B weights
    try:
      with torch.device(device):
        ref = transformers.LlamaForCausalLM(cfg).eval()
    finally:
      torch.set_default_dtype(default)
    missing, unexpected = ref.load_state_dict(hf_state_dict(model, torch, device), strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
      raise ValueError(f"state dict mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    x = torch.tensor(ids, device=device)
    kw = dict(max_new_tokens=run.new, min_new_tokens=run.new, do_sample=False,
              cache_implementation="static", pad_token_id=0)

    def gen():
      with torch.no_grad():
        y = ref.generate(x, **kw)
      if device == "cuda":
        torch.cuda.synchronize()
      return y

    gen()  # warm-up
    walls, y = [], None
    for _ in range(run.reps):
      t0 = time.perf_counter()
      y = gen()
      walls.append(time.perf_counter() - t0)
    theirs = y[0, len(ids[0]):].tolist()
    tok_s = run.new / min(walls)
    ar = run.results.get("ar_vs_roofline", {}).get(shape, {}).get("tokens_per_s")
    row = {"status": "ok", "transformers_tokens_per_s": round(tok_s, 2), "device": device,
           "specjax_tokens_per_s": ar, "speedup": round(ar / tok_s, 3) if ar else None,
           "transformers": transformers.__version__, "torch": torch.__version__,
           "generate": "static cache, eager, greedy, bf16"}
    if ours is not None:
      whole, prefix = bench.agreement([theirs], [ours])
      row["same_tokens"] = bool(whole)
      row["agreeing_prefix"] = round(prefix, 3)
    del ref
    if device == "cuda":
      torch.cuda.empty_cache()
    return row
  except Exception as e:  # noqa: BLE001
    return {"status": "ERROR", **error(e)}


def cpu_tau() -> dict[str, float]:
  """Each method's tau over all prompts of the CPU Spec-Bench run with the shipped drafters on
  SmolLM2-135M (experiments/spec_bench/chat_code/results.json: MT-Bench and HumanEval, float32),
  where that file is."""
  try:
    with open(SPEC_BENCH) as f:
      summary = json.load(f)["summary"]
  except (OSError, ValueError, KeyError):
    return {}
  return {m: round(float(cats["overall"]["tau"]), 2) for m, cats in summary.items()
          if isinstance(cats, dict) and "tau" in cats.get("overall", {})}


def section_methods(run: Run) -> dict:
  """Each method's time per round on the SmolLM2 shape (else the first of --shapes; bf16, batch
  1) over an autoregressive step's."""
  shape = "smollm2-135m" if "smollm2-135m" in run.shapes else next(iter(run.shapes))
  target = random_model(config(shape, run.shapes[shape]))
  # A prompt that repeats itself (copying methods find drafts), as long as ar_vs_roofline's: the
  # autoregressive program compiled there is used again.
  half = prompts(1, target.config.vocab_size, run.prompt_len // 2, run.prompt_len // 2 + 1, seed=5)
  ids = [half[0] * 2]
  taus = cpu_tau()
  rows, ar_step = [], None
  for name in ["autoregressive"] + [m for m in run.methods if m != "autoregressive"]:
    row = {"method": name}
    if run.over():
      rows.append(dict(row, status=SKIPPED))
      continue
    try:
      method = exactness.build_method(name, target)
      out, wall = timed_generate(target, ids, method, run.new, run.reps)
      rounds = out.stats["steps"]
      row.update(status="ok", ms_per_round=round(1000 * wall / rounds, 3),
                 rounds=rounds, compile_s=round(out.stats["compile_time_s"], 1),
                 tau_random=round(out.stats["mean_accepted"], 2),
                 tau_cpu=taus.get(name), settings=repr(method))
      if name == "autoregressive":
        ar_step = wall / rounds
      if ar_step:
        row["round_in_ar_steps"] = round(wall / rounds / ar_step, 3)
        if row["tau_cpu"]:
          row["speedup_if_tau_cpu"] = round(row["tau_cpu"] / row["round_in_ar_steps"], 2)
    except Exception as e:  # noqa: BLE001
      row.update(status="ERROR", **error(e))
    rows.append(row)
    print(f"  methods {name:15s} {row['status']}", flush=True)
  return {"target": f"{shape} shape, random bf16 weights", "batch": 1,
          "prompt_tokens": len(ids[0]), "new_tokens": run.new,
          "tau_cpu_source": os.path.relpath(SPEC_BENCH, ROOT) + " (CPU, shipped drafters, the "
          "settings chosen there: not these settings)", "rows": rows}


# ----------------------------------------------------------------------------- report


def render(res: dict) -> str:
  dev = res.get("device", {})
  lines = [f"# Accelerator check{' (--quick)' if res.get('quick') else ''}", "",
           f"{dev.get('device_kind', '?')} ({dev.get('platform', '?')}), "
           f"jax {dev.get('jax', '?')}, "
           f"torch {dev.get('torch', '-')} (CUDA: {dev.get('torch_cuda', '-')}); "
           + (f"{res.get('run_s', '?')} s." if not res.get("runs") else "merged runs below."),
           ""]
  if res.get("runs"):
    lines += ["Merged from these runs (`--merge`; the first run's entry that ran wins):", ""]
    lines += [f"- `{r.get('command')}` ({r.get('run_s')} s)" for r in res["runs"]] + [""]
  if res.get("note"):
    lines += [res["note"], ""]
  ll = res.get("lossless")
  if isinstance(ll, dict) and "rows" in ll:
    lines += ["## lossless", "", f"{ll['target']}; batch {ll['batch']}, {ll['new_tokens']} new "
              "tokens; float32 at precision highest and bf16, tie-aware criterion "
              "(specjax/exactness.py).", ""]
    lines.append(bench.markdown_table(ll["rows"], [
        ("method", "method", "s"), ("dtype", "dtype", "s"), ("status", "status", "s"),
        ("identical", "identical", ""), ("ties", "ties", "d"), ("failures", "failures", "d"),
        ("tau", "tau", ".2f"), ("seconds", "s", ".1f")]))
    lines.append("")
  cc = res.get("cost_curve")
  if cc:
    sizes = sorted({int(t) for v in cc.values() if isinstance(v, dict)
                    for t in v.get("c", {})})
    rows = [dict({"shape": s, "status": v.get("status")},
                 **{str(t): v.get("c", {}).get(t, v.get("c", {}).get(str(t))) for t in sizes},
                 ms1=v.get("ms", {}).get(1, v.get("ms", {}).get("1")))
            for s, v in cc.items()]
    lines += ["## cost_curve", "", "c(T) = T-token forward / 1-token forward, bf16, batch 1, "
              "cache 256 filled.", ""]
    lines.append(bench.markdown_table(rows, [("shape", "shape", "s"), ("status", "status", "s"),
                                             ("ms1", "ms (T=1)", ".3f")]
                                      + [(str(t), f"c({t})", ".2f") for t in sizes]))
    lines.append("")
  rf = res.get("ar_vs_roofline")
  if rf:
    rows = [dict(v, shape=s) for s, v in rf.items() if isinstance(v, dict)]
    lines += ["## ar_vs_roofline", "", f"copy bandwidth {rf.get('copy_bandwidth_gbs')} GB/s; "
              "autoregressive bf16, batch 1, prefill included.", ""]
    lines.append(bench.markdown_table(rows, [
        ("shape", "shape", "s"), ("status", "status", "s"), ("tokens_per_s", "tok/s", ".1f"),
        ("roofline_tokens_per_s", "roofline tok/s", ".1f"),
        ("fraction_of_roofline", "of roofline", ".2f"),
        ("fraction_of_static_roofline", "of static-cache roofline", ".2f")]))
    lines.append("")
  pr = res.get("profile")
  if pr:
    lines += profile_markdown(pr)
  tf = res.get("ar_vs_transformers")
  if tf:
    rows = [dict(v, shape=s) for s, v in tf.items()]
    lines += ["## ar_vs_transformers", ""]
    lines.append(bench.markdown_table(rows, [
        ("shape", "shape", "s"), ("status", "status", "s"),
        ("specjax_tokens_per_s", "specjax tok/s", ".1f"),
        ("transformers_tokens_per_s", "transformers tok/s", ".1f"), ("speedup", "speedup", ".2f"),
        ("agreeing_prefix", "same tokens (prefix share)", ".2f")]))
    lines.append("")
  me = res.get("methods")
  if isinstance(me, dict) and "rows" in me:
    lines += ["## methods", "", f"{me['target']}; batch 1, {me['new_tokens']} new tokens. "
              f"tau_cpu: {me['tau_cpu_source']}.", ""]
    lines.append(bench.markdown_table(me["rows"], [
        ("method", "method", "s"), ("status", "status", "s"), ("ms_per_round", "ms/round", ".2f"),
        ("round_in_ar_steps", "round / AR step", ".2f"), ("tau_random", "tau (random)", ".2f"),
        ("tau_cpu", "tau (CPU)", ".2f"), ("speedup_if_tau_cpu", "speedup at CPU tau", ".2f")]))
    lines.append("")
  errors = [f"- {sec}: {k}: {v.get('error')}" for sec in SECTIONS
            for k, v in _entries(res.get(sec)) if isinstance(v, dict) and v.get("error")]
  if errors:
    lines += ["## errors", ""] + errors
  return "\n".join(lines)


def profile_markdown(pr: dict) -> list[str]:
  rows = [dict(v, shape=s) for s, v in pr.items() if isinstance(v, dict)]
  out = ["## profile", "", "One autoregressive generation under jax's profiler (bf16, batch 1, "
         "the ar_vs_roofline prompt and length): kernel time per token against wall time per "
         "token (both under the profiler).", ""]
  out.append(bench.markdown_table(rows, [
      ("shape", "shape", "s"), ("status", "status", "s"),
      ("wall_ms_per_token", "wall ms/token", ".3f"),
      ("kernel_ms_per_token", "kernel ms/token", ".3f"), ("busy_fraction", "busy", ".2f"),
      ("kernels_per_token", "kernels/token", ".1f")]))
  out.append("")
  for r in rows:
    if r.get("top"):
      out += [f"{r['shape']}: the kernels with the most time", ""]
      out.append(bench.markdown_table(r["top"], [
          ("kernel", "kernel", "s"), ("ms_per_token", "ms/token", ".4f"),
          ("per_token", "runs/token", ".2f"), ("mean_us", "mean us", ".1f")]))
      out.append("")
  return out


def _entries(sec):
  if not isinstance(sec, dict):
    return []
  if "rows" in sec:
    return [(f"{r.get('method')} {r.get('dtype', '')}".strip(), r) for r in sec["rows"]]
  return list(sec.items())


def _ok(entry) -> bool:
  return isinstance(entry, dict) and entry.get("status") == "ok"


def merge(parts: list[dict], note: str | None = None) -> dict:
  """One result from several runs of this check (two processes side by side on one device, or a
  rerun of what a time budget skipped): per section, per shape, per (method, dtype) row, the first
  run's entry that ran ("ok") wins, else the first run's entry; `runs` keeps every run's command,
  length and device."""
  out = {"quick": any(p.get("quick") for p in parts),
         "runs": [{"command": p.get("command"), "run_s": p.get("run_s"),
                   "device": (p.get("device") or {}).get("device_kind")} for p in parts]}
  if note:
    out["note"] = note
  for sec in SECTIONS:
    have = [p[sec] for p in parts if isinstance(p.get(sec), dict)]
    if not have:
      continue
    if sec == "device":
      out[sec] = have[0]
    elif any("rows" in h for h in have):
      base = next(h for h in have if "rows" in h)
      rows: dict = {}
      for h in have:
        for r in h.get("rows", []):
          key = (r.get("method"), r.get("dtype"))
          if key not in rows or (not _ok(rows[key]) and _ok(r)):
            rows[key] = r
      merged = dict(base, rows=list(rows.values()))
      if "all_ok" in base:
        merged["all_ok"] = all(_ok(r) and r.get("failures", 0) == 0 for r in rows.values())
      out[sec] = merged
    else:
      merged = {}
      for h in have:
        for k, v in h.items():
          if k not in merged or (isinstance(v, dict) and not _ok(merged[k]) and _ok(v)):
            merged[k] = v
      out[sec] = merged
  return out


# ----------------------------------------------------------------------------- main


def quick_compiles() -> None:
  """--quick on a CPU: XLA's CPU backend at optimization level 1 with LLVM's expensive passes off,
  as the test suite runs (tests/conftest.py): compiling the tiny programs is nearly all of a
  quick run's time, and these flags halve it here; their timings mean nothing either way. Set
  before jax starts its backend (in a process where it has started, they change nothing); flags
  the caller set win."""
  flags = os.environ.get("XLA_FLAGS", "")
  for flag in ("--xla_backend_optimization_level=1", "--xla_llvm_disable_expensive_passes=true",
               "--xla_cpu_use_fusion_emitters=false"):
    if flag.split("=")[0] not in flags:
      flags = f"{flags} {flag}".strip()
  os.environ["XLA_FLAGS"] = flags



def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="tiny sizes, a few methods: a CPU run")
  ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
  ap.add_argument("--sections", default=",".join(SECTIONS))
  ap.add_argument("--shapes", default=None, help=f"default {','.join(SHAPES)}")
  ap.add_argument("--methods", default=None,
                  help="registered names (default every one; --quick: prompt-lookup)")
  ap.add_argument("--sizes", default=None,
                  help=f"cost curve T values (default {','.join(map(str, SIZES))}; quick "
                  f"{','.join(map(str, QUICK_SIZES))})")
  ap.add_argument("--new", type=int, default=None,
                  help="new tokens per row (default 128; quick 16)")
  ap.add_argument("--reps", type=int, default=None,
                  help="timed runs, best kept (default 3; quick 1)")
  ap.add_argument("--budget", type=float, default=None,
                  help="seconds; past them remaining work is skipped (default 450; quick: none)")
  ap.add_argument("--merge", nargs="+", metavar="RESULTS_JSON",
                  help="write one results.json / results.md into --out from these runs' files "
                  "(first ok entry wins) and run nothing")
  ap.add_argument("--note", help="with --merge: how the runs were made, kept in the result")
  args = ap.parse_args(argv)
  if args.merge:
    parts = []
    for path in args.merge:
      try:
        with open(path) as f:
          parts.append(json.load(f))
      except (OSError, ValueError) as e:
        ap.error(f"--merge: cannot read {path}: {e}")
    merged = merge(parts, note=args.note)
    bench.save_report(args.out, "results_quick" if merged["quick"] else "results", merged,
                      render(merged))
    print(render(merged))
    return merged
  if args.quick:
    quick_compiles()
  sections = [s for s in args.sections.split(",") if s]
  if bad := [s for s in sections if s not in SECTIONS]:
    ap.error(f"--sections: unknown {', '.join(bad)}; choose from {', '.join(SECTIONS)}")
  table = QUICK_SHAPES if args.quick else SHAPES
  shapes = args.shapes.split(",") if args.shapes else list(table)
  if bad := [s for s in shapes if s not in table]:
    ap.error(f"--shapes: unknown {', '.join(bad)}; choose from {', '.join(table)}")
  names = [registry.canonical(m) or m for m in (args.methods or (
      "autoregressive,prompt-lookup" if args.quick else ",".join(registry.names()))).split(",")]
  if bad := [m for m in names if m not in registry.REGISTRY]:
    ap.error(f"--methods: unknown {', '.join(bad)}; registered: {', '.join(registry.names())}")
  names = ["autoregressive"] + [m for m in names if m != "autoregressive"]
  try:
    sizes = tuple(sorted({1, *(int(t) for t in args.sizes.split(","))})) if args.sizes else \
        (QUICK_SIZES if args.quick else SIZES)
  except ValueError:
    ap.error(f"--sizes: {args.sizes!r} is not a comma-separated list of integers")
  if min(sizes) < 1:
    ap.error(f"--sizes: {args.sizes!r}: every T must be >= 1")
  budget = args.budget if args.budget is not None else (None if args.quick else 450.0)
  t_start = time.time()
  run = Run(quick=args.quick, out=args.out, shapes={s: table[s] for s in shapes},
            sizes=sizes, methods=names,
            new=args.new or (16 if args.quick else 128), reps=args.reps or (1 if args.quick else 3),
            deadline=t_start + budget if budget else None,
            results={"quick": args.quick, "command": bench.command_line(argv and
                                                                        [__file__, *argv])})
  per_shape = [s for s in SECTIONS if s in sections and s.startswith(("cost", "ar_", "profile"))]
  for sec in [s for s in SECTIONS if s in sections]:
    if sec in per_shape:
      if sec == per_shape[0]:
        print(f"[{time.time() - t_start:6.1f} s] {', '.join(per_shape)}", flush=True)
        shape_sections(run, per_shape)
      continue
    print(f"[{time.time() - t_start:6.1f} s] {sec}", flush=True)
    fn = {"device": section_device, "lossless": section_lossless, "methods": section_methods}[sec]
    try:
      run.results[sec] = fn(run) if not run.over() else {"status": SKIPPED}
    except Exception as e:  # noqa: BLE001
      run.results[sec] = {"status": "ERROR", **error(e)}
    run.results["run_s"] = round(time.time() - t_start, 1)
    run.save()
  run.results["run_s"] = round(time.time() - t_start, 1)
  run.save()
  print(render(run.results))
  return run.results


if __name__ == "__main__":
  main()
