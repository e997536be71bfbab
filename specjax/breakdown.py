"""Where a method's time goes: draft / verify / accept-and-bookkeeping per round, measured inside
the compiled decode loop.

How. Every method marks its drafting with `decode.phase(decode.DRAFT)` and the target's forward
runs under `decode.phase(decode.VERIFY)` (`Program.forward`), so each operation of the compiled
program carries its phase in its op name. `breakdown` runs `generate` once to compile, then once
more under `jax.profiler.trace`; the profiler records one event per executed operation (a thunk
of XLA's CPU runtime, or a kernel on an accelerator) under the operation's name, which the
compiled program's text maps to its op name and so to its phase:

    draft     operations under DRAFT (a draft model's or heads' forwards, n-gram lookups; a
              layer-skip draft's target layers too, as they run inside DRAFT)
    verify    the target's forward (under VERIFY, not inside DRAFT)
    other     the rest of the loop body: acceptance, sampling, cache commits, emitting tokens
    prefill   operations outside the loop (the prompt's forward), reported apart

Per round = the phase's summed event time / the number of loop iterations. Events only count
time spent executing operations: the loop's own overhead between them is the gap between their
sum and the wall time, reported as `unattributed_ms`. On a CPU the two cores may run two
operations at once, so a sum can exceed the wall time by a little.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile

import jax

from specjax import api, decode, methods

PHASES = ("draft", "verify", "other")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*op_name=\"([^\"]*)\"")
_BODY = re.compile(r"body=%?([\w.\-]+)")
# Control flow: its event spans the operations inside it, which have events of their own.
_CONTAINER = re.compile(r"\s(while|conditional|call)\(")


def _phase(op_name: str) -> str:
  if decode.DRAFT in op_name:
    return "draft"
  if decode.VERIFY in op_name:
    return "verify"
  return "other"


def _computations(hlo: str) -> dict[str, list[str]]:
  """Compiled HLO text -> {computation name: its lines}."""
  comps, name = {}, None
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if head and not line.startswith(" "):
      name = head.group(1)
      comps[name] = []
    elif name is not None:
      comps[name].append(line)
  return comps


def phase_map(hlo: str) -> dict[str, str]:
  """Instruction name -> "draft" | "verify" | "other" (inside the decode loop) | "prefill"."""
  comps = _computations(hlo)
  bodies = {b for lines in comps.values() for line in lines for b in _BODY.findall(line)}
  in_loop: set[str] = set()
  todo = list(bodies)
  while todo:  # the loop bodies and every computation they call
    c = todo.pop()
    if c in in_loop or c not in comps:
      continue
    in_loop.add(c)
    for line in comps[c]:
      for group in re.findall(r"(?:calls|to_apply|body|condition|branch_computations)="
                              r"(\{[^}]*\}|%?[\w.\-]+)", line):
        todo += re.findall(r"%?([\w.\-]+)", group)
  out = {}
  for c, lines in comps.items():
    for line in lines:
      m = _INSTR.match(line)
      if m and not _CONTAINER.search(line.split("metadata=")[0]):
        out[m.group(1)] = _phase(m.group(2)) if c in in_loop else "prefill"
  return out


def _events(trace_dir: str) -> list[dict]:
  files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
  if not files:
    raise RuntimeError(f"jax.profiler wrote no trace under {trace_dir}")
  with gzip.open(files[0]) as f:
    return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def compiled_program(method):
  """(the Program, its compiled executable) of the last program generate compiled for
  `method`."""
  for key, compiled in reversed(list(decode.compile_cache.programs.items())):
    if key[0].method == method:
      return key[0], compiled
  raise RuntimeError(f"no compiled program for {method!r}")



def breakdown(model, prompts, method, **generate_kw) -> dict:
  """Per-round milliseconds and shares of draft / verify / other for `method` on `prompts`.

  Returns {"method", "rounds", "wall_ms", "per_round_ms": {phase: ms}, "share": {phase: 0..1},
  "prefill_ms", "unattributed_ms", "mean_accepted", "ops_per_round": {phase: count}}."""
  method = methods.resolve(method, model)
  api.generate(model, prompts, method, **generate_kw)  # compiles
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      out = api.generate(model, prompts, method, **generate_kw)
    events = _events(d)
  phases = phase_map(compiled_program(method)[1].as_text())
  time_us, count = collections.Counter(), collections.Counter()
  for e in events:
    p = phases.get(e["name"])
    if p is not None:
      time_us[p] += e["dur"]
      count[p] += 1
  rounds = max(1, out.stats["steps"] - 1)
  wall_ms = 1e3 * out.stats["wall_time_s"]
  per_round = {p: time_us[p] / 1e3 / rounds for p in PHASES}
  loop_ms = sum(per_round.values())
  return {"method": method.name, "rounds": rounds, "wall_ms": wall_ms,
          "per_round_ms": per_round,
          "share": {p: (per_round[p] / loop_ms if loop_ms else 0.0) for p in PHASES},
          "prefill_ms": time_us["prefill"] / 1e3,
          "unattributed_ms": wall_ms - loop_ms * rounds - time_us["prefill"] / 1e3,
          "mean_accepted": out.stats["mean_accepted"],
          "ops_per_round": {p: count[p] / rounds for p in PHASES}}
