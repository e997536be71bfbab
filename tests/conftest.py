"""Shared fixtures: tiny random models (no weights needed), the embedded SmolLM2, prompt sets."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os

import jax
import numpy as np
import pytest

import specjax as sj

SHARED_PROMPTS = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "prompts")

# Built-in fallback so the suite runs without ../shared.
FALLBACK_PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, there was a",
    "Explain why the sky is blue.", "Write a haiku about the sea.", "What is 12 times 13?",
    "List three prime numbers:", "Translate 'good morning' into French:",
    "The quick brown fox", "import numpy as np\n", "Summarize: The meeting was moved to Friday.",
    "Q: Who wrote Hamlet?\nA:",
]


def tiny_config(**kw) -> sj.ModelConfig:
  base = dict(arch="llama", vocab_size=61, hidden_size=32, num_layers=2, num_heads=4,
              num_kv_heads=2, head_dim=8, intermediate_size=48, max_position_embeddings=512,
              rope_theta=10000.0, tie_word_embeddings=False, eos_token_ids=())
  base.update(kw)
  return sj.ModelConfig(**base)


def tiny_model(seed: int = 0, scale: float = 0.3, **kw) -> sj.Model:
  """A random model with logits spread wide enough that greedy argmax has no near-ties."""
  return sj.Model.random(tiny_config(**kw), seed=seed, scale=scale)


@pytest.fixture(scope="session")
def tiny():
  return tiny_model()


@pytest.fixture(scope="session")
def smollm2():
  return sj.load_model("smollm2-135m")


def shared_prompts(n: int, kind: str = "mt_bench") -> list[str]:
  """First n prompts (first turns) from ../shared/data/prompts, or the built-in list."""
  out: list[str] = []
  try:
    if kind == "humaneval":
      with gzip.open(os.path.join(SHARED_PROMPTS, "humaneval.jsonl.gz"), "rt") as f:
        out = [json.loads(line)["prompt"] for line in f]
    elif kind == "gsm8k":
      with open(os.path.join(SHARED_PROMPTS, "gsm8k_test.jsonl")) as f:
        out = [json.loads(line)["question"] for line in f]
    else:
      with open(os.path.join(SHARED_PROMPTS, f"{kind}.jsonl")) as f:
        out = [json.loads(line)["turns"][0] for line in f]
  except OSError:
    out = []
  if not out:
    out = FALLBACK_PROMPTS
  return (out * (n // len(out) + 1))[:n]


def random_prompts(n: int, vocab: int, seed: int = 0, lo: int = 3, hi: int = 20) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, vocab, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]
