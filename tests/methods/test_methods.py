"""The method contract (specjax.decode.Method) and the registry of methods (specjax.methods)."""

from __future__ import annotations

import pytest

import specjax as sj
from specjax import decode, methods

from tests.helpers.models import tiny_model


def test_registry_names_and_aliases():
  assert sj.METHODS == tuple(methods.names())
  assert methods.names()[0] == "autoregressive"
  for alias in ("self-spec", "self-speculative", "selfspeculative", "SelfSpeculative",
                "self_speculative", "layer_skip"):
    assert methods.canonical(alias) == "layer-skip", alias
  assert methods.canonical("pld") == "prompt-lookup"
  assert methods.canonical("telepathy") is None
  with pytest.raises(sj.InputError, match="'telepathy' is not a decoding method.*layer-skip"):
    methods.get("telepathy")


def test_every_entry_follows_the_contract():
  """Each class follows the Protocol, and its `name` (the statistics' label) is its entry's."""
  for name, entry in methods.REGISTRY.items():
    assert decode.Method in entry.cls.__mro__, name
    assert entry.description and isinstance(entry.trained, bool)
    assert entry.cls.name == name, f"{entry.cls.__name__}.name is {entry.cls.name!r}, not {name!r}"


def test_every_registered_method_reports_its_registry_name():
  """The method each entry builds reports the entry's name (stats["method"], bench rows); the
  old spellings still find it. Size knobs are given, so no cost curve is measured."""
  target = tiny_model()
  options = {
      "prompt-lookup": dict(num_tokens=3), "lookahead": dict(window=2),
      "draft": dict(draft=tiny_model(seed=7, vocab_size=target.config.vocab_size), gamma=2),
      "layer-skip": dict(gamma=2), "quantized": dict(gamma=2),
      "medusa": dict(heads=sj.init_heads(target, "medusa", num_heads=2), tree=[(0,), (1,)]),
      "eagle": dict(heads=sj.init_heads(target, "eagle"), depth=2, top_k=2, num_nodes=4),
      "mtp": dict(heads=sj.init_heads(target, "mtp", num_heads=2), gamma=2),
      "dflash": dict(heads=sj.init_heads(target, "dflash", mask_token_id=1), block_size=2),
      "pard": dict(draft=tiny_model(seed=7, vocab_size=target.config.vocab_size), gamma=2,
                   mask_token_id=1),
  }
  for name, entry in methods.REGISTRY.items():
    assert entry.build(target, **options.get(name, {})).name == name, name
  for old, name in (("draft_model", "draft"), ("self_speculative", "layer-skip"),
                    ("prompt_lookup", "prompt-lookup")):
    assert methods.canonical(old) == name, old


def test_availability_and_defaults_on_a_model_without_drafters():
  target = tiny_model()
  assert methods.available(target) == ["autoregressive", "prompt-lookup", "suffix", "lookahead",
                                       "layer-skip", "quantized", "hybrid"]
  assert methods.REGISTRY["eagle"].unavailable(target).startswith("no shipped eagle")
  with pytest.raises(sj.InputError, match="no shipped medusa .* heads="):
    methods.build("medusa", target)
  m = methods.build("layer-skip", target, gamma=2)
  assert m == sj.SelfSpeculative(exit_layer=max(1, target.config.num_layers // 4), gamma=2)
  heads = sj.init_heads(target, "mtp", num_heads=2, seed=4, scale=0.3)
  assert methods.build("mtp", target, heads=heads).gamma == 2


def test_generate_takes_a_registered_name():
  target = tiny_model()
  p = [[5, 6, 7, 5, 6, 7, 5, 6]]
  by_name = sj.generate(target, p, "pld", max_new_tokens=8)
  assert by_name.stats["method"] == "prompt-lookup"
  assert by_name.tokens == sj.generate(target, p, sj.PromptLookup(), max_new_tokens=8).tokens
  assert sj.generate(target, p, max_new_tokens=8).stats["method"] == "autoregressive"


@pytest.mark.parametrize("method,match", [
    (sj.Autoregressive, r"method=Autoregressive is a class, not a decoding method: call it, "
                        r"e\.g\. method=Autoregressive\(\)"),
    (object(), r"is not a decoding method \(it lacks arrays, extra_slots, init"),
    ("greedy", "'greedy' is not a decoding method: registered names are autoregressive"),
])
def test_not_a_method_is_a_clear_error(method, match):
  before = decode.compile_cache.count
  with pytest.raises(sj.InputError, match=match):
    sj.generate(tiny_model(), [[1, 2, 3]], method, max_new_tokens=2)
  assert decode.compile_cache.count == before


def test_a_duck_typed_method_runs():
  """The contract is a Protocol: an object with its members runs without subclassing."""

  class Plain:
    name, lossless, extra_slots, max_emit, taps = "plain", True, 1, 1, ()
    _inner = sj.Autoregressive()

    def validate(self, model):
      pass

    def arrays(self, model):
      return {}

    def init(self, prog, arrays, state, hidden):
      return None

    def step(self, prog, params, arrays, state):
      return self._inner.step(prog, params, arrays, state)

    def stats(self, state):
      return {"plain": True}

  target = tiny_model()
  out = sj.generate(target, [[1, 2, 3]], Plain(), max_new_tokens=4)
  assert out.stats["plain"] and out.tokens == sj.generate(target, [[1, 2, 3]],
                                                          max_new_tokens=4).tokens
