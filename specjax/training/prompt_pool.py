"""The prompt pool for the self-distillation corpus: instructions and code / prose contexts that
exist on every machine and share nothing with the evaluation sets we report on.

Sources (each prompt records which one it came from):

  topics    our own seed topics crossed with our own instruction templates ("Explain {topic} to a
            beginner.", ...). Written for this project; no benchmark question was used.
  code      functions and classes of this interpreter's Python standard library (tests, vendored
            and private modules excluded), parsed with `ast`: explain / document / test / refactor
            tasks in chat form, and signature + docstring completions as raw text (the form
            HumanEval uses, with none of its problems: those are hand-written puzzles, not stdlib).
  prose     paragraphs of the standard library's module docstrings: summarise / simplify /
            continue / ask-questions tasks.

Evaluation sets (MT-Bench, Spec-Bench, HumanEval, GSM8K) are never read as sources. When their
files are present (../shared/data/prompts), every candidate prompt sharing a 13-word sequence
with any of their prompts is dropped as well (GPT-3's decontamination rule), and the count
dropped is recorded in the corpus metadata.
"""

from __future__ import annotations

import ast
import glob
import os
import re
import sysconfig

import numpy as np

from specjax import prompts as prompt_sets

TOPICS = [
    # science and nature
    "photosynthesis", "black holes", "plate tectonics", "the water cycle", "vaccines",
    "the theory of evolution", "climate change", "renewable energy", "the human immune system",
    "quantum entanglement", "the periodic table", "ocean currents", "volcanoes", "bees and pollination",
    "the speed of light", "antibiotic resistance", "the Moon's phases", "DNA replication",
    "earthquakes", "rainforests", "coral reefs", "the greenhouse effect", "sleep and memory",
    "nuclear fusion", "migratory birds", "tides", "the Big Bang", "electric circuits", "magnetism",
    "sound waves", "friction", "the carbon cycle", "fungi", "the human heart", "nutrition labels",
    # technology and programming
    "recursion", "hash tables", "binary search", "version control with git", "unit testing",
    "object-oriented programming", "functional programming", "REST APIs", "SQL joins",
    "regular expressions", "memory leaks", "multithreading", "public-key cryptography",
    "password security", "cloud computing", "machine learning", "neural networks", "compilers",
    "operating systems", "the TCP/IP model", "caching", "database indexes", "code reviews",
    "technical debt", "containers", "sorting algorithms", "linked lists", "graph traversal",
    "dynamic programming", "big-O notation", "floating point numbers", "Unicode", "open source licenses",
    "spreadsheets", "accessibility on the web", "Python virtual environments", "command-line tools",
    # society, history, culture
    "the printing press", "the Roman Empire", "the Industrial Revolution", "the Silk Road",
    "democracy", "inflation", "supply and demand", "compound interest", "budgeting", "urban planning",
    "public libraries", "the history of chess", "jazz music", "impressionist painting",
    "the Olympic Games", "ancient Egypt", "the Renaissance", "world languages", "philosophy of mind",
    "ethics of artificial intelligence", "social media", "remote work", "volunteering", "museums",
    "mythology", "poetry", "film editing", "photography", "architecture", "fashion history",
    # everyday life
    "learning a new language", "time management", "job interviews", "public speaking", "gardening",
    "baking bread", "making coffee", "healthy breakfasts", "running a first marathon", "yoga",
    "camping", "travelling on a budget", "adopting a dog", "houseplants", "saving energy at home",
    "writing a resume", "negotiating a salary", "starting a small business", "studying for exams",
    "keeping a journal", "meditation", "cycling in a city", "cooking rice", "composting",
    "moving to a new city", "making friends as an adult", "planning a birthday party",
    "reading more books", "learning to swim", "teaching children to read", "first aid",
]

TEMPLATES = [
    "Explain {t} to a beginner.", "What is {t}? Answer in a short paragraph.",
    "Give me three interesting facts about {t}.", "What are the pros and cons of {t}?",
    "Write a short story that involves {t}.", "Write a poem about {t}.",
    "Summarize the key ideas behind {t} in five bullet points.",
    "What are common misconceptions about {t}?", "How would you teach {t} to a ten-year-old?",
    "Write a short blog post introduction about {t}.", "What questions should I ask to learn more about {t}?",
    "Compare {t} with something from everyday life.", "Give a step-by-step guide related to {t}.",
    "Why does {t} matter? Give two reasons.", "Write a dialogue between two friends discussing {t}.",
    "What is the history of {t}, briefly?", "Describe {t} in exactly three sentences.",
    "Create a short quiz with three questions about {t}, with answers.",
    "What are the most important terms to know about {t}? Define each.",
    "Write an email to a colleague recommending they learn about {t}.",
    "What mistakes do people often make with {t}?", "Give an analogy that explains {t}.",
    "Write a tweet about {t}.", "What careers are related to {t}?",
    "Plan a one-week study schedule to learn about {t}.", "Tell me a fun fact about {t} and explain it.",
]

CODE_CHAT = [
    "Explain what the following Python code does:\n\n```python\n{src}\n```",
    "Write a short docstring for this Python function:\n\n```python\n{src}\n```",
    "Write two pytest unit tests for this Python function:\n\n```python\n{src}\n```",
    "Suggest how to make this Python code easier to read:\n\n```python\n{src}\n```",
    "Complete this Python function:\n\n```python\n{head}\n```",
]

PROSE_CHAT = [
    "Summarize the following text in two sentences:\n\n{text}",
    "Rewrite the following text in plain English:\n\n{text}",
    "Write three questions that the following text answers:\n\n{text}",
    "Continue the following text with one more paragraph:\n\n{text}",
]

