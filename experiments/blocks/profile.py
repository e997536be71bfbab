"""Where a blocks decode step's time goes: one autoregressive generate under `jax.profiler`,
the loop body's executed operations grouped by kind and op name, in ms per token.

    .venv/bin/python experiments/blocks/profile.py [--weights blocks|float32] [--new 128]

One MT-Bench prompt (chat template), greedy, no EOS stop. It times three warm runs first (no
profiler: the profiler's per-event cost inflates the wall time under it), then profiles one. The
compiled program's text maps each executed operation to its op name (specjax.breakdown); the
sum of the operations' times against the wall time shows how much is outside any operation
(dispatch and the loop around ~800 small operations per token).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile

import jax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import specjax as sj  # noqa: E402
from specjax import bench  # noqa: E402
from specjax import breakdown as bd  # noqa: E402


def op_names(hlo: str) -> dict[str, tuple[str, str]]:
  """Instruction name -> (op name without digits, kind: fusion / custom-call target / ...)."""
  out = {}
  for line in hlo.splitlines():
    m = bd._INSTR.match(line)
    if m:
      kind = re.search(r"=\s*\S+\s+([\w\-]+)\(", line)
      target = re.search(r'custom_call_target="([^"]+)"', line)
      label = (kind.group(1) if kind else "?") + ("/" + target.group(1) if target else "")
      out[m.group(1)] = (re.sub(r"\d+", "#", m.group(2)), label)
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--weights", default="blocks", choices=("blocks", "float32"))
  ap.add_argument("--new", type=int, default=128)
  ap.add_argument("--top", type=int, default=12)
  a = ap.parse_args()
  model = sj.load_model("smollm2-135m", weights=a.weights)
  ps, chat = bench.load_prompt_set("mt_bench", 1)
  method, kw = sj.Autoregressive(), dict(max_new_tokens=a.new, chat=chat, stop_at_eos=False)
  sj.generate(model, list(ps)[:1], method, **kw)  # compiles
  walls = [sj.generate(model, list(ps)[:1], method, **kw).stats["wall_time_s"] for _ in range(3)]
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      sj.generate(model, list(ps)[:1], method, **kw)
    events = bd._events(d)
  hlo = bd.compiled_program(method)[1].as_text()
  names, phases = op_names(hlo), bd.phase_map(hlo)
  by_op, by_kind, count = collections.Counter(), collections.Counter(), collections.Counter()
  for e in events:
    if phases.get(e["name"]) in ("verify", "other"):  # inside the decode loop
      op, kind = names.get(e["name"], ("?", "?"))
      by_op[(op, kind)] += e["dur"]
      by_kind[kind] += e["dur"]
      count[(op, kind)] += 1
  n = a.new
  print(f"{a.weights}: {n} tokens, wall without the profiler {1e3 * min(walls) / n:.2f} ms per "
        f"token (best of 3; {n / min(walls):.1f} tok/s); inside the loop, operations "
        f"{sum(by_op.values()) / 1e3 / n:.2f} ms per token in {sum(count.values()) / n:.0f} "
        f"executed operations per token; load average {os.getloadavg()[0]:.2f}")
  for kind, us in by_kind.most_common(a.top):
    print(f"  {us / 1e3 / n:7.3f} ms/token  {kind}")
  for (op, kind), us in by_op.most_common(a.top):
    print(f"  {us / 1e3 / n:7.3f} ms/token  x{count[(op, kind)] / n:5.1f}  {kind:32s} {op[-60:]}")


if __name__ == "__main__":
  main()
