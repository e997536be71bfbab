"""The device's cost curve c(T), measured once per device, model and software, and kept on disk.

c(T) = the time of one T-token forward of the target / the time of a one-token forward: batch 1,
a cache of 512 slots with 256 filled, the jitted `model.apply`, medians of interleaved runs (every
size once per round, so a load that comes and goes on a shared machine touches all sizes alike),
made non-decreasing in T (`envelope`: a median that a disturbance pushed above a larger size's
is lowered to it, so one slow one-token sample cannot shrink the whole curve). On a CPU, a timing
during which other processes kept more than QUIET of this process's CPUs busy (Linux's /proc:
`others_share`) is taken again, up to TRIES times; the least disturbed is used, and kept on disk
only if it was quiet, so a curve measured beside a training run or a test suite never chooses
the settings of the runs after it.
It is what the methods' default settings are chosen from (specjax/methods/defaults.py: a bigger
tree or a longer chain pays c(N + 1) per step) and what `method="auto"` predicts with.

    calibrate.cost_curve(model)    # {1: 1.0, 2: 1.5, 4: 1.7, ...}: measured once, then read
    calibrate.calibration(model)   # the whole record: curve, seconds, source, path, key
    calibrate.measure_cost_ratio(target, sj.DraftModel(draft))   # a drafting method's c, timed

The record is a JSON file under the user cache (`$SPECJAX_CACHE`, else `~/.cache/specjax`, folder
`calibration/`), named by a hash of its key: the device kind and platform, the model's name and a
hash of its config, its dtype, the processor on a CPU (vendor, family, model: the machines this
project runs on change from day to day), the jax and jaxlib versions, whether the model runs on the
CPU kernel (specjax.packing.on_kernel) and then the kernel's build key, ISA and threads (and the
decode attention kernel's build key), and the measurement's own settings. A record is read back
only when its stored key equals the one computed now, so any change (a new jaxlib, bfloat16
weights, the kernel switched off) measures afresh. Files are written under a temporary name and
renamed into place; a file that cannot be read or parsed is measured again, never an error. Under
jax.distributed process 0 reads, measures and writes for all (specjax.distributed), so every
process chooses the same sizes.

Switches (`SPECJAX_CALIBRATION`): "0" / "off" / "false" / "no": nothing is measured or read, the
curve is DEFAULT_CURVE; "quick": fewer sizes and rounds (QUICK_SIZES, 3 rounds: tests); anything
else (or unset): the full measurement (SIZES, 7 rounds).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx
from tqdm import tqdm

from specjax import cache as kv
from specjax import compile_options
from specjax import distributed
from specjax import packing
from specjax.decode import Program
from specjax.kernels import build

ENV = "SPECJAX_CALIBRATION"
OFF = ("0", "off", "false", "no")
SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
QUICK_SIZES = (1, 2, 4, 8, 16)
REPS, QUICK_REPS = 7, 3
CACHE_LEN, FILLED = 512, 256
FORMAT = 5  # 2: the curve from the envelope of the seconds; 3: inputs traced, not constants;
# 4: LOOP forwards per call; 5: the CPU's identity in the key
LOOP = 4  # forwards per timed call (forward_probe's loop)
# A measurement while other processes kept more than QUIET of this process's CPUs busy is timed
# again, at most TRIES times; the least disturbed is used, and kept on disk only if it was quiet.
QUIET, TRIES = 0.1, 3

# The curve used when calibration is switched off: SmolLM2-135M in float32 with the CPU kernel on
# the 2-core CPU this project benchmarks on, the mean of two quiet runs (docs/performance.md,
# 2026-11-22 12:55); past 16 tokens interpolate_cost extends the last segment's slope. Another
# device's curve differs (a GPU's is far flatter): measure it.
DEFAULT_CURVE = {1: 1.0, 2: 1.07, 4: 1.135, 8: 1.505, 16: 2.33}


def mode() -> str:
  """"off", "quick" or "full", from SPECJAX_CALIBRATION."""
  v = os.environ.get(ENV, "").strip().lower()
  return "off" if v in OFF else "quick" if v == "quick" else "full"


def folder() -> str:
  return build.user_cache("calibration")


def forward_probe(model, t: int, *, cache_len: int = CACHE_LEN, filled: int = FILLED,
                  loop: int = 1):
  """(f, args): f(params, *args) runs `loop` T-token forwards one after the other (model.apply,
  batch 1, a cache of `cache_len` slots with `filled` entries) -> the last one's logits [1,T,V],
  jitted, compiled and run once.

  The cache, tokens, positions and mask are arguments of the compiled function, as they are in
  decoding. As constants, XLA would fold the model's rope guard (`model._once`: its predicate reads
  the positions) and evaluate cos and sin inside every layer's rotation, which decoding never
  does, so the probe would time a forward that decoding does not run.

  loop > 1: the forwards run inside one compiled loop, as a decoding step's forward runs inside
  the decoding loop, so one call's dispatch (the parameters' ~300 arrays passed from Python,
  about 1 ms) is shared by `loop` forwards instead of inflating the one-token forward and so
  deflating every c(T). Each forward's tokens depend on the last one's logits (a NaN test that
  never holds), so none can be hoisted or skipped."""
  cache = kv.rollback(model.init_cache(1, cache_len), jnp.array([filled]))
  toks = jnp.zeros((1, t), jnp.int32)
  pos = filled + jnp.arange(t, dtype=jnp.int32)[None]
  mask = kv.causal_mask(cache.lengths, t, cache_len)

  def run(p, c, toks, pos, mask):
    first = model.apply(p, toks, pos, c, mask)[0]

    def again(_, logits):
      nxt = toks + jnp.isnan(logits[0, 0, 0]).astype(toks.dtype)
      return model.apply(p, nxt, pos, c, mask)[0]

    return first if loop == 1 else jax.lax.fori_loop(1, loop, again, first)

  f = jax.jit(run, compiler_options=compile_options.options())  # as decoding
  args = (cache, toks, pos, mask)
  jax.block_until_ready(f(model.params, *args))
  return f, args


def measure_seconds(model, sizes=SIZES, *, cache_len: int = CACHE_LEN, filled: int = FILLED,
                    reps: int = REPS, loop: int = LOOP) -> dict[int, float]:
  """{T: median seconds of one T-token forward}: `loop` forwards per call (forward_probe,
  compiled and run once per T before timing), then `reps` rounds that each time every size
  once. On a terminal a progress bar on stderr counts the compiles and the rounds (tqdm: silent
  elsewhere)."""
  return _time_probes(model, _probes(model, sizes, cache_len, filled, loop), reps, loop)


def measure_seconds_quietly(model, sizes=SIZES, *, cache_len: int = CACHE_LEN,
                            filled: int = FILLED, reps: int = REPS, loop: int = LOOP,
                            tries: int = TRIES, quiet: float = QUIET) -> dict:
  """measure_seconds, timed again (the programs compiled once) while other processes used more
  than `quiet` of the CPUs this one may run on (`others_share`), at most `tries` times:
  {"seconds" (the least disturbed timing), "others_share" (its share; None where /proc cannot be
  read), "tries"}. Only where the model runs on the CPU: a GPU's forward does not share the
  host's cores."""
  fns = _probes(model, sizes, cache_len, filled, loop)
  if not packing.on_cpu_devices(model):
    tries = 1
  best = None
  for n in range(1, tries + 1):
    before = cpu_use()
    secs = _time_probes(model, fns, reps, loop)
    share = others_share(before, cpu_use())
    if best is None or (share is not None and share < best["others_share"]):
      best = {"seconds": secs, "others_share": share}
    if share is None or share <= quiet:
      break
  return dict(best, tries=n)