# Share of each source in any prefix of the pool: chat instructions first (the main benchmarks are
# chat), then code in chat and raw form, then prose tasks.
WEIGHTS = {"topics": 0.45, "code": 0.3, "code-raw": 0.1, "prose": 0.15}

_NGRAM = 13


def _words(text: str) -> list[str]:
  return re.findall(r"[a-z0-9]+", text.lower())


def _ngrams(text: str, n: int = _NGRAM) -> set[int]:
  w = _words(text)
  return {hash(tuple(w[i:i + n])) for i in range(len(w) - n + 1)}


def eval_ngrams() -> set[int]:
  """13-word n-grams of every evaluation prompt present in the shared prompt folder."""
  d = prompt_sets.prompts_dir()
  out: set[int] = set()
  if not d:
    return out
  for f in ("mt_bench.jsonl", "spec_bench.jsonl", "gsm8k_test.jsonl", "humaneval.jsonl.gz"):
    path = os.path.join(d, f)
    if not os.path.isfile(path):
      continue
    for r in prompt_sets.read_jsonl(path):
      for field in ("turns", "prompt", "question", "answer", "canonical_solution"):
        v = r.get(field)
        for text in (v if isinstance(v, list) else [v] if v else []):
          out |= _ngrams(text)
  return out


def _stdlib_files() -> list[str]:
  root = sysconfig.get_paths()["stdlib"]
  skip = ("/test", "/idle_test", "site-packages", "/_vendor", "/lib2to3", "/tkinter", "/turtledemo",
          "/ensurepip", "/pydoc_data", "/encodings")
  return sorted(f for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                if not any(s in f for s in skip) and not os.path.basename(f).startswith("_"))


def _code_items(max_lines: int = 30) -> tuple[list[str], list[str], list[str]]:
  """(function / class sources, signature + docstring heads, module docstring paragraphs)."""
  srcs, heads, paras = [], [], []
  for f in _stdlib_files():
    try:
      with open(f, encoding="utf-8") as fh:
        text = fh.read()
      tree = ast.parse(text)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
      continue
    lines = text.splitlines()
    doc = ast.get_docstring(tree)
    if doc:
      for p in re.split(r"\n\s*\n", doc):
        p = " ".join(p.split())
        if 200 <= len(p) <= 1200 and p.count(" ") > 30:
          paras.append(p)
    for node in ast.walk(tree):
      if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
        continue
      end = getattr(node, "end_lineno", None)
      if end is None:
        continue
      body = lines[node.lineno - 1:end]
      ds = ast.get_docstring(node)
      if ds and len(ds) >= 300:
        p = " ".join(ds.split("\n\n")[0].split())
        if 200 <= len(p) <= 1200 and p.count(" ") > 30:
          paras.append(p)
      if 4 <= len(body) <= max_lines:
        srcs.append("\n".join(body))
      if ds and isinstance(node, ast.FunctionDef) and node.body and len(ds) < 800:
        first = node.body[0]
        ds_end = getattr(first, "end_lineno", None)
        if ds_end is not None and ds_end < end:
          heads.append("\n".join(lines[node.lineno - 1:ds_end]))
  import textwrap
  return ([textwrap.dedent(s) for s in srcs], [textwrap.dedent(h) + "\n" for h in heads], paras)


def build(seed: int = 0, *, decontaminate: bool = True,
          banned: set[int] | None = None) -> tuple[list[dict], dict]:
  """The whole pool, shuffled by `seed`: ([{"text", "chat", "source"}], info).

  info: counts per source and how many prompts the n-gram filter dropped. banned: the n-gram
  hashes to filter against (default: `eval_ngrams()`, the evaluation sets present).
  """
  rng = np.random.default_rng(seed)
  items: list[dict] = []
  for t in TOPICS:
    for tpl in TEMPLATES:
      items.append({"text": tpl.format(t=t), "chat": True, "source": "topics"})
  srcs, heads, paras = _code_items()
  for s in srcs:
    tpl = CODE_CHAT[int(rng.integers(0, len(CODE_CHAT) - 1))]
    items.append({"text": tpl.format(src=s), "chat": True, "source": "code"})
  for h in heads:
    if rng.random() < 0.5:
      items.append({"text": CODE_CHAT[-1].format(head=h.rstrip()), "chat": True, "source": "code"})
    else:
      items.append({"text": h, "chat": False, "source": "code-raw"})
  for p in paras:
    tpl = PROSE_CHAT[int(rng.integers(0, len(PROSE_CHAT)))]
    items.append({"text": tpl.format(text=p), "chat": True, "source": "prose"})
  dropped = 0
  if decontaminate:
    bad = eval_ngrams() if banned is None else banned
    if bad:
      keep = [it for it in items if not (_ngrams(it["text"]) & bad)]
      dropped = len(items) - len(keep)
      items = keep
  # Interleave the sources in proportion to WEIGHTS (shuffled within each source), so any prefix
  # of the pool -- a corpus stopped early -- has the same mix. A source that runs out just ends.
  keyed = []
  for src in sorted({it["source"] for it in items}):
    group = [it for it in items if it["source"] == src]
    order = rng.permutation(len(group))
    w = WEIGHTS.get(src, 0.1)
    keyed += [((rank + rng.random()) / w, group[i]) for rank, i in enumerate(order)]
  keyed.sort(key=lambda kv: kv[0])
  items = [it for _, it in keyed]
  counts: dict[str, int] = {}
  for it in items:
    counts[it["source"]] = counts.get(it["source"], 0) + 1
  return items, {"sources": counts, "decontaminated_dropped": dropped}
