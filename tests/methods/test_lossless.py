"""The lossless suite, run for every method that claims to be lossless.

Greedy: token-identical to sj.Autoregressive() (fp32), batch 1 and batch 4 with different prompt
lengths. Sampling: the empirical joint distribution of the first two generated tokens matches the
exact distribution computed from the target alone (total variation within twice its expected
sampling error), and a deliberately broken acceptance rule fails the same check.

Cases are named by the method's registry name (specjax.methods), "name" or "name/variant". To add
a method: append (name, factory) pairs to GREEDY_METHODS and SAMPLING_METHODS in
tests/helpers/lossless.py; factory(target) -> method. Every registered method must have both
(test_every_registered_method_is_in_the_suite).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import specjax as sj
from specjax import methods, sampling

from tests.helpers.lossless import (_MEDUSA_TREE, GREEDY_METHODS, N_SAMPLES, SAMPLING_METHODS,
                                    SAMPLING_SETTINGS, _feature_heads, _medusa,
                                    _medusa_random_heads, _random_draft, exact_two_token_dist,
                                    small_target, tv_check)
from tests.helpers.models import assert_same_greedy, random_prompts, tiny_model
from tests.helpers.programs import cache_copies_in_loop

N_PROMPTS = 20
MAX_NEW = 24


@pytest.fixture(scope="module")
def target():
  return tiny_model(seed=0)


@pytest.fixture(scope="module")
def prompts(target):
  # Lengths 3..15: one prompt bucket (16), so each case compiles once per batch size; compiles
  # are most of this suite's time, and tests/decode/test_decode.py covers the buckets.
  return random_prompts(N_PROMPTS, target.config.vocab_size, seed=1, lo=3, hi=16)


@pytest.fixture(scope="module")
def reference(target, prompts):
  return [sj.generate(target, [p], sj.Autoregressive(), max_new_tokens=MAX_NEW).tokens[0]
          for p in prompts]


def _registered(case: str) -> methods.Entry:
  """The registry entry a case is named after ("name" or "name/variant", canonical names)."""
  name = case.split("/")[0]
  assert name in methods.REGISTRY, f"case {case!r}: {name!r} is not a registered method name"
  return methods.REGISTRY[name]


def test_every_registered_method_is_in_the_suite():
  """A registered method cannot skip the suite: each has greedy and sampling cases (a lossy
  method still has its greedy ones, e.g. typical acceptance at temperature 0)."""
  for cases, kind in ((GREEDY_METHODS, "greedy"), (SAMPLING_METHODS, "sampling")):
    covered = {_registered(name).name for name, _ in cases}
    missing = [n for n in methods.names() if n not in covered]
    assert not missing, f"registered methods without a {kind} case in the lossless suite: {missing}"


# Batch 1: one variant of each method (the variants differ in settings, which batch 4 checks
# every one of against the same one-row references); batch 4: every variant.
def _first_variants(cases):
  seen = set()
  return [(n, f) for n, f in cases if not (n.split("/")[0] in seen or seen.add(n.split("/")[0]))]


GREEDY_BATCH1 = _first_variants(GREEDY_METHODS)


@pytest.mark.parametrize("name,factory", GREEDY_BATCH1, ids=[m[0] for m in GREEDY_BATCH1])
def test_greedy_identical_batch1(name, factory, target, prompts, reference):
  method = factory(target)
  assert isinstance(method, _registered(name).cls), f"case {name} does not build its method"
  for p, ref in zip(prompts, reference):
    out = sj.generate(target, [p], method, max_new_tokens=MAX_NEW)
    assert_same_greedy(target, [p], [ref], out.tokens,
                       f"{name} diverged from autoregressive on prompt {p}")


@pytest.mark.parametrize("name,factory", GREEDY_METHODS, ids=[m[0] for m in GREEDY_METHODS])
def test_greedy_identical_batch4(name, factory, target, prompts, reference):
  method = factory(target)
  for i in range(0, 8, 4):
    batch = prompts[i:i + 4]
    assert len({len(p) for p in batch}) > 1, "the batch must mix prompt lengths"
    out = sj.generate(target, batch, method, max_new_tokens=MAX_NEW)
    assert_same_greedy(target, batch, reference[i:i + 4], out.tokens,
                       f"{name} batch of 4 differs from each row alone")
  # No step copies a whole KV cache (tests/decode/test_cache_copies.py says why one would).
  assert cache_copies_in_loop(method, target.config, 4) == 0


# ----------------------------------------------------------------------------- sampling



# The baseline at every setting; each other method at two temperatures, each with a truncation
# (top-k 5 at T = 1, top-p 0.8 at T = 0.7), which is where a rejection rule's residual
# distribution is easiest to get wrong. Settings are arrays in one program, so the other two add
# sampling time, not compiles, and would exercise no other code of a method.
SAMPLING_CASES = [(n, f, s) for n, f in SAMPLING_METHODS for s in SAMPLING_SETTINGS
                  if n == "autoregressive" or s["top_k"] or s["top_p"] < 1]


@pytest.mark.parametrize("name,factory,settings", SAMPLING_CASES,
                         ids=["{}-t{temperature}-k{top_k}-p{top_p}".format(n, **s)
                              for n, _, s in SAMPLING_CASES])
def test_sampling_distribution(name, factory, settings):
  model = small_target()
  method = factory(model)
  assert isinstance(method, _registered(name).cls), f"case {name} does not build its method"
  tv, expected = tv_check(model, method, settings)
  assert tv < 2 * expected, f"{name}: TV {tv:.4f} vs expected sampling error {expected:.4f}"


def test_sampling_check_detects_wrong_distribution():
  """The TV check must fail when the sampler draws from the wrong distribution (temperature)."""
  model = small_target()
  exact_settings = dict(temperature=1.0, top_k=0, top_p=1.0)
  prompt = [3, 1, 4, 1, 5]
  exact = exact_two_token_dist(model, prompt, exact_settings)
  out = sj.generate(model, [prompt] * N_SAMPLES, sj.Autoregressive(), max_new_tokens=2,
                    temperature=0.8, stop_at_eos=False)
  counts = np.zeros_like(exact)
  for t in out.tokens:
    counts[t[0], t[1]] += 1
  tv = 0.5 * np.abs(counts / counts.sum() - exact).sum()
  expected = 0.5 * np.sum(np.sqrt(2 * exact * (1 - exact) / (np.pi * N_SAMPLES)))
  assert tv > 2 * expected


def test_seeded_runs_reproducible(target, prompts):
  a = sj.generate(target, prompts[:4], max_new_tokens=16, temperature=0.9, seed=7)
  b = sj.generate(target, prompts[:4], max_new_tokens=16, temperature=0.9, seed=7)
  c = sj.generate(target, prompts[:4], max_new_tokens=16, temperature=0.9, seed=8)
  assert a.tokens == b.tokens
  assert a.tokens != c.tokens


def test_sampling_check_detects_broken_acceptance():
  """A draft-model step that accepts every drafted token must fail the same TV check."""
  from specjax import sampling as smp
  from specjax.methods.draft import DraftModel

  class AlwaysAccept(DraftModel):
    def _accept(self, key, draft, q, target_logits, sp):
      b, g = draft.shape
      p = smp.probs(target_logits[:, g], sp)
      return np.full((b,), g, np.int32), smp.sample_probs(key, p)

  model = small_target()
  tv, expected = tv_check(model, AlwaysAccept(_random_draft(model), gamma=2),
                          dict(temperature=1.0, top_k=0, top_p=1.0))
  assert tv > 2 * expected, f"broken rule passed: TV {tv:.4f} vs {expected:.4f}"


def test_sampling_check_detects_broken_tree_rule():
  """Medusa with a tree rule that accepts every first child must fail the TV check."""
  from specjax.methods.medusa import Medusa

  class AcceptFirstChild(Medusa):
    def _rule(self):
      return "accept_all"

  model = small_target()
  method = AcceptFirstChild(_medusa_random_heads(model), tree=_MEDUSA_TREE)
  tv, expected = tv_check(model, method, dict(temperature=1.0, top_k=0, top_p=1.0))
  assert tv > 2 * expected, f"broken tree rule passed: TV {tv:.4f} vs {expected:.4f}"


def test_sampling_check_detects_broken_dynamic_tree_rule():
  """EAGLE-2 (per-row dynamic trees) with a rule that accepts every first child must fail."""
  from specjax.methods.eagle import Eagle

  class AcceptFirstChild(Eagle):
    def _rule(self):
      return "accept_all"

  model = small_target()
  method = AcceptFirstChild(_feature_heads("eagle", False)(model), depth=3, top_k=3, num_nodes=8)
  tv, expected = tv_check(model, method, dict(temperature=1.0, top_k=0, top_p=1.0))
  assert tv > 2 * expected, f"broken dynamic tree rule passed: TV {tv:.4f} vs {expected:.4f}"


@pytest.mark.parametrize("v", [5, 128, 300])  # one block, exactly one block, a padded last block
def test_sample_probs_draws_the_given_distribution(v):
  """sample_probs (two-level inverse CDF) against its input: unnormalised rows, zeros, mass only
  at the first / last token; TV within twice its sampling error; a zero-mass token never drawn."""
  rng = np.random.default_rng(v)
  p = rng.dirichlet(np.full(v, 0.5), size=4).astype(np.float32)
  p[:, 1::3] = 0
  p[1] *= 13.0  # any positive total
  p[2] = 0
  p[2, v - 1] = 2.0  # all mass on the last (padded block's) token
  p[3, 2:] = 0  # all mass on the first two tokens
  n = 100_000
  draws = np.asarray(jax.jit(sampling.sample_probs)(jax.random.key(v),
                                                    np.broadcast_to(p, (n, 4, v))))
  for r in range(4):
    q = p[r] / p[r].sum()
    freq = np.bincount(draws[:, r], minlength=v) / n
    assert freq[q == 0].sum() == 0, f"row {r}: drew a token of probability 0"
    tv = 0.5 * np.abs(freq - q).sum()
    expected = 0.5 * np.sum(np.sqrt(2 * q * (1 - q) / (np.pi * n)))
    assert tv <= 2 * expected + 1e-12, f"row {r}: TV {tv:.4f} vs expected {expected:.4f}"
    if r == 0:  # the check has power: a slightly different distribution fails it
      shifted = np.roll(q, 1)
      assert 0.5 * np.abs(freq - shifted).sum() > 2 * expected


def test_argmax_is_jnp_argmax():
  """sampling.argmax (block maxima, then the first block holding the maximum, then the first
  index in it) == jnp.argmax: first maximum on ties (inside a block and across blocks), all -inf
  rows, rows of whole blocks and of a padded last block, one entry, leading axes, bfloat16; a NaN
  row gives the last index."""
  rng = np.random.default_rng(0)
  x = rng.integers(-3, 4, size=(3, 5, 300)).astype(np.float32)  # many ties; 300: a padded block
  x[0, 0] = -np.inf
  x[1, 2, 7] = np.inf
  x[2, 1, 290] = 9.0  # the maximum in the padded last block
  whole = rng.integers(-2, 3, size=(4, 256)).astype(np.float32)
  whole[0, [5, 200]] = 7.0  # a tie across blocks: the first block's
  whole[1, [130, 131]] = 7.0  # a tie inside the second block
  for a in (x, x[..., :1], whole, whole[:, :128], rng.normal(size=(2, 49152)).astype(np.float32),
            jax.numpy.asarray(x, jax.numpy.bfloat16)):
    np.testing.assert_array_equal(np.asarray(jax.jit(sampling.argmax)(a)),
                                  np.argmax(np.asarray(a, np.float32), axis=-1))
  nan = whole.copy()
  nan[2, 40] = np.nan
  assert int(jax.jit(sampling.argmax)(nan)[2]) == nan.shape[-1] - 1


# ----------------------------------------------------------------------------- model families
# Methods on targets with the other families' features (specjax/arch): a Gemma 2-like target
# (post norms, GeGLU, scaled embeddings, both soft-caps, alternating sliding / global layers) and a
# Gemma 3 / Qwen3-like one (q/k norms, a sliding layer with its own rope base). Windows of 5-6
# tokens: every generation crosses them, in lookahead windows and trees alike. A few methods, not
# all: the model is the same code for every family.

FAMILY_TARGETS = {
    "gemma2-like": dict(arch="gemma2", activation="gelu_tanh", post_norms=True, embed_scale=32 ** 0.5,
                        attn_scale=20 ** -0.5, attn_softcap=5.0, final_softcap=3.0,
                        layer_windows=(6, 0)),
    "gemma3-like": dict(arch="gemma3_text", activation="gelu_tanh", post_norms=True, qk_norm=True,
                        layer_windows=(5, 0), rope_theta=1e6, local_rope_theta=1e4),
}
FAMILY_METHODS = {
    "lookahead": lambda target: sj.Lookahead(window=3, ngram=3, guess=2),
    "medusa/random": _medusa(_medusa_random_heads, tree=_MEDUSA_TREE),
}
# Two cases (CI time): a tree on the soft-capped target, a lookahead window on the q/k-normed one.
FAMILY_CASES = [("gemma2-like", "medusa/random"), ("gemma3-like", "lookahead")]
_FAMILY_REFS: dict = {}


def _family_target(family):
  """(target, 4 prompts of mixed lengths, their autoregressive tokens), built once per family."""
  if family not in _FAMILY_REFS:
    target = tiny_model(seed=5, **FAMILY_TARGETS[family])
    prompts = random_prompts(4, target.config.vocab_size, seed=2, lo=3, hi=12)
    ref = sj.generate(target, prompts, max_new_tokens=MAX_NEW).tokens
    _FAMILY_REFS[family] = (target, prompts, ref)
  return _FAMILY_REFS[family]


@pytest.mark.parametrize("family,name", FAMILY_CASES, ids=[f"{f}-{m}" for f, m in FAMILY_CASES])
def test_family_greedy_identical(family, name):
  """Batch 1 (the longest prompt) and batch 4 (mixed prompt lengths) token-identical to
  autoregressive decoding."""
  target, prompts, ref = _family_target(family)
  method = FAMILY_METHODS[name](target)
  i = int(np.argmax([len(p) for p in prompts]))
  one = sj.generate(target, [prompts[i]], method, max_new_tokens=MAX_NEW).tokens
  assert_same_greedy(target, [prompts[i]], [ref[i]], one, name)
  assert_same_greedy(target, prompts, ref, sj.generate(target, prompts, method,
                                                       max_new_tokens=MAX_NEW).tokens, name)
