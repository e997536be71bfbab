"""PARD (methods/pard.py, training/pard.py): a draft that fills mask tokens drafts a chain in one
forward. The lossless suite covers its decoding (tests/helpers/lossless.py, "pard/..."); here the
window each round feeds (it must rewrite what the last round's masks left in the draft's cache),
the training layout (it must be the window decoding feeds), the sizing from the asset's numbers,
and bad input."""

from __future__ import annotations

import numpy as np
import pytest

import specjax as sj
from specjax import cache as kv
from specjax.errors import InputError
from specjax.methods import defaults
from specjax.model import forward_sequence
from specjax.training.pard import block_labels, blocks_layout

from tests.helpers.models import tiny_model

GAMMA = 3


@pytest.fixture(scope="module")
def pair():
  target = tiny_model(seed=0)
  return target, tiny_model(seed=7, scale=0.15, vocab_size=target.config.vocab_size)


def _fresh_logits(draft, tokens, at):
  """The draft's logits at positions `at` of one causal forward over `tokens` from position 0."""
  logits, _, _ = forward_sequence(draft.config, draft.module(draft.params),
                                  np.asarray([tokens], np.int32))
  return np.asarray(logits[0])[at]


def test_each_round_rewrites_what_the_last_round_left(pair):
  """A round's forward reads a draft cache whose slots from the window's start on hold another
  sequence's entries (the last round's masks, its rejected drafts): q_1 .. q_gamma equal a fresh
  forward over the committed tokens and gamma - 1 masks, for sequences shorter than the window
  (which then starts at slot 0) and longer."""
  target, draft = pair
  v = target.config.vocab_size
  method = sj.ParallelDraft(draft, gamma=GAMMA, mask_token_id=v - 1)
  rng = np.random.default_rng(0)
  b, s = 4, 32
  seq = rng.integers(0, v - 1, (b, s)).astype(np.int32)
  seq_len = np.array([1, 3, 9, 20], np.int32)
  start = np.maximum(seq_len - (GAMMA + 1), 0)
  # Slots before each row's window hold its prefix's entries, every later slot another text's.
  mixed = np.where(np.arange(s)[None, :] < start[:, None], seq, rng.integers(0, v - 1, (b, s)))
  c = draft.config
  dcache = kv.init(c.num_layers, b, s + method.extra_room, c.num_kv_heads, c.head_dim)
  _, _, dcache = forward_sequence(c, draft.module(draft.params), np.asarray(mixed, np.int32),
                                  cache=dcache)
  logits, _ = method.block_logits(method.arrays(target), dcache, seq, seq_len)
  assert logits.shape == (b, GAMMA, v)
  for r in range(b):
    n = int(seq_len[r])
    want = _fresh_logits(draft, list(seq[r, :n]) + [v - 1] * (GAMMA - 1),
                         n - 1 + np.arange(GAMMA))
    np.testing.assert_allclose(np.asarray(logits[r]), want, rtol=1e-5, atol=1e-5,
                               err_msg=f"row {r} (length {n})")


def test_training_sees_the_window_decoding_feeds(pair):
  """The trainer's layout (the window, then each anchor's masks after it): a real token's output
  is the plain causal forward's, and anchor a's j-th mask gives what decoding's forward over
  [x_0 .. x_a, m, .., m] gives at position a + j, whatever the tokens after a are."""
  _, draft = pair
  v, k = draft.config.vocab_size, 4
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, v - 1, (2, 12)).astype(np.int32)
  anchors = np.array([[2, 7, 10], [0, 5, 11]], np.int32)
  ext, pos, mask = blocks_layout(tokens, anchors, k, v - 1)
  assert ext.shape == (2, 12 + 3 * (k - 1)) and mask.shape == (2, ext.shape[1], ext.shape[1])
  c = draft.config
  cache = kv.init(c.num_layers, 2, ext.shape[1], c.num_kv_heads, c.head_dim)
  logits, _, _ = draft.module(draft.params)(ext, pos, cache, mask, empty_cache=True)
  logits = np.asarray(logits)
  for r in range(2):
    np.testing.assert_allclose(logits[r, :12], _fresh_logits(draft, tokens[r], np.arange(12)),
                               rtol=1e-5, atol=1e-5)
    for i, a in enumerate(anchors[r]):
      want = _fresh_logits(draft, list(tokens[r, :a + 1]) + [v - 1] * (k - 1), a + np.arange(1, k))
      got = logits[r, 12 + i * (k - 1):12 + (i + 1) * (k - 1)]
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"row {r} anchor {a}")
  # Labels per anchor: offset j + 1 is the label at a + j, -1 past the window.
  labels = np.arange(24, dtype=np.int32).reshape(2, 12)
  got = np.asarray(block_labels(labels, anchors, k))
  assert got[0, 0].tolist() == [2, 3, 4, 5] and got[1, 2].tolist() == [23, -1, -1, -1]


