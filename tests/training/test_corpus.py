"""training/corpus.py and prompt_pool.py: resumable shards, the reader's splits and windows, errors."""

from __future__ import annotations

import os

import numpy as np
import pytest

import specjax as sj
from specjax.errors import InputError
from specjax.training import corpus, prompt_pool

from tests.helpers.models import tiny_model


class ByteTokenizer:
  """Enough of a tokenizer for corpus tests: bytes -> ids, a fixed chat wrapper, an EOS id."""
  chat_template = "[1, 2] + ids[:40] + [3]"  # what apply_chat_template below does

  def __init__(self, vocab: int):
    self.vocab, self.eos_token_id, self.name_or_path = vocab, vocab - 1, "bytes"

  def encode(self, text):
    return [b % (self.vocab - 1) for b in text.encode()]

  def decode(self, ids, skip_special_tokens=True):
    return "".join(chr(32 + i % 90) for i in ids)

  def apply_chat_template(self, msgs, add_generation_prompt=True, tokenize=True):
    return [1, 2] + self.encode(msgs[0]["content"])[:40] + [3]


POOL = [{"text": f"Question number {i}: tell me about item {i * 7}.", "chat": i % 3 != 0,
         "source": "test"} for i in range(40)]


def text_model(seed=0):
  m = tiny_model(seed=seed, vocab_size=300, eos_token_ids=(299,))
  m.tokenizer = ByteTokenizer(300)
  m.name = "tiny-text"
  return m


def make(model, d, **kw):
  args = dict(tokens=200, batch_size=4, max_new_tokens=12, pool=POOL, progress=False, seed=3)
  args.update(kw)
  return corpus.generate_corpus(model, str(d), **args)


class Stop(Exception):
  pass


def test_interrupted_run_resumes_to_the_identical_corpus(tmp_path):
  model = text_model()
  full = make(model, tmp_path / "full")
  assert full.num_response_tokens >= 200 and len(full) % 4 == 0

  def kill_after_second(i, shard):
    if i == 1:
      raise Stop

  with pytest.raises(Stop):
    make(model, tmp_path / "cut", on_shard=kill_after_second)
  names = sorted(os.listdir(tmp_path / "cut"))
  assert names == ["meta.json", "shard-00000.npz", "shard-00001.npz"], names  # no half shard
  resumed = make(model, tmp_path / "cut")
  assert np.array_equal(resumed.tokens, full.tokens)
  assert np.array_equal(resumed.offsets, full.offsets)
  assert np.array_equal(resumed.prompt_lens, full.prompt_lens)
  assert resumed.tokens.dtype == np.uint16
  # Rows really are the target's own greedy / sampled continuations of their prompts.
  toks, p = full.sequence(0)
  assert full.extra["temperature"][0] == 0.0
  ref = sj.generate(model, [toks[:p].tolist()], max_new_tokens=12).tokens[0]
  assert toks[p:].tolist() == ref


def test_micro_batches_keep_each_row_with_its_prompt(tmp_path):
  """A shard decoded in length-sorted micro-batches: row j still holds pool prompt idx[j] and its
  own continuation (greedy rows equal decoding that prompt alone), and the shard records mb."""
  from specjax.decode import _encode

  model = text_model()
  pool = [{"text": "x" * (5 + 11 * ((7 * i) % 6)), "chat": False, "source": "test"}
          for i in range(12)]  # prompt lengths 5..60, interleaved
  c = make(model, tmp_path, tokens=1, batch_size=6, micro_batch=2, pool=pool,
           temperatures=(0.0,))
  assert len(c) == 6 and np.load(tmp_path / "shard-00000.npz")["micro_batch"] == 2
  for j in range(6):
    toks, p = c.sequence(j)
    prompt = _encode(model, [pool[c.extra["pool_index"][j]]["text"]], False)[0]
    assert toks[:p].tolist() == prompt
    assert toks[p:].tolist() == sj.generate(model, [prompt], max_new_tokens=12).tokens[0]


def test_tokenizer_without_a_chat_template_gets_raw_prompts(tmp_path):
  model = text_model()
  model.tokenizer = type("Raw", (ByteTokenizer,), {"chat_template": None})(300)
  c = make(model, tmp_path, tokens=1, batch_size=4, temperatures=(0.0,))
  assert c.meta["raw_prompts"] is True
  for j in range(4):  # a chat prompt of the pool, tokenised as plain text (no [1, 2] wrapper)
    toks, p = c.sequence(j)
    assert toks[:p].tolist() == model.tokenizer.encode(POOL[c.extra["pool_index"][j]]["text"])
  assert "raw_prompts" not in make(text_model(), tmp_path / "chat", tokens=1).meta


