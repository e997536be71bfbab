"""The command line's flag values and the flags several commands share: what values each flag
allows (checked after parsing, before anything loads) and the jax.distributed settings."""

from __future__ import annotations

import argparse

from specjax import distributed, validate
from specjax.errors import InputError

DEFAULT_MODEL = "smollm2-135m"

# ----------------------------------------------------------------------------- flag values
# argparse reads a flag's text as an int or a float; what values are allowed is checked here,
# after parsing and before anything loads, by the same checkers sj.generate and the trainers use
# (specjax.validate), named by flag: "--top-p 2.0 is invalid: must be a finite number in (0, 1]".
# main prints it as one line with exit status 2, like argparse's own errors.


def _int(lo: int, hi: int | None = None, what: str = ""):
  return lambda flag, value: validate.integer(flag, value, lo, hi, what)


def _num(lo: float | None, hi: float | None = None, what: str = "", **ends):
  return lambda flag, value: validate.number(flag, value, lo, hi, what=what, **ends)


def _seed(lo: int = validate.SEED_MIN):
  return lambda flag, value: validate.integer(flag, value, lo, validate.SEED_MAX,
                                              " (a 64-bit signed seed)" if lo < 0 else "")


def _numbers(kind, lo: float, hi: float | None = None, example: str = ""):
  """A comma-separated list flag ("0,0.7,1.0") -> its numbers, each checked like one flag."""
  def check(flag: str, text) -> list:
    noun = "integers" if kind is int else "numbers"
    rng = validate.int_range(lo, hi) if kind is int else validate.number_range(lo, hi)
    out = []
    for item in str(text).split(","):
      try:
        v = kind(item.strip())
        out.append(validate.integer("", v, lo, hi) if kind is int
                   else validate.number("", v, lo, hi))
      except (ValueError, InputError):
        raise InputError(f"{flag} {text!r} is invalid: {item.strip()!r} is not one of the comma-"
                         f"separated {noun} {rng} it must hold, e.g. {example}") from None
    return out
  return check


SAMPLING_FLAGS = {"--max-new-tokens": _int(1, validate.INT32_MAX),
                  "--temperature": _num(0, what=" (0 = greedy)"),
                  "--top-k": _int(0, validate.INT32_MAX, " (0 = off)"),
                  "--top-p": _num(0, 1, " (1 = off)", lo_open=True), "--seed": _seed()}
METHOD_FLAGS = {"--gamma": _int(0, what=" (0 = from the cost curve)"),
                "--exit-layer": _int(0, what=" (0 = a quarter of the layers)"),
                "--nodes": _int(0, what=" (0 = from the cost curve)")}
BENCH_FLAGS = {"--num-prompts": _int(1), "--batch-size": _int(1), "--repeats": _int(1),
               "--max-new-tokens": _int(1), "--temperature": _num(0, what=" (0 = greedy)")}
DATA_FLAGS = {"--tokens": validate.count, "--batch-size": _int(1, 4096),
              "--micro-batch": _int(1, 4096), "--max-new-tokens": _int(1, 1 << 16),
              "--temperatures": _numbers(float, 0, example="0,0.7,1.0"),
              "--max-minutes": _num(0, what=" (0 = no limit)"), "--seed": _seed(0),
              "--batch-sizes": _numbers(int, 1, 4096, example="1,16,32"),
              "--new-tokens": _int(1, 1 << 16)}
TRAIN_FLAGS = {"--vocab-size": _int(0), "--steps": _int(1), "--batch-size": _int(1),
               "--seq-len": _int(2), "--lr": _num(0, lo_open=True), "--warmup": _int(0),
               "--weight-decay": _num(0), "--grad-clip": _num(0), "--held-out": _num(0, 1,
               hi_open=True), "--ckpt-every": _int(1), "--eval-every": _int(1),
               "--max-minutes": _num(0, what=" (0 = no limit)"), "--seed": _seed(0),
               "--num-layers": _int(1), "--soft-top-k": _int(0, what=" (0 = corpus tokens)"),
               "--unroll": _int(1)}


def check_flags(args, rules: dict) -> None:
  """Checks (and normalises) each flag of `rules` that args has: flag -> check(flag, value),
  which returns the value to use or raises InputError naming the flag and the value."""
  for flag, check in rules.items():
    dest = flag[2:].replace("-", "_")
    if getattr(args, dest, None) is not None:
      setattr(args, dest, check(flag, getattr(args, dest)))


def _add_distributed(p: argparse.ArgumentParser, mesh: bool = True) -> None:
  """--coordinator / --num-processes / --process-id (jax.distributed; each defaults to the
  variable JAX reads: $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES, $JAX_PROCESS_ID) and --mesh."""
  g = p.add_argument_group("many processes (jax.distributed; see docs/sharding.md)")
  g.add_argument("--coordinator", default=None, help="host:port of process 0's coordinator "
                 "(default $JAX_COORDINATOR_ADDRESS)")
  g.add_argument("--num-processes", type=int, default=None,
                 help="processes in the run (default $JAX_NUM_PROCESSES)")
  g.add_argument("--process-id", type=int, default=None,
                 help="this process's id, 0 .. num-processes - 1 (default $JAX_PROCESS_ID)")
  if mesh:
    g.add_argument("--mesh", default=None, help="load the model onto this device mesh, e.g. "
                   "data=2,model=4 (every process's devices; default: one device)")


def _start_distributed(args) -> None:
  """jax.distributed for this run, from the flags or JAX's variables (nothing without either)."""
  if hasattr(args, "coordinator"):
    distributed.initialize(args.coordinator, args.num_processes, args.process_id)
