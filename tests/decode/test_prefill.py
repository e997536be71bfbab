"""The prefill's forward (specjax/decode/_prefill.py, `prompt_forward`): on a CPU a batch of
prompts runs packed end to end in chunks, and each row must get exactly the bits its prompt
gets alone (logits at its last token, its hidden states, its cache slots), in every arithmetic
the kernels make batch-invariant. Greedy identity of batched generation against one prompt at a
time is tests/methods/test_lossless.py's; this checks the rows' numbers directly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax import decode, packing
from specjax.decode import _prefill
from specjax.decode._method import Program
from specjax.heads import init_heads

from tests.helpers.gguf_files import write_gguf
from tests.helpers.models import tiny_model

LENGTHS = (5, 70, 17, 64, 1, 33)  # bucket 128: 768 padded rows, 190 packed (three chunks)


def _run(model, prompts, method):
  p = decode.bucket_prompt_len(max(map(len, prompts)))
  prog = Program(model.graphdef, model.config, method, p + 16, None)
  prompt = np.zeros((len(prompts), p), np.int32)
  for i, x in enumerate(prompts):
    prompt[i, :len(x)] = x
  cfg = model.config
  cache = sj.cache.init(cfg.num_layers, len(prompts), p + 16, cfg.num_kv_heads, cfg.head_dim,
                        jax.tree_util.tree_leaves(model.params)[0].dtype)

  @jax.jit
  def run(params, prompt, lengths, cache):
    return _prefill.prompt_forward(prog, params, prompt, lengths, cache)

  lengths = jnp.asarray([len(x) for x in prompts], jnp.int32)
  return jax.device_get(run(model.params, jnp.asarray(prompt), lengths, cache)), prog


def _assert_rows_alone(model, method=None):
  method = method or sj.methods.Autoregressive()
  rng = np.random.default_rng(3)
  prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in LENGTHS]
  (logits, hidden, cache), prog = _run(model, prompts, method)
  assert _prefill.packs(prog, len(prompts), hidden.shape[1])
  for r, x in enumerate(prompts):
    (lg, h, c), alone = _run(model, [x], method)
    assert not _prefill.packs(alone, 1, h.shape[1])
    n = len(x)
    np.testing.assert_array_equal(logits[r], lg[0], err_msg=f"row {r}: logits")
    np.testing.assert_array_equal(hidden[r, :n], h[0, :n], err_msg=f"row {r}: hidden")
    for i, (layer, one) in enumerate(zip(cache.layers, c.layers)):
      for name in layer:
        np.testing.assert_array_equal(layer[name][r, :, :n], one[name][0, :, :n],
                                      err_msg=f"row {r}: layer {i} {name}")


@pytest.mark.cpu_only  # packing is the CPU's (decode._prefill.packs)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_rows_have_the_bits_of_each_prompt_alone(dtype):
  model = sj.Model.random(tiny_model().config, seed=1, scale=0.3, dtype=jnp.dtype(dtype))
  _assert_rows_alone(packing.pack(model))


@pytest.mark.cpu_only
def test_a_row_sees_no_other_row():
  """Planted: with the mask's row test dropped, a packed token also sees the rows before it in
  the stream, and the rows differ from their prompts alone."""
  model = packing.pack(tiny_model(seed=1))
  with pytest.MonkeyPatch.context() as m:
    m.setattr(_prefill, "_stream_mask", lambda row, start, c: sj.cache.causal_mask(
        jnp.full((1,), start, jnp.int32), c, row.shape[0]))
    with pytest.raises(AssertionError, match="row 1"):
      _assert_rows_alone(model)


@pytest.mark.cpu_only
def test_packed_rows_with_taps_and_at_w4a8(tmp_path):
  """A method's taps (EAGLE's fused features ride in the hidden states) and the W4A8 target
  (int8 activations over the GGUF's blocks)."""
  model = packing.pack(tiny_model(seed=2))
  _assert_rows_alone(model, sj.Eagle(init_heads(model, "eagle", seed=0, taps=(1,)), depth=2,
                                     top_k=2, num_nodes=4))
  w4a8 = sj.load_model(write_gguf(tmp_path / "tiny.gguf"), tokenizer=False, weights="blocks",
                       activations="int8")
  _assert_rows_alone(w4a8)


@pytest.mark.cpu_only
def test_what_does_not_pack():
  """One row, rows that fit one chunk, a batch past PACK_MAX_SLOTS, or a sliding window shorter
  than the bucket (the packed cache's slots are not positions) run as before."""
  prog = lambda m: Program(m.graphdef, m.config, sj.methods.Autoregressive(), 160, None)  # noqa
  model = tiny_model(seed=1)
  assert _prefill.packs(prog(model), 2, 64) and not _prefill.packs(prog(model), 1, 128)
  assert not _prefill.packs(prog(model), 4, 16)
  assert not _prefill.packs(prog(model), 1000, 16)  # PACK_MAX_SLOTS: thousands of short rows
  windowed = tiny_model(seed=1, sliding_window=20)
  assert not _prefill.packs(prog(windowed), 4, 32) and _prefill.packs(prog(windowed), 4, 16 + 4)
