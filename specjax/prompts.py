"""Prompt sets for benchmarks: Spec-Bench, MT-Bench, GSM8K, HumanEval from ../shared/data/prompts
(never copied into the repository), with a small built-in fallback so everything runs without
them. Set SPECJAX_PROMPTS to point elsewhere."""

from __future__ import annotations

import gzip
import json
import os

FALLBACK = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, there was a",
    "Explain why the sky is blue.", "Write a haiku about the sea.", "What is 12 times 13?",
    "List three prime numbers:", "Translate 'good morning' into French:",
    "The quick brown fox", "import numpy as np\n", "Summarize: The meeting was moved to Friday.",
    "Q: Who wrote Hamlet?\nA:",
]


def prompts_dir() -> str | None:
  """The shared prompt folder: $SPECJAX_PROMPTS, else ../shared/data/prompts next to the project
  (looked up from the working directory and from this package's location)."""
  env = os.environ.get("SPECJAX_PROMPTS")
  if env:
    return env if os.path.isdir(env) else None
  for start in (os.getcwd(), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))):
    d = start
    for _ in range(4):
      cand = os.path.join(d, "..", "shared", "data", "prompts")
      if os.path.isdir(cand):
        return os.path.normpath(cand)
      d = os.path.dirname(d)
  return None


def read_jsonl(path: str) -> list[dict]:
  """Rows of a .jsonl or .jsonl.gz file."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    return [json.loads(line) for line in f if line.strip()]


SETS = {"mt_bench": "mt_bench.jsonl", "spec_bench": "spec_bench.jsonl",
        "humaneval": "humaneval.jsonl.gz", "gsm8k": "gsm8k_test.jsonl"}


def load(kind: str = "mt_bench", n: int | None = None) -> list[str]:
  """First n prompts of a set: "mt_bench", "spec_bench" or "spec_bench:<category>", "humaneval",
  "gsm8k", or a path to a .jsonl (field "prompt", "question" or "turns") / .txt (one per line);
  n larger than the set repeats it. Without the shared prompt folder a named set falls back to a
  small built-in list, so everything runs; an unknown set, an unknown category, a missing or
  empty file, or n < 1 raises InputError."""
  from specjax.errors import InputError, check_int

  if n is not None:
    check_int("n", n, 1, what="prompts to load")
  if not isinstance(kind, str) or not kind:
    raise InputError(f"prompt set {kind!r} is invalid; use one of {', '.join(SETS)} or a file path")
  rows: list[str] = []
  if kind.endswith((".txt", ".jsonl", ".jsonl.gz")) or os.sep in kind or os.path.isfile(kind):
    if not os.path.isfile(kind):
      raise InputError(f"prompt file {kind!r}: no such file")
    if kind.endswith(".txt"):
      with open(kind) as f:
        rows = [line.rstrip("\n") for line in f if line.strip()]
    else:
      for r in read_jsonl(kind):
        rows.append(r.get("prompt") or r.get("question") or r["turns"][0])
    if not rows:
      raise InputError(f"prompt file {kind!r} holds no prompts")
  else:
    d = prompts_dir()
    name, sep, category = kind.partition(":")
    if name not in SETS:
      raise InputError(f"prompt set {kind!r} unknown; use one of {', '.join(SETS)} or a file path")
    if sep and name != "spec_bench":
      raise InputError(f"prompt set {kind!r}: only spec_bench has categories")
    path = os.path.join(d, SETS[name]) if d else ""
    if not os.path.isfile(path):
      rows = list(FALLBACK)
    else:
      known = set()
      for r in read_jsonl(path):
        known.add(r.get("category"))
        if category and r.get("category") != category:
          continue
        rows.append(r.get("prompt") or r.get("question") or r["turns"][0])
      if not rows:
        raise InputError(f"prompt set {kind!r}: no prompts in category {category!r}; categories: "
                         f"{', '.join(sorted(c for c in known if c))}")
  if n is None:
    return rows
  return (rows * (n // len(rows) + 1))[:n]


def categories() -> list[str]:
  d = prompts_dir()
  if not d or not os.path.isfile(os.path.join(d, "spec_bench.jsonl")):
    return []
  return sorted({r["category"] for r in read_jsonl(os.path.join(d, "spec_bench.jsonl"))})