def _probes(model, sizes, cache_len, filled, loop) -> dict:
  sizes = sorted(set([1, *sizes]))
  with tqdm(total=len(sizes), desc="cost curve: compiling", unit="size", file=sys.stderr,
            disable=None, leave=False) as bar:
    fns = {}
    for t in sizes:
      fns[t] = forward_probe(model, t, cache_len=cache_len, filled=filled, loop=loop)
      bar.update()
  return fns


def _time_probes(model, fns, reps, loop) -> dict[int, float]:
  times = {t: [] for t in fns}
  for _ in tqdm(range(reps), desc="cost curve: timing", unit="round", file=sys.stderr,
                disable=None, leave=False):
    for t, (f, args) in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(f(model.params, *args))
      times[t].append((time.perf_counter() - t0) / loop)
  return {t: float(statistics.median(v)) for t, v in times.items()}


def cpu_use() -> tuple[float, float, float, int] | None:
  """(now, busy seconds of the CPUs this process may run on, CPU seconds this process has used,
  how many CPUs those are), from Linux's /proc/stat and /proc/self/stat; steal (time a hypervisor
  gave another guest) counts as busy. None where they cannot be read."""
  try:
    cpus = os.sched_getaffinity(0)
    tick = os.sysconf("SC_CLK_TCK")
    busy = 0
    with open("/proc/stat") as f:
      for line in f:
        name, *vals = line.split()
        if name[:3] == "cpu" and name[3:].isdigit() and int(name[3:]) in cpus:
          user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, vals[:8])
          busy += user + nice + system + irq + softirq + steal
    with open("/proc/self/stat") as f:
      after_name = f.read().rsplit(")", 1)[1].split()
    mine = int(after_name[11]) + int(after_name[12])  # utime, stime: fields 14 and 15
    return time.monotonic(), busy / tick, mine / tick, len(cpus)
  except (OSError, ValueError, IndexError, AttributeError):
    return None


