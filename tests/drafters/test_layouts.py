"""Published drafter layouts (specjax/drafters): each written here with random weights in exactly
its layout (file names, tensor names, dtypes, config fields) for the tiny target, checked against a
small torch reference of the published architecture (sj.head_logits within 1e-4), run losslessly
(greedy identity with autoregressive decoding at batch 1 and 4), exported and read back."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

import specjax as sj
from specjax.drafters import export_heads, head_logits
from specjax.errors import InputError, WeightsError
from specjax.model import forward_sequence

from tests.helpers.layouts import _config, _eagle_config, _eagle_state, _medusa1_heads
from tests.helpers.models import assert_greedy, random_prompts, tiny_config
from tests.helpers.tinyhf import torch_decoder_layer

torch = pytest.importorskip("torch")
F = torch.nn.functional

TOKENS = np.array([5, 17, 3, 44, 8, 8, 60, 0, 12, 33, 21, 7], np.int32)


# The target over whole sequences, compiled once per shape: (logits [B,T,V], hidden [B,T,E]).
_forward = jax.jit(lambda target, params, tokens: forward_sequence(
    target.config, target.module(params), tokens)[:2], static_argnums=0)


def _features(target, tokens=TOKENS):
  """The target's final-normed hidden states [T,E] and its LM head [E,V], as torch tensors."""
  _, hidden = _forward(target, target.params, np.asarray(tokens)[None])
  lm = np.asarray(target.params["lm_head"][...])
  return torch.tensor(np.asarray(hidden[0])), torch.tensor(lm)


def _check_lossless(target, method, batches=(1, 4)):
  """Runs `method` at batch 1 and 4; every output must be what autoregressive greedy decoding
  emits (the target's argmax at each position, from one teacher-forced forward)."""
  for b in batches:
    prompts = random_prompts(b, target.config.vocab_size, seed=b)
    out = sj.generate(target, prompts, method, max_new_tokens=12)
    assert_greedy(target, list(zip(prompts, out.tokens)), 12)


# ----------------------------------------------------------------------------- Medusa-1


@pytest.fixture(scope="module")
def medusa1(tiny, tmp_path_factory):
  """medusa_lm_head.pt (float16, per-head LM heads, 3 heads of 2 shared blocks) + config.json."""
  d = str(tmp_path_factory.mktemp("medusa1"))
  heads = _medusa1_heads(32, 61, 3, 2).half()
  torch.save(heads.state_dict(), os.path.join(d, "medusa_lm_head.pt"))
  _config(d, medusa_num_heads=5, medusa_num_layers=2, base_model_name_or_path="tiny")
  return d, heads.float()


def test_medusa1_logits_match_reference(tiny, medusa1):
  d, ref = medusa1
  heads = sj.load_heads(d, tiny)
  assert heads.meta["layout"] == "medusa-1" and heads.config.num_heads == 3  # not config's 5
  hidden, _ = _features(tiny)
  with torch.no_grad():
    want = torch.stack([h(hidden) for h in ref], 1).numpy()  # [T,K,V]
  got = np.asarray(head_logits(tiny, heads, TOKENS))
  assert got.shape == (len(TOKENS), 3, 61)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
  _check_lossless(tiny, sj.Medusa(heads, acceptance="greedy", tree=[(0,), (1,), (0, 0), (0, 0, 0)]))


def test_medusa1_deduplicated_safetensors_without_lm_heads(tiny, tmp_path):
  """A newer file: bfloat16 safetensors, no per-head LM heads (the target's is used), saved by
  safetensors' save_model, which keeps one name of each shared block."""
  from safetensors.torch import save_model

  ref = _medusa1_heads(32, 61, 2, 3, lm_heads=False, seed=1).to(torch.bfloat16)
  save_model(ref, str(tmp_path / "medusa_lm_head.safetensors"))
  _config(str(tmp_path), medusa_num_heads=2, medusa_num_layers=3, base_model_name_or_path="tiny")
  heads = sj.load_heads(str(tmp_path), tiny)
  assert (heads.config.num_heads, heads.config.num_layers) == (2, 3) and "lm" not in heads.params
  hidden, lm = _features(tiny)
  with torch.no_grad():
    want = torch.stack([h.float()(hidden) @ lm for h in ref], 1).numpy()
  np.testing.assert_allclose(np.asarray(head_logits(tiny, heads, TOKENS)), want, atol=1e-4,
                             rtol=1e-4)


# ----------------------------------------------------------------------------- vLLM's Medusa


@pytest.fixture(scope="module")
def vllm_medusa(tiny, tmp_path_factory):
  """model.safetensors in vLLM's layout: 2 heads of 1 block without bias, LM heads over a
  truncated vocabulary of 40 tokens, and its token_map."""
  from safetensors.torch import save_file

  d = str(tmp_path_factory.mktemp("vllm"))
  g = torch.Generator().manual_seed(2)
  token_map = torch.randperm(61, generator=g)[:40]
  ts = {"token_map": token_map}
  for i in range(2):
    ts[f"blocks.{i}.layers.0.weight"] = torch.randn(32, 32, generator=g) * 0.3
    ts[f"lm_heads.{i}.weight"] = torch.randn(40, 32, generator=g) * 0.3
  save_file(ts, os.path.join(d, "model.safetensors"))
  _config(d, model_type="medusa", architectures=["MedusaModel"], hidden_size=32, vocab_size=61,
          num_heads=2, num_hidden_layers=1, truncated_vocab_size=40)
  return d, ts