def test_resume_with_other_settings_raises(tmp_path):
  model = text_model()
  make(model, tmp_path, tokens=20)
  with pytest.raises(InputError, match="other settings.*max_new_tokens"):
    make(model, tmp_path, tokens=40, max_new_tokens=8)


@pytest.mark.parametrize("kw,match", [
    (dict(tokens=0), "tokens=0"), (dict(tokens="lots"), "tokens='lots'"),
    (dict(batch_size=0), "batch_size=0"), (dict(micro_batch=0), "micro_batch=0"),
    (dict(temperatures=(-1.0,)), "temperatures"),
])
def test_bad_arguments(tmp_path, kw, match):
  with pytest.raises(InputError, match=match):
    make(text_model(), tmp_path, **kw)
  assert not os.path.exists(tmp_path / "shard-00000.npz")


def test_unwritable_directory(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("x")
  with pytest.raises(InputError, match="not a writable directory"):
    make(text_model(), blocker / "corpus")


def test_unknown_model(tmp_path):
  with pytest.raises(sj.ModelNotFoundError):
    corpus.generate_corpus("no-such-model", str(tmp_path), tokens=10, progress=False, pool=POOL)


def test_model_without_tokenizer(tmp_path):
  with pytest.raises(InputError, match="no tokenizer"):
    corpus.generate_corpus(tiny_model(), str(tmp_path), tokens=10, progress=False, pool=POOL)


def test_corpus_from_another_vocabulary(tmp_path):
  c = make(text_model(), tmp_path, tokens=20)
  c.check_compatible(text_model())
  import warnings

  from specjax import packing
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # the kernel's packed copies are not other weights
    c.check_compatible(packing.pack(text_model(), warn=False))
  with pytest.raises(InputError, match="vocab_size=300.*vocab_size=61"):
    c.check_compatible(tiny_model())
  with pytest.warns(UserWarning, match="other weights"):
    c.check_compatible(text_model(seed=5))


def test_not_a_corpus(tmp_path):
  with pytest.raises(InputError, match="not a corpus directory"):
    corpus.load(str(tmp_path))


def test_windows_split_and_mask(tmp_path):
  c = make(text_model(), tmp_path, tokens=300)
  held = c.split(held_out=0.3, seed=1)
  assert 0 < held.sum() < len(c)
  seq_len = 16
  for split, chosen in (("train", ~held), ("heldout", held)):
    tok, mask = c.windows(seq_len, split, held_out=0.3, seed=1)
    # Rebuild the expected transitions (prev, next) that are response tokens, per split.
    want = []
    for i in np.flatnonzero(chosen):
      s, p = c.sequence(i)
      want += [(int(s[j]), int(s[j + 1])) for j in range(max(p - 1, 0), len(s) - 1)]
    got = [(int(tok[w, t]), int(tok[w, t + 1])) for w, t in zip(*np.nonzero(mask))]
    assert sorted(got) == sorted(want)  # every response transition exactly once, nothing else
  # Held-out windows come from other sequences than training windows.
  train_seqs = {tuple(c.sequence(i)[0]) for i in np.flatnonzero(~held)}
  assert not any(tuple(c.sequence(i)[0]) in train_seqs for i in np.flatnonzero(held))
  with pytest.raises(InputError, match="split='test'"):
    c.windows(seq_len, "test")
  with pytest.raises(InputError, match="seq_len=1"):
    c.windows(1)


def test_parse_count():
  assert corpus.parse_count("2M") == 2_000_000
  assert corpus.parse_count("500k") == 500_000
  assert corpus.parse_count(1234) == 1234


def test_prompt_pool_mix_and_decontamination():
  items, info = prompt_pool.build(0, banned=set())
  assert info["decontaminated_dropped"] == 0
  assert {"topics", "code", "code-raw", "prose"} <= set(info["sources"])
  # A prefix of the pool has the configured mix.
  head = [it["source"] for it in items[:400]]
  assert abs(head.count("topics") / 400 - prompt_pool.WEIGHTS["topics"]) < 0.05
  # A 13-word sequence shared with an "evaluation" prompt removes exactly the prompts that hold it.
  victim = items[0]["text"]
  banned = prompt_pool._ngrams(victim)
  kept, info2 = prompt_pool.build(0, banned=banned)
  assert info2["decontaminated_dropped"] >= 1
  assert victim not in {it["text"] for it in kept}
  assert len(kept) + info2["decontaminated_dropped"] == len(items)


def test_cli_data_errors(capsys, tmp_path):
  from specjax import cli

  with pytest.raises(SystemExit) as e:
    cli.main(["data", "generate", "--out", str(tmp_path), "--tokens", "0"])
  assert e.value.code == 2
  assert "--tokens '0' is invalid" in capsys.readouterr().err