def others_share(before, after) -> float | None:
  """Between two cpu_use() readings: the share of this process's CPUs that everything else kept
  busy (other processes, the hypervisor's other guests); None if either reading is None."""
  if before is None or after is None or after[0] <= before[0]:
    return None
  others = (after[1] - before[1]) - (after[2] - before[2])
  return round(max(0.0, others / ((after[0] - before[0]) * before[3])), 3)


def envelope(secs: dict[int, float]) -> dict[int, float]:
  """{T: min over T' >= T of secs[T']}: the seconds made non-decreasing in T. A forward over more
  tokens does not cost less; where a median says so, the smaller size's was disturbed."""
  out, low = {}, float("inf")
  for t in sorted(secs, reverse=True):
    low = min(low, secs[t])
    out[t] = low
  return dict(sorted(out.items()))


def curve_of(secs: dict[int, float]) -> dict[int, float]:
  """c(T) = envelope(secs)[T] / envelope(secs)[1]."""
  env = envelope(secs)
  return {t: s / env[1] for t, s in env.items()}


def measure(model, sizes=SIZES, *, cache_len: int = CACHE_LEN, filled: int = FILLED,
            reps: int = REPS) -> dict[int, float]:
  """c(T) as measured now (no cache): `curve_of` the medians."""
  return curve_of(measure_seconds(model, sizes, cache_len=cache_len, filled=filled, reps=reps))


def cache_key(model, quick: bool = False) -> dict:
  """Everything a measured curve depends on (see the module docstring)."""
  import jaxlib

  from specjax import kernels
  from specjax.kernels import attention

  dev = jax.devices()[0]
  config = json.dumps(dataclasses.asdict(model.config), sort_keys=True, default=str)
  on = packing.on_kernel(model)
  return {
      "format": FORMAT, "device": dev.device_kind, "platform": dev.platform,
      # a CPU device's kind is "cpu" whatever the processor; the machines this runs on change
      "cpu": cpu_identity() if dev.platform == "cpu" else None,
      "model": model.name, "config": hashlib.sha256(config.encode()).hexdigest()[:16],
      "dtype": jnp.dtype(model.dtype).name, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
      "kernel": {"build": build.build_key(), "isa": kernels.isa(), "threads": kernels.threads(),
                 "attention": build.build_key("attention") if attention.available() else None}
      if on else None,
      # weights="blocks" multiplies by the GGUF's blocks (another kernel, another curve)
      "weights": getattr(model, "weights", "float32"),
      "blocks_build": build.build_key("blocks") if getattr(model, "weights", "") == "blocks"
      else None,
      # activations="int8" multiplies by the integer-dot kernel (and XLA's integer dot)
      "activations": getattr(model, "activations", "float32"),
      "qdot_build": build.build_key("qdot") if getattr(model, "activations", "") == "int8"
      else None,
      "sizes": list(QUICK_SIZES if quick else SIZES), "reps": QUICK_REPS if quick else REPS,
      "cache_len": CACHE_LEN, "filled": FILLED,
  }