def test_vllm_medusa_logits_match_reference(tiny, vllm_medusa):
  d, ts = vllm_medusa
  heads = sj.load_heads(d, tiny)
  assert heads.meta["layout"] == "medusa-vllm" and heads.config.vocab_subset == 40
  hidden, _ = _features(tiny)
  want = torch.full((len(TOKENS), 2, 61), -float("inf"))
  for i in range(2):  # vLLM's ResidualBlock, then its LM head scattered through token_map
    x = hidden + F.silu(hidden @ ts[f"blocks.{i}.layers.0.weight"].T)
    want[:, i, ts["token_map"]] = x @ ts[f"lm_heads.{i}.weight"].T
  got = np.asarray(head_logits(tiny, heads, TOKENS))
  np.testing.assert_array_equal(np.isinf(got), np.isinf(want.numpy()))
  np.testing.assert_allclose(got, want.numpy(), atol=1e-4, rtol=1e-4)
  # Batch 4 only (a compile less for CI): its Medusa step is medusa-1's, which runs at 1 and 4,
  # plus the vocabulary mapping.
  _check_lossless(tiny, sj.Medusa(heads, acceptance="greedy", tree=[(0,), (1,), (0, 0)]), (4,))


# ----------------------------------------------------------------------------- EAGLE-1/2


def _eagle_reference(sd, cfg, target, tokens=TOKENS):
  """EAGLE-1/2's draft step, from SafeAILab's architecture: fc over cat(embedding of token t + 1,
  feature t), one Llama decoder layer with no input norm (rotary, grouped kv heads, causal), no
  final norm, the target's LM head. -> logits [T-1,V]."""
  sd = {k: x.float() for k, x in sd.items()}
  hidden, lm = _features(target, tokens)
  table = torch.tensor(np.asarray(target.params["embed"][...]))  # the target's (SafeAILab's loader
  emb = table[torch.tensor(tokens[1:], dtype=torch.long)]  # copies it in; the file's is a copy)
  x = F.linear(torch.cat([emb, hidden[:-1]], -1), sd["fc.weight"], sd["fc.bias"])
  x = torch_decoder_layer(x, x, sd, "layers.0.", cfg)  # no input norm, no final norm
  return (x @ lm).numpy()


@pytest.fixture(scope="module")
def eagle(tiny, tmp_path_factory):
  """pytorch_model.bin (float16, with the embedding copy SafeAILab's files carry) + config.json."""
  d = str(tmp_path_factory.mktemp("eagle"))
  sd, cfg = _eagle_state(tiny), _eagle_config(tiny)
  torch.save(sd, os.path.join(d, "pytorch_model.bin"))
  _config(d, **cfg)
  return d, sd, cfg


def test_eagle_logits_match_reference(tiny, eagle):
  d, sd, cfg = eagle
  heads = sj.load_heads(d, tiny)
  assert heads.meta["layout"] == "eagle" and not heads.config.input_norm
  got = np.asarray(head_logits(tiny, heads, TOKENS))
  assert got.shape == (len(TOKENS) - 1, 61)
  np.testing.assert_allclose(got, _eagle_reference(sd, cfg, tiny), atol=1e-4, rtol=1e-4)
  _check_lossless(tiny, sj.Eagle(heads, acceptance="greedy", depth=3, top_k=2, num_nodes=6))


# ----------------------------------------------------------------------------- export


def test_export_import_round_trips_bit_exactly(tiny, medusa1, eagle, tmp_path):
  # Our own heads too: EAGLE heads trained in the published architecture (input_norm=False).
  ours = sj.init_heads(tiny, "eagle", input_norm=False, scale=0.3, seed=4)
  assert "layer.attn_norm.scale" not in ours.params and not ours.config.input_norm
  for i, (fmt, src) in enumerate((("medusa", medusa1[0]), ("eagle", eagle[0]), ("eagle", ours))):
    heads = sj.load_heads(src, tiny) if isinstance(src, str) else src
    out = export_heads(heads, fmt, str(tmp_path / f"{i}-{fmt}"), tiny)
    back = sj.load_heads(out, tiny)
    assert dataclasses.replace(back.config, target="") == dataclasses.replace(heads.config,
                                                                                target="")
    assert sorted(back.params) == sorted(heads.params)
    for name, x in heads.params.items():
      assert np.array_equal(np.asarray(back.params[name]), np.asarray(x)), (fmt, name)
  # The exported EAGLE head is read back by the reference, from its own files.
  from safetensors.torch import load_file

  sd = load_file(str(tmp_path / "1-eagle" / "model.safetensors"))
  sd["embed_tokens.weight"] = eagle[1]["embed_tokens.weight"]
  with open(tmp_path / "1-eagle" / "config.json") as f:
    cfg = json.load(f)
  np.testing.assert_allclose(_eagle_reference(sd, cfg, tiny),
                             _eagle_reference(eagle[1], eagle[2], tiny), atol=1e-5)