def _with_header(model, header):
  model.asset_header = header
  return model


def test_gamma_from_the_assets_per_offset_agreement(pair):
  """Left out, gamma comes from the cost curve and the asset's held-out top1_k (as DFlash's block
  does), at most its trained block; an agreement that falls off at offset 3 stops the chain
  there, and more offsets are never chosen than the asset records."""
  target, _ = pair
  v = target.config.vocab_size
  draft = _with_header(tiny_model(seed=7, scale=0.15, vocab_size=v), {
      "parallel": {"block_size": 6, "mask_token_id": v - 1},
      "held_out": {"top1_0": 0.9, "top1_1": 0.9, "top1_2": 0.01, "top1_3": 0.01, "top1_4": 0.01,
                   "top1_5": 0.01}})
  cost = {1: 1.0, 64: 7.3}  # each verified token costs a tenth of a forward more
  choice = defaults.pard_gamma(target, draft, cost)
  assert choice.settings == {"gamma": 2}, choice
  draft.asset_header["held_out"].update(top1_2=0.9, top1_3=0.9, top1_4=0.9, top1_5=0.9)
  assert defaults.pard_gamma(target, draft, cost).settings == {"gamma": 6}
  method = sj.ParallelDraft(draft)
  assert method.mask_token_id == v - 1 and "gamma" in method.left_out
  assert 1 <= method.prepare(target).gamma <= 6


def test_bad_input_is_named(pair):
  target, draft = pair
  v = target.config.vocab_size
  with pytest.raises(InputError, match="needs mask_token_id"):
    sj.ParallelDraft(draft, gamma=2)
  with pytest.raises(InputError, match="mask_token_id"):
    sj.ParallelDraft(draft, gamma=2, mask_token_id=v)
  trained = _with_header(tiny_model(seed=7, scale=0.15, vocab_size=v),
                         {"parallel": {"block_size": 4, "mask_token_id": v - 1}})
  with pytest.raises(InputError, match="trained to draft blocks of 4"):
    sj.ParallelDraft(trained, gamma=5)
  with pytest.raises(InputError, match="no shipped pard"):
    sj.generate(tiny_model(seed=0), [[1, 2, 3]], "pard", max_new_tokens=2)


@pytest.mark.slow
def test_shipped_smollm2_pard(smollm2):
  """The shipped parallel draft fits SmolLM2, records its block, mask token and held-out
  per-offset agreement, and decodes exactly: greedy at batch 2 with a chain of 4 and by name
  with its cost-curve gamma, its masks accepted beyond the first offset."""
  d = sj.load_model("smollm2-135m-pard", target=smollm2)
  header = d.asset_header
  assert header["parallel"]["block_size"] == 8 and header["parallel"]["mask_token_id"] == 3
  assert header["init"] == "smollm2-135m-draft" and header["corpus"]["model"]
  held = header["held_out"]
  assert held["top1_0"] > 0.3 and held["top1_1"] > 0.1
  prompts = ["Write a haiku about the sea.", "def fibonacci(n):"]
  ref = sj.generate(smollm2, prompts, max_new_tokens=32, chat=True).tokens
  out = sj.generate(smollm2, prompts, sj.ParallelDraft(d, gamma=4), max_new_tokens=32, chat=True)
  assert out.tokens == ref
  assert max(out.stats["accept_hist"][3:]) > 0, out.stats  # three or more tokens in one step
  assert sj.generate(smollm2, prompts[:1], "pard", max_new_tokens=32,
                     chat=True).tokens == ref[:1]


def test_cost_ratio_times_the_rounds_one_forward(pair, monkeypatch):
  """calibrate.measure_cost_ratio times a parallel draft's round as it runs: one forward over
  its window (block_logits), not a one-token draft forward."""
  from specjax import calibrate

  target, draft = pair
  method = sj.ParallelDraft(draft, gamma=GAMMA, mask_token_id=target.config.vocab_size - 1)
  monkeypatch.setattr(type(method), "_draft_forward",
                      lambda *a, **k: pytest.fail("timed a one-token draft forward"))
  r = calibrate.measure_cost_ratio(target, method, cache_len=64, reps=2)
  assert r["draft"] == "one forward a round" and r["c"] > 0 and r["verify_over_step"] > 0