def cpu_identity() -> str:
  """The processor as Linux's /proc/cpuinfo names it (vendor, family, model, model name: a VM's
  model name alone can be as vague as "AMD EPYC"); "" where it cannot be read."""
  fields = {}
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        name, _, value = line.partition(":")
        name = name.strip()
        if name in ("vendor_id", "cpu family", "model", "model name") and name not in fields:
          fields[name] = value.strip()
        if not line.strip() and fields:  # the first processor's block is enough
          break
  except OSError:
    return ""
  return " / ".join(fields.get(k, "?") for k in ("vendor_id", "cpu family", "model", "model name"))


def path_for(key: dict) -> str:
  digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
  return os.path.join(folder(), f"{key['model'] or 'model'}-{digest}.json".replace(os.sep, "_"))


def read(path: str, key: dict) -> dict | None:
  """The record at path if it is whole and was measured under `key`; None otherwise."""
  try:
    with open(path) as f:
      rec = json.load(f)
    curve = {int(t): float(c) for t, c in rec["curve"].items()}
  except (OSError, ValueError, KeyError, TypeError, AttributeError):
    return None
  if rec.get("key") != key or curve.get(1) != 1.0 or not all(c > 0 for c in curve.values()):
    return None
  return dict(rec, curve=curve)


def write(path: str, record: dict) -> None:
  """Writes record as JSON under a temporary name in the same folder, then renames it into place
  (a reader sees the old file or the new one, never half of one); by process 0 only, the others
  waiting until it is there (distributed.write_once)."""

  def dump(tmp):
    with open(tmp, "w") as f:
      json.dump(record, f, indent=1, sort_keys=True)

  distributed.write_once(path, dump, "calibration")


def calibration(model) -> dict:
  """The cost curve of `model` on this device: {"curve": {T: c(T)}, "source": "cache" | "measured"
  | "default", "path", "key", and "seconds" {T: s} when measured}. Measures (and writes) only when
  no record with this key is on disk; SPECJAX_CALIBRATION=0 returns DEFAULT_CURVE untouched."""
  m = mode()
  if m == "off":
    return {"curve": dict(DEFAULT_CURVE), "source": "default", "path": None, "key": None}
  quick = m == "quick"
  key = cache_key(model, quick)
  path = path_for(key)
  # Many processes: process 0's record and process 0's seconds, so every process picks the same
  # sizes and compiles the same program (all measure: a sharded model's forward needs them all).
  rec = distributed.from_writer(lambda: read(path, key), "calibration read")
  if rec is not None:
    return dict(rec, curve=_ints(rec["curve"]), source="cache", path=path)
  if distributed.is_writer():
    print(f"specjax: measuring the cost curve of {model.name or 'the model'} on {key['device']} "
          f"once (kept in {folder()}; {ENV}=0 uses a default curve)", file=sys.stderr, flush=True)
  # Many processes time once (every process must run the same programs); so does "quick".
  alone = jax.process_count() == 1 and not quick
  got = measure_seconds_quietly(model, key["sizes"], cache_len=CACHE_LEN, filled=FILLED,
                                reps=key["reps"], tries=TRIES if alone else 1)
  secs = _ints(distributed.from_writer(lambda: got["seconds"], "calibration seconds"))
  rec = {"key": key, "curve": curve_of(secs), "seconds": secs, "measured_at": time.time(),
         "others_share": got["others_share"], "tries": got["tries"]}
  share = got["others_share"]
  if alone and share is not None and share > QUIET:
    # A curve timed beside other work would choose every later run's settings: use it now, keep
    # none, and measure again on the next start.
    print(f"specjax: other processes kept {share:.0%} of this process's CPUs busy in all "
          f"{got['tries']} timings of the cost curve; using the least disturbed now, not keeping "
          f"it (measured again next time)", file=sys.stderr, flush=True)
    return dict(rec, source="measured", path=None)
  try:
    write(path, rec)
  except (OSError, distributed.DistributedError):  # a read-only cache folder: measure next time
    pass
  return dict(rec, source="measured", path=path)


