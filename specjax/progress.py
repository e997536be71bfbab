"""Progress lines for the CLI's long steps (loading, compiling, the demo's first runs) and the
demo's on-disk compile cache.

    with progress.timed_step("loading smollm2-135m") as step: ...   # a spinner, then the time
    progress.warm_methods(model, methods, prompt, max_new_tokens=64)   # compile each, one line each
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

SPINNER = "|/-\\"


@contextlib.contextmanager
def timed_step(label: str, stream=None, tty: bool | None = None):
  """Shows that `label` is running and, when it ends, how long it took. A compile prints nothing
  for 10-60 s, so on a terminal a spinner and the seconds so far tick on one line; elsewhere (a
  log, CI) a plain line goes out before the step and one after. Yields a dict: a "note" set in
  it is printed after the time. Errors propagate (the step's line says it failed)."""
  stream = sys.stdout if stream is None else stream
  tty = stream.isatty() if tty is None else tty
  t0, step, done = time.perf_counter(), {}, threading.Event()

  def spin():
    i = 0
    while not done.wait(0.2 if i else 0):
      stream.write(f"\r{SPINNER[i % len(SPINNER)]} {label} {time.perf_counter() - t0:5.1f} s")
      stream.flush()
      i += 1

  ticker = threading.Thread(target=spin, daemon=True) if tty else None
  if ticker:
    ticker.start()
  else:
    print(f"{label} ...", file=stream, flush=True)
  ok = False
  try:
    yield step
    ok = True
  finally:
    done.set()
    if ticker:
      ticker.join()
    note = f"; {step['note']}" if ok and step.get("note") else ("" if ok else "; failed")
    end = "\r\x1b[K" if tty else ""
    print(f"{end}{label}: {time.perf_counter() - t0:.1f} s{note}", file=stream, flush=True)


def use_compile_cache() -> str:
  """Keeps compiled programs on disk ($SPECJAX_CACHE/jax, default ~/.cache/specjax/jax), so a
  second `specjax demo` loads its programs instead of compiling each method again (10-20 s
  each here). A cache the user chose (JAX_COMPILATION_CACHE_DIR) wins. Returns the folder."""
  import jax

  from specjax.kernels.build import user_cache

  folder = os.environ.get("JAX_COMPILATION_CACHE_DIR") or user_cache("jax")
  jax.config.update("jax_compilation_cache_dir", folder)
  return folder


def warm_methods(model, methods: dict, prompt, *, max_new_tokens: int, stream=None,
                 baseline: str = "autoregressive") -> dict:
  """Compiles and runs each method once on `prompt` (greedy, chat template), with a progress line
  per method (`timed_step`): the demo's first phase, so that the timing after it runs compiled
  programs only. Returns name -> {"text", "tau", "identical" (tokens equal `baseline`'s, which
  runs first), "seconds", "compile_s"}."""
  import specjax as sj

  names = [baseline] + [n for n in methods if n != baseline]
  out, ref = {}, None
  for i, name in enumerate(names):
    with timed_step(f"[{i + 1}/{len(names)}] {name}", stream) as step:
      t0 = time.perf_counter()
      o = sj.generate(model, [prompt], methods[name], max_new_tokens=max_new_tokens, chat=True)
      ref = o.tokens if ref is None else ref
      r = {"text": o.texts[0], "tau": o.stats["mean_accepted"], "identical": o.tokens == ref,
           "seconds": time.perf_counter() - t0, "compile_s": o.stats["compile_time_s"]}
      same = "the reference" if name == baseline else (
          "identical to " + baseline if r["identical"] else "DIFFERS from " + baseline)
      step["note"] = f"compile {r['compile_s']:.1f} s; {same}; tau {r['tau']:.2f}"
    out[name] = r
  return out
