"""docs/adding_a_method.md stays true: its method file, registry line and lossless cases, taken
from the page itself, build a registered method that passes the lossless suite's checks."""

from __future__ import annotations

import os
import re
import sys
import types

import pytest

import specjax as sj
from specjax import methods

from tests.helpers.models import random_prompts, tiny_model

DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs",
                   "adding_a_method.md")


def _code_blocks() -> list[str]:
  """The page's ```python blocks: the method file, the registry line, the lossless cases."""
  with open(DOC) as f:
    blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
  assert len(blocks) == 3, f"{DOC}: expected 3 python blocks, found {len(blocks)}"
  return blocks


@pytest.fixture
def example(monkeypatch):
  """The page's method registered (in copies of the registry, dropped after the test) and its
  cases -> (the module, GREEDY cases, SAMPLING cases)."""
  file, line, cases = _code_blocks()
  module = types.ModuleType("specjax.methods.repeat_last")
  monkeypatch.setitem(sys.modules, module.__name__, module)  # dataclasses look the module up
  exec(compile(file, "repeat_last.py", "exec"), module.__dict__)
  monkeypatch.setattr(methods, "REGISTRY", dict(methods.REGISTRY))
  monkeypatch.setattr(methods, "_LOOKUP", dict(methods._LOOKUP))
  exec(line, {"register": methods.register, "Entry": methods.Entry,
              "RepeatLast": module.RepeatLast})
  suite = {"GREEDY_METHODS": [], "SAMPLING_METHODS": [], "RepeatLast": module.RepeatLast}
  exec(cases, suite)
  return module, suite["GREEDY_METHODS"], suite["SAMPLING_METHODS"]


def test_the_example_is_registered_and_greedy_identical(example):
  module, greedy, sampling = example
  assert "repeat-last" in methods.names()
  assert {n for n, _ in greedy} == {n for n, _ in sampling} == {"repeat-last"}
  target = tiny_model(seed=0)
  # Prompts ending in runs, so drafts get accepted, and random ones (batches mix lengths).
  ps = [p + [p[-1]] * 6 for p in random_prompts(4, target.config.vocab_size, seed=2)]
  ps += random_prompts(4, target.config.vocab_size, seed=1)
  ref = sj.generate(target, ps, max_new_tokens=16).tokens
  for name, factory in greedy:
    method = factory(target)
    assert isinstance(method, sj.Method)
    assert [sj.generate(target, [p], method, max_new_tokens=16).tokens[0] for p in ps] == ref
    assert sj.generate(target, ps[:4], method, max_new_tokens=16).tokens == ref[:4]
  assert sj.generate(target, ps[:2], "repeat-last", max_new_tokens=16).tokens == ref[:2]


def test_the_example_samples_the_target_distribution(example):
  from tests.helpers.lossless import small_target, tv_check

  _, _, sampling = example
  model = small_target()
  for name, factory in sampling:
    tv, expected = tv_check(model, factory(model), dict(temperature=1.0, top_k=0, top_p=1.0))
    assert tv < 2 * expected, f"{name}: TV {tv:.4f} vs expected sampling error {expected:.4f}"