def _ints(d: dict) -> dict:
  """{T: x} with T an int again (JSON, which carries a value between processes, makes it a str)."""
  return {int(t): x for t, x in d.items()}


def cost_curve(model) -> dict[int, float]:
  """{T: c(T)} for `model` on this device (see `calibration`)."""
  return calibration(model)["curve"]


# ----------------------------------------------------------------------------- a method's c


def measure_cost_ratio(target, method, *, batch: int = 1, cache_len: int = 512, reps: int = 20):
  """c = (one draft forward of one token) / (one target decode step), timed on this device, for a
  drafting method with a draft forward (specjax.methods.draft: DraftModel, SelfSpeculative,
  QuantizedDraft). A parallel draft (ParallelDraft, PARD) drafts a round in one forward over its
  window (gamma + 1 committed tokens, gamma - 1 masks): c is that forward's cost, once a round.

  Also returns the verification cost (gamma + 1 tokens) relative to one decode step, and for a
  method whose verification width varies (adaptive / threshold) the cost of every width 2 ..
  gamma + 1 as `verify_by_width` {width: cost / step}.
  """
  b, s = batch, cache_len
  lengths = jnp.full((b,), s // 2, jnp.int32)
  target_fn = _target_step(target, lengths, s)
  prog = Program(target.graphdef, target.config, method, s)
  arrays = method.arrays(target)
  dcache = method.timing_cache(target, b, s)
  parallel = hasattr(method, "block_logits")  # a round's whole chain from one forward

  def draft_fn(params, arrays, cache, toks):
    if parallel:
      seq = jnp.zeros((b, s), jnp.int32)
      return method.block_logits(arrays, cache, seq, lengths)
    return method._draft_forward(prog, params, arrays, cache, toks, lengths)

  def timed(fn, *args):
    f = jax.jit(fn)
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    for _ in range(reps):
      out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps

  cache = target.init_cache(b, s)
  t_step = timed(target_fn, target.params, cache, jnp.zeros((b, 1), jnp.int32))
  t_verify = timed(target_fn, target.params, cache, jnp.zeros((b, method.gamma + 1), jnp.int32))
  t_draft = timed(draft_fn, target.params, arrays, dcache, jnp.zeros((b, 1), jnp.int32))
  out = {"c": t_draft / t_step, "verify_over_step": t_verify / t_step,
         "draft": "one forward a round" if parallel else "one a token",
         "target_step_ms": 1e3 * t_step, "draft_step_ms": 1e3 * t_draft}
  if method.variable_width:
    out["verify_by_width"] = {w: timed(target_fn, target.params, cache,
                                       jnp.zeros((b, w), jnp.int32)) / t_step
                              for w in range(2, method.gamma + 1)}
    out["verify_by_width"][method.gamma + 1] = t_verify / t_step
  return out


def _target_step(target, lengths, s: int):
  """(params, cache, toks [B,T]) -> (logits, cache): one target forward of T tokens after
  `lengths` [B] committed ones, in a cache of s slots."""
  cfg = target.config

  def target_fn(params, cache, toks):
    cache = kv.rollback(cache, lengths)
    t = toks.shape[1]
    pos = lengths[:, None] + jnp.arange(t)[None, :]
    mask = kv.causal_mask(lengths, t, s, cfg.sliding_window)
    logits, _, cache = nnx.merge(target.graphdef, params)(tokens=toks, positions=pos, cache=cache,
                                                          mask=mask)
    return logits, cache

  return target_fn