def test_specjax_export_command(tiny, medusa1, tmp_path, capsys):
  from specjax import cli
  from specjax.heads import save_heads

  ours = save_heads(sj.load_heads(medusa1[0], tiny), str(tmp_path / "heads.npz"))
  cli.main(["export", "--format", "medusa", ours, str(tmp_path / "out")])
  assert capsys.readouterr().out.strip() == str(tmp_path / "out")
  back, want = sj.load_heads(str(tmp_path / "out"), tiny), sj.load_heads(ours, tiny)
  assert back.meta["layout"] == "medusa-1" and sorted(back.params) == ["b", "lm", "w"]
  for name, x in want.params.items():
    assert np.array_equal(np.asarray(back.params[name]), np.asarray(x)), name


def test_export_refuses_what_the_layout_cannot_hold(tiny, medusa1, eagle, tmp_path):
  with pytest.raises(InputError, match="normalise their layer's input"):
    export_heads(sj.init_heads(tiny, "eagle"), "eagle", str(tmp_path), tiny)
  with pytest.raises(InputError, match="input_norm=False: True, or False for EAGLE heads"):
    sj.init_heads(tiny, "mtp", input_norm=False)
  medusa = sj.load_heads(medusa1[0], tiny)
  with pytest.raises(InputError, match="vocabulary subset"):
    export_heads(dataclasses.replace(medusa, vocab=np.arange(10)), "medusa", str(tmp_path))
  with pytest.raises(InputError, match="format='eagle', but these are medusa heads"):
    export_heads(medusa, "eagle", str(tmp_path), tiny)


# ----------------------------------------------------------------------------- bad input


def _stand_in(**kw):
  """A target of another size: its config is all that loading checks (no weights built)."""
  return sj.Model(tiny_config(**kw), None, None)


def test_heads_for_another_target_name_both_sizes(medusa1, eagle):
  narrow = _stand_in(hidden_size=16, head_dim=4, intermediate_size=24)
  with pytest.raises(InputError, match=r"width 32.*width 16"):
    sj.load_heads(medusa1[0], narrow)
  with pytest.raises(InputError, match=r"width 32.*width 16"):
    sj.load_heads(eagle[0], narrow)
  small_vocab = _stand_in(vocab_size=50)
  with pytest.raises(InputError, match=r"vocabulary 61.*vocabulary 50"):
    sj.load_heads(medusa1[0], small_vocab)
  with pytest.raises(InputError, match=r"vocabulary 61.*vocabulary 50"):
    sj.load_heads(eagle[0], small_vocab)


def test_a_missing_tensor_is_named(tiny, eagle, tmp_path):
  sd = {k: v for k, v in eagle[1].items() if k != "layers.0.mlp.down_proj.weight"}
  torch.save(sd, tmp_path / "pytorch_model.bin")
  _config(str(tmp_path), **eagle[2])
  with pytest.raises(WeightsError, match="missing tensor 'layers.0.mlp.down_proj.weight'"):
    sj.load_heads(str(tmp_path), tiny)
  heads = _medusa1_heads(32, 61, 2, 1).state_dict()
  del heads["1.0.linear.bias"]
  torch.save(heads, tmp_path / "medusa.pt")
  with pytest.raises(WeightsError, match="missing tensor '1.0.linear.bias'"):
    sj.load_heads(str(tmp_path / "medusa.pt"), tiny)


class _Payload:
  """A pickled object that would create a directory when unpickled by a full unpickler."""

  def __init__(self, path):
    self.path = path

  def __reduce__(self):
    return (os.makedirs, (self.path,))


def test_pickles_holding_anything_but_tensors_are_refused(tiny, tmp_path):
  marker = str(tmp_path / "unpickled")
  torch.save({"0.0.linear.weight": torch.zeros(32, 32), "x": _Payload(marker)},
             tmp_path / "evil.pt")
  with pytest.raises(WeightsError, match="refused"):
    sj.load_heads(str(tmp_path / "evil.pt"), tiny)
  assert not os.path.exists(marker)
  torch.save({"0.0.linear.weight": torch.zeros(32, 32), "note": "hello"}, tmp_path / "str.pt")
  with pytest.raises(WeightsError, match="refused: entry 'note' is a str"):
    sj.load_heads(str(tmp_path / "str.pt"), tiny)


def test_an_unknown_layout_lists_the_recognised_ones(tiny, eagle, tmp_path):
  from safetensors.torch import save_file

  save_file({"encoder.weight": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
  with pytest.raises(WeightsError, match=r"not a recognised drafter layout.*medusa-1.*"
                                         r"medusa-vllm.*eagle"):
    sj.load_heads(str(tmp_path), tiny)
  with pytest.raises(InputError, match="tokens"):
    head_logits(tiny, sj.load_heads(eagle[0], tiny), [3])
