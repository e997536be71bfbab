"""The tie-aware greedy check (specjax/exactness.py): its bound, a planted tie that passes, a
planted real divergence that fails, and bfloat16 greedy decoding of a few methods on a tiny
model, judged by it (on this CPU's XLA path every divergence there must be a tie).

A tie is planted by making two LM-head columns equal (every position then gives the two tokens
the same logit, and greedy argmax keeps the lower id); a near-tie by making one the other scaled
by 1 - 2^-8 (one bf16 ulp below it, or equal after rounding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax import exactness as ex

from tests.helpers.models import assert_same_greedy, random_prompts, tiny_model

NEW = 12


def _bf16(model):
  params = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), model.params)
  return sj.Model(model.config, model.graphdef, params, dtype=jnp.bfloat16)


@pytest.fixture(scope="module")
def target():
  return _bf16(tiny_model(seed=0))


@pytest.fixture(scope="module")
def prompts(target):
  return random_prompts(4, target.config.vocab_size, seed=1, lo=3, hi=16)


@pytest.fixture(scope="module")
def reference(target, prompts):
  return sj.generate(target, prompts, max_new_tokens=NEW).tokens


def test_ulp_and_bound():
  assert ex.ulp(jnp.bfloat16, 1.0) == 2.0 ** -7
  assert ex.ulp(jnp.bfloat16, 65.0) == 2.0 ** -1  # 64 <= 65 < 128
  assert ex.ulp(jnp.float32, 1.5) == 2.0 ** -23
  assert ex.ulp(jnp.float16, -3.0) == 2.0 ** -9  # the magnitude counts, not the sign
  assert ex.margin_bound(jnp.bfloat16, 10.0) == ex.ULPS["bfloat16"] * 2.0 ** -4
  assert ex.margin_bound(jnp.bfloat16, 10.0, ulps=1) == 2.0 ** -4
  with pytest.raises(ValueError, match="int32"):
    ex.margin_bound(jnp.int32, 1.0)


def test_first_divergence():
  assert ex.first_divergence([1, 2, 3], [1, 2, 3]) is None
  assert ex.first_divergence([1, 2, 3], [1, 5, 3]) == 1
  assert ex.first_divergence([1, 2, 3], [1, 2]) == 2
  assert ex.first_divergence([], [4]) == 0


def test_identical_runs_have_no_divergence(target, prompts, reference):
  report = ex.check_greedy(target, prompts, reference, reference)
  assert report.ok and report.identical and report.to_dict()["identical_rows"] == len(prompts)


def _with_column(model, b: int, column_of: int, factor: float = 1.0):
  """model with LM-head column b replaced by column `column_of` times factor."""
  def plant(path, x):
    if "lm_head" not in jax.tree_util.keystr(path):
      return x
    return x.at[:, b].set((x[:, column_of].astype(jnp.float32) * factor).astype(x.dtype))

  params = jax.tree_util.tree_map_with_path(plant, model.params)
  return sj.Model(model.config, model.graphdef, params, dtype=model.dtype)


def _planted(model, prompts, factor: float):
  """(model with token b's column planted beside a's, its reference, (row, index) where the
  reference emits a, b): a is the first row's third token, b = a + 1 (a higher id: the tie
  keeps a, as argmax keeps the first maximum)."""
  first = sj.generate(model, prompts, max_new_tokens=NEW).tokens[0]  # the reference's program
  a = first[2]
  b = a + 1 if a + 1 < model.config.vocab_size else a - 1
  tied = _with_column(model, b, a, factor)
  ref = sj.generate(tied, prompts, max_new_tokens=NEW).tokens
  where = [(r, i) for r, row in enumerate(ref) for i, t in enumerate(row) if t == a]
  assert where, "the planted token no longer appears: pick another"
  return tied, ref, where[0], b


@pytest.mark.parametrize("factor", [1.0, 1 - 2 ** -8], ids=["tie", "near-tie"])
def test_planted_tie_passes(target, prompts, factor):
  tied, ref, (r, i), b = _planted(target, prompts, factor)
  got = [list(row) for row in ref]
  got[r] = got[r][:i] + [b] + got[r][i + 1:]  # what a rounding flip at the tie would emit
  report = ex.check_greedy(tied, prompts, ref, got)
  assert report.ok, report.summary()
  (d,) = report.divergences
  assert (d.row, d.index, d.expected, d.got, d.verdict) == (r, i, ref[r][i], b, "tie")
  assert d.gap <= d.bound and d.top2_margin <= d.bound
  assert (d.gap == 0) == (factor == 1.0)  # the near-tie is not an exact one


def _worst_token_at(model, prompts, reference, row, i):
  """(reference's rows with token i of `row` replaced by the token with the lowest logit there,
  that token, the logits at that position)."""
  logits = ex.teacher_forced_logits(model, [prompts[row] + reference[row][:i + 1]],
                                    [len(prompts[row]) + i])[0]
  worst = int(np.argmin(logits))
  got = [list(t) for t in reference]
  got[row][i] = worst
  return got, worst, logits


def test_planted_real_divergence_fails(target, prompts, reference):
  """A token changed to the one with the lowest logit at its position fails; the report lists it
  with its margin, beside a row that diverges only in length."""
  row, i = 1, 4
  got, worst, logits = _worst_token_at(target, prompts, reference, row, i)
  got[2] = got[2][:-3]  # shorter: a length divergence
  report = ex.check_greedy(target, prompts, reference, got)
  assert not report.ok
  by_row = {d.row: d for d in report.divergences}
  assert set(by_row) == {1, 2}
  d = by_row[1]
  assert (d.index, d.expected, d.got, d.verdict) == (i, reference[row][i], worst, "failure")
  assert d.gap == pytest.approx(float(logits.max() - logits.min()), rel=1e-5) and d.gap > d.bound
  assert by_row[2].verdict == "length" and by_row[2].gap is None
  assert len(report.failures) == 2 and "failure" in report.summary()
  assert report.to_dict()["failures"] == 2


def test_float32_logits_ignore_the_runs_dtype(target, prompts, reference):
  """teacher_forced_logits computes in float32 from the bf16 weights: it equals the float32
  model made from those weights, not the bf16 forward."""
  from specjax.model import forward_sequence

  seq = prompts[0] + reference[0]
  got = ex.teacher_forced_logits(target, [seq], [len(seq) - 1])[0]
  f32 = ex.float32_model(target)
  with jax.default_matmul_precision("highest"):
    want = jax.jit(lambda p, t: forward_sequence(f32.config, f32.module(p), t)[0])(
        f32.params, np.array([seq]))[0, -2]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(f32.params))


# bf16 greedy decoding of a few methods, each built by name with random drafters: a copying
# method, a separate draft model, a tree of heads. (experiments/accelerator/run.py runs every
# registered method this way on a device.)
BF16_METHODS = ["prompt-lookup", "draft", "medusa"]


@pytest.mark.parametrize("name", BF16_METHODS)
def test_bf16_greedy_lossless_under_the_criterion(name, target, prompts, reference):
  method = ex.build_method(name, target)
  assert isinstance(method, sj.methods.get(name).cls)
  out = sj.generate(target, prompts, method, max_new_tokens=NEW)
  report = ex.check_greedy(target, prompts, reference, out.tokens)
  assert report.ok, report.summary()


def test_every_registered_method_has_check_settings(target):
  """build_method knows every registered method (the accelerator check builds them all)."""
  for name in sj.METHODS:
    assert isinstance(ex.method_options(name, target), dict)


def test_the_suites_greedy_assertion_off_the_cpu(target, prompts, reference, monkeypatch):
  """tests/methods/test_lossless.py's assertion: identity on the CPU; on an accelerator (jax's
  backend faked here) the criterion, so a planted near-tie passes and a real divergence still
  fails."""
  got, _, _ = _worst_token_at(target, prompts, reference, 1, 4)
  with pytest.raises(AssertionError):
    assert_same_greedy(target, prompts, reference, got)  # the CPU: identity
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert_same_greedy(target, prompts, reference, reference)
  with pytest.raises(AssertionError, match="failure"):
    assert_same_greedy(target, prompts, reference, got)
  tied, ref, (r, i), b = _planted(target, prompts, 1.0)
  flipped = [list(t) for t in ref]
  flipped[r] = flipped[r][:i] + [b] + flipped[r][i + 1:]  # an exact tie broken the other way
  assert_same_greedy(tied, prompts, ref, flipped)
