"""The autoregressive driver: bucketing without recompiles, batching, EOS, stats, and the
real-model batch check."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import specjax as sj
from specjax import decode

from tests.helpers.decode import Tally
from tests.helpers.models import assert_greedy, random_prompts, shared_prompts, tiny_model


def test_same_bucket_does_not_recompile(tiny):
  sj.generate(tiny, [[1, 2, 3, 4, 5]], max_new_tokens=8)
  before = decode.compile_cache.count
  out = sj.generate(tiny, [[7, 8, 9, 10, 11, 12, 13, 14, 15]], max_new_tokens=8)  # bucket 16 too
  assert decode.compile_cache.count == before
  assert out.stats["compile_time_s"] == 0.0
  # Sampling parameters and max_new_tokens inside its bucket are arrays: no recompile either.
  sj.generate(tiny, [[1, 2, 3]], max_new_tokens=7, temperature=0.8, top_k=5, top_p=0.9, seed=3)
  assert decode.compile_cache.count == before
  sj.generate(tiny, [list(range(1, 30))], max_new_tokens=8)  # bucket 32: a new program
  assert decode.compile_cache.count == before + 1


@pytest.mark.cpu_only  # the prefill is chunked on a CPU only (decode.prefill_chunk)
def test_long_prompts_prefill_in_chunks(monkeypatch):
  """On a CPU, past 64 rows, the prefill runs in chunks and stops after the longest row's last
  prompt token (decode.prefill_chunk): a 300- and a 270-token prompt (bucket 384; chunks of 64
  alone, of 32 as a batch of two) decode exactly as greedy autoregressive decoding of the model
  does, alone and batched, with a sliding window shorter than a chunk, and as with the prefill
  in one forward; a method that reads the prefill's hidden states (EAGLE's head state)
  stays exact."""
  from specjax.heads import init_heads

  chunks = {(p, b): decode.prefill_chunk(p, b)
            for p, b in ((16, 1), (64, 1), (128, 1), (384, 1), (384, 2), (384, 4), (384, 8))}
  assert list(chunks.values()) == [16, 64, 32, 64, 32, 16, 384]
  prompts = random_prompts(2, 61, seed=4, lo=270, hi=271)
  prompts[0] = prompts[0] + prompts[1][:30]  # 300 tokens
  model = tiny_model(seed=2, sliding_window=20)
  batched = sj.generate(model, prompts, max_new_tokens=6, stop_at_eos=False).tokens
  alone = [sj.generate(model, [p], max_new_tokens=6, stop_at_eos=False).tokens[0]
           for p in prompts]
  assert batched == alone
  assert_greedy(model, list(zip(prompts, batched)), 6)
  with monkeypatch.context() as m:
    m.setattr(decode._prefill, "prefill_chunk", lambda p, b: p)  # one forward over all 384 rows
    decode.compile_cache.clear()  # (compiled programs do not know the chunk size)
    assert sj.generate(model, prompts, max_new_tokens=6, stop_at_eos=False).tokens == batched
  decode.compile_cache.clear()
  eagle = sj.Eagle(init_heads(model, "eagle", seed=0), depth=2, top_k=2, num_nodes=4)
  assert sj.generate(model, prompts, eagle, max_new_tokens=6, stop_at_eos=False).tokens == batched


def test_eos_stops_row_and_is_included():
  model = tiny_model(seed=0)
  prompt = [5, 6, 7]
  free = sj.generate(model, [prompt], max_new_tokens=12).tokens[0]
  eos = free[4]
  first = free.index(eos)
  import dataclasses

  m2 = sj.Model(dataclasses.replace(model.config, eos_token_ids=(eos,)), model.graphdef,
                model.params, None, dtype=model.dtype)
  out = sj.generate(m2, [prompt, [9, 9, 9, 9, 9, 9]], max_new_tokens=12)
  assert out.tokens[0] == free[:first + 1]
  assert out.tokens[0][-1] == eos
  assert len(out.tokens[1]) <= 12
  out = sj.generate(m2, [prompt], max_new_tokens=12, stop_at_eos=False)
  assert out.tokens[0] == free


def test_max_new_tokens_and_stats(tiny):
  out = sj.generate(tiny, random_prompts(3, tiny.config.vocab_size, seed=5), max_new_tokens=9)
  assert [len(t) for t in out.tokens] == [9, 9, 9]
  s = out.stats
  assert s["new_tokens"] == 27 and s["mean_accepted"] == 1.0
  assert s["steps"] == 9 and s["target_calls_per_row"] == [9, 9, 9]
  for key in ("wall_time_s", "tokens_per_second", "compile_time_s"):
    assert s[key] >= 0


def test_text_prompts_need_tokenizer(tiny):
  with pytest.raises(sj.InputError, match="no tokenizer"):
    sj.generate(tiny, ["hello"], max_new_tokens=4)


@pytest.mark.slow
def test_smollm2_batch_rows_equal_alone(smollm2):
  prompts = shared_prompts(4, "mt_bench")
  # Four lengths in one prompt bucket (17-32): the rows pad differently, and the four runs alone
  # share one program.
  ids = [smollm2.tokenizer.encode(p)[: 17 + 5 * i] for i, p in enumerate(prompts)]
  assert len({len(x) for x in ids}) == 4
  assert len({decode.bucket_prompt_len(len(x)) for x in ids}) == 1
  batch = sj.generate(smollm2, ids, max_new_tokens=32, stop_at_eos=False)
  for i, p in enumerate(ids):
    alone = sj.generate(smollm2, [p], max_new_tokens=32, stop_at_eos=False)
    assert batch.tokens[i] == alone.tokens[0], f"row {i} differs in the batch"


@pytest.mark.slow
def test_smollm2_text_and_chat(smollm2):
  out = sj.generate(smollm2, ["What is the capital of France?"], max_new_tokens=16, chat=True)
  assert "Paris" in out.texts[0]


def test_compile_cache_is_bounded(tiny):
  """Past max_programs the cache (and jax's) is cleared, so compiled code cannot pile up until
  the OS refuses new memory mappings; the next call recompiles and gives the same tokens."""
  cache = decode.compile_cache
  old = cache.max_programs
  cache.clear()
  try:
    cache.max_programs = 2
    outs = [sj.generate(tiny, [[1, 2, 3]], max_new_tokens=n).tokens for n in (16, 32)]
    assert len(cache.programs) == 2
    sj.generate(tiny, [[1, 2, 3]], max_new_tokens=64)
    assert len(cache.programs) == 1  # cleared, then the new program added
    before = cache.count
    assert sj.generate(tiny, [[1, 2, 3]], max_new_tokens=16).tokens == outs[0]
    assert cache.count == before + 1  # recompiled after the clear
  finally:
    cache.max_programs = old


def test_compile_options_keep_the_elemental_emitters():
  """Every program that must be batch-invariant gets XLA's elemental emitters on CPU (the
  fusion emitters gave shape-dependent bits: specjax/compile_options.py)."""
  from specjax import compile_options

  assert compile_options.options() == {"xla_cpu_use_fusion_emitters": False}


# ----------------------------------------------------------------------------- the state's layout


def test_state_declares_its_layout():
  """Which fields are split by row is declared by DecodeState, not read off shapes."""
  layout = {f.name: f.metadata["layout"] for f in dataclasses.fields(decode.DecodeState)}
  assert {n for n, v in layout.items() if v == decode.REPLICATED} == {"key", "eos", "steps"}
  assert layout["method"] == layout["cache"] == layout["seq"] == decode.ROWS


def test_method_state_rows_and_replicated_leaves(tiny):
  """A method state's undeclared leaves are per-row [B, ...]; a leaf all rows share is declared
  replicated. One that is neither fails at trace time, on one device, naming where it is."""
  ps = random_prompts(3, tiny.config.vocab_size, seed=2)
  ref = sj.generate(tiny, ps, max_new_tokens=8)
  out = sj.generate(tiny, ps, Tally(), max_new_tokens=8)
  assert out.tokens == ref.tokens
  assert out.stats["tally"] == [c - 1 for c in out.stats["target_calls_per_row"]]
  with pytest.raises(ValueError, match=r"DecodeState\.method\['table'\] has shape \(4,\).*B=3"):
    sj.generate(tiny, ps, Tally(shared=False), max_new_tokens=8)
