"""Drafters beside a target on a GGUF's blocks run on blocks of their own
(packing.drafter_qtype, Q8_0 by default): a draft model rounded by packing.to_blocks, the dense
products of EAGLE / MTP modules, and every vocabulary subset's head rows. Their drafts change a
little, never the output: greedy decoding stays autoregressive decoding's; and the defaults
count a drafter's cost in the bytes it reads."""

from __future__ import annotations

import numpy as np
import pytest

import specjax as sj
from specjax import packing
from specjax.errors import InputError
from specjax.methods import defaults
from specjax.methods.features import head_arrays

from tests.helpers.gguf_files import write_gguf
from tests.helpers.models import random_prompts

SUBSET = np.arange(0, 128, 2)  # 64 rows: whole Q8_0 blocks along E = 64


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
  return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def target(gguf):
  return sj.load_model(gguf, tokenizer=False, weights="blocks")


def prompts():
  return [p + p for p in random_prompts(4, 128, seed=2, lo=3, hi=12)]


def test_the_block_type_follows_the_target_and_the_environment(gguf, target, monkeypatch):
  monkeypatch.delenv(packing.DRAFTER_ENV, raising=False)
  assert packing.drafter_qtype(target) == "Q8_0"
  assert packing.drafter_bytes(target) == 34 / 32
  assert packing.drafter_qtype(sj.load_model(gguf, tokenizer=False)) is None  # float32 target
  monkeypatch.setenv(packing.DRAFTER_ENV, "0")
  assert packing.drafter_qtype(target) is None and packing.drafter_bytes(target) == 4.0
  monkeypatch.setenv(packing.DRAFTER_ENV, "q4_1")
  assert packing.drafter_qtype(target) == "Q4_1"
  monkeypatch.setenv(packing.DRAFTER_ENV, "Q5_K")
  with pytest.raises(InputError, match=r"\$SPECJAX_DRAFTER_BLOCKS='Q5_K' is invalid"):
    packing.drafter_qtype(target)


def test_the_defaults_count_bytes(target, monkeypatch):
  """A target on Q4_1 layers and a Q8_0 head reads 20/32 and 34/32 bytes a weight; a drafter's
  own layer costs its Q8_0 bytes (34/32), or float32's with the environment's 0."""
  monkeypatch.delenv(packing.DRAFTER_ENV, raising=False)
  lb, hb = packing.dense_bytes(target)
  assert abs(lb - 20 / 32) < 0.03 and abs(hb - 34 / 32) < 0.03
  c = target.config
  layer = defaults._layer(c)
  full = c.num_layers * layer * lb + c.hidden_size * c.vocab_size * hb
  assert defaults.reads(target, 1, rows=64) == pytest.approx(
      (layer + 64 * c.hidden_size) * 34 / 32 / full)
  assert defaults.reads(target, 1, rows=c.vocab_size) == pytest.approx(
      (layer * 34 / 32 + c.vocab_size * c.hidden_size * hb) / full)
  assert defaults.reads(target, 1, rows=c.vocab_size, own=False) == pytest.approx(
      (layer * lb + c.vocab_size * c.hidden_size * hb) / full)
  monkeypatch.setenv(packing.DRAFTER_ENV, "0")
  assert defaults.reads(target, 1) == pytest.approx(layer * 4.0 / full)


@pytest.mark.parametrize("kind", ["eagle", "mtp"])
def test_feature_modules_run_on_blocks_and_stay_lossless(target, kind, monkeypatch):
  monkeypatch.delenv(packing.DRAFTER_ENV, raising=False)
  heads = sj.init_heads(target, kind, vocab=SUBSET, seed=1, scale=0.3)
  arrays = head_arrays(heads, target)
  assert all(p.dtype == np.uint8 for p in arrays["mods"][0]["packed"].values())
  assert arrays[packing.PREFIX + "head"].dtype == np.uint8
  ref = sj.generate(target, prompts(), max_new_tokens=16).tokens
  method = (sj.Eagle(heads, tree="dynamic", depth=2, top_k=2, num_nodes=4) if kind == "eagle"
            else sj.MTP(heads))
  assert sj.generate(target, prompts(), method, max_new_tokens=16).tokens == ref
  monkeypatch.setenv(packing.DRAFTER_ENV, "0")
  floats = head_arrays(heads, target)
  assert all(p.dtype == np.float32 for p in floats["mods"][0]["packed"].values())


def test_medusa_subset_and_a_draft_model_on_blocks_stay_lossless(target, monkeypatch):
  monkeypatch.delenv(packing.DRAFTER_ENV, raising=False)
  ref = sj.generate(target, prompts(), max_new_tokens=16).tokens
  medusa = sj.Medusa(sj.init_heads(target, "medusa", vocab=SUBSET, seed=1, scale=0.3))
  assert sj.generate(target, prompts(), medusa, max_new_tokens=16).tokens == ref
  # A float32 draft (another model of the target's shape) rounded to blocks of its own.
  other = sj.Model.random(target.config, seed=3, scale=0.3)
  draft = packing.to_blocks(packing.maybe_pack(other, None), packing.drafter_qtype(target))
  out = sj.generate(target, prompts(), sj.DraftModel(draft, gamma=3, vocab=SUBSET),
                    max_new_tokens=16)
  assert out.tokens == ref


def test_a_dflash_drafter_runs_on_blocks_and_stays_lossless(target, monkeypatch):
  """DFlash's drafter (fc and each layer's seven products) runs on the kernel beside a packed
  target: Q8_0 blocks of its own beside a target on blocks (float32 kernel copies with the
  environment's 0), its float weights then the blocks' values; greedy decoding stays
  autoregressive decoding's, chain and tree."""
  monkeypatch.delenv(packing.DRAFTER_ENV, raising=False)
  heads = sj.init_heads(target, "dflash", mask_token_id=127, block_size=4, seed=4, scale=0.3)
  method = sj.DFlash(heads, block_size=4)
  arrays = method.arrays(target)
  names = [n for n in heads.params if n.split(".")[-1] in
           ("fc", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")]
  assert sorted(arrays["packed"]) == sorted(names) and len(names) == 1 + 7 * len(
      [n for n in names if n.endswith(".wq")])
  assert all(p.dtype == np.uint8 for p in arrays["packed"].values())
  w = np.asarray(heads.params["layers.0.w_up"])
  rounded = np.asarray(arrays["p"]["layers.0.w_up"])
  assert not np.array_equal(rounded, w) and np.abs(rounded - w).max() <= np.abs(w).max() / 100
  ref = sj.generate(target, prompts(), max_new_tokens=16).tokens
  assert sj.generate(target, prompts(), method, max_new_tokens=16).tokens == ref
  tree = sj.DFlash(heads, tree=[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
  assert sj.generate(target, prompts(), tree, max_new_tokens=16).tokens == ref
  monkeypatch.setenv(packing.DRAFTER_ENV, "0")
  floats = sj.DFlash(heads, block_size=4).arrays(target)
  assert all(p.dtype == np.float32 for p in floats["packed"].values())
  np.testing.assert_array_equal(np.asarray(floats["p"]["layers.0.w_up"]), w)
