"""EAGLE-3 heads (specjax/heads.py kind "eagle3", specjax/drafters' "eagle3" layout).

Random weights written in exactly SafeAILab's EAGLE-3 layout (pytorch_model.bin: float16 tensors,
int64 d2t, bool t2d; a Llama config.json with draft_vocab_size) for a tiny random transformers
Llama of 7 layers (taps 2, 3, 4), checked against a torch reference of the published architecture
written here, whose target features are transformers' own hidden states; then decoded with
sj.Eagle (chain and dynamic tree, greedy identity with autoregressive decoding at batch 1 and 4,
the sampling distribution), exported and read back."""

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

from tests.helpers.models import random_prompts
from tests.helpers.tinyhf import random_llama, torch_decoder_layer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
F = torch.nn.functional

E, V, VD, LAYERS = 32, 61, 40, 7
TOKENS = np.array([5, 17, 3, 44, 8, 8, 60, 0, 12, 33, 21, 7], np.int32)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
  """A tiny random transformers Llama (saved, and the module itself for the reference)."""
  return random_llama(str(tmp_path_factory.mktemp("target")), layers=LAYERS, vocab_size=V,
                      hidden=E)


@pytest.fixture(scope="module")
def target(hf):
  return sj.load_model(hf[0], tokenizer=False)


def _state(seed=0):
  """An EAGLE-3 head's tensors (SafeAILab's names and dtypes) with a draft vocabulary of VD
  tokens: float16 weights, d2t int64, t2d bool."""
  g = torch.Generator().manual_seed(seed)
  r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
  h, kv, d, f = 4, 2, 8, 48
  p = "midlayer."
  sd = {"fc.weight": r(E, 3 * E),
        p + "input_layernorm.weight": 1 + r(E), p + "hidden_norm.weight": 1 + r(E),
        p + "self_attn.q_proj.weight": r(h * d, 2 * E),
        p + "self_attn.k_proj.weight": r(kv * d, 2 * E),
        p + "self_attn.v_proj.weight": r(kv * d, 2 * E), p + "self_attn.o_proj.weight": r(E, h * d),
        p + "post_attention_layernorm.weight": 1 + r(E),
        p + "mlp.gate_proj.weight": r(f, E), p + "mlp.up_proj.weight": r(f, E),
        p + "mlp.down_proj.weight": r(E, f),
        "norm.weight": 1 + r(E), "lm_head.weight": r(VD, E) * 5}
  sd = {k: x.half() for k, x in sd.items()}
  ids = torch.sort(torch.randperm(V, generator=g)[:VD]).values  # the draft vocabulary, ascending
  sd["d2t"] = (ids - torch.arange(VD)).to(torch.int64)
  t2d = torch.zeros(V, dtype=torch.bool)
  t2d[ids] = True
  sd["t2d"] = t2d
  return sd


def _config(**kw):
  cfg = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_act="silu",
             hidden_size=E, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=1, rms_norm_eps=1e-6, rope_theta=10000.0,
             max_position_embeddings=2048, vocab_size=V, draft_vocab_size=VD,
             tie_word_embeddings=False, torch_dtype="float16")
  cfg.update(kw)
  return cfg


def _write(d, sd, cfg, file="pytorch_model.bin"):
  os.makedirs(d, exist_ok=True)
  if file.endswith(".bin"):
    torch.save(sd, os.path.join(d, file))
  else:
    from safetensors.torch import save_file

    save_file(sd, os.path.join(d, file))
  with open(os.path.join(d, "config.json"), "w") as f:
    json.dump(cfg, f)
  return d


@pytest.fixture(scope="module")
def published(tmp_path_factory):
  sd, cfg = _state(), _config()
  return _write(str(tmp_path_factory.mktemp("eagle3")), sd, cfg), sd, cfg


def reference(hf_model, sd, cfg, tokens=TOKENS):
  """EAGLE-3's first draft step, from SafeAILab's architecture: fc over cat of the hidden states
  entering target layers 2, L // 2 and L - 3 (transformers' hidden_states[i] enters layer i),
  then the midlayer: attention (rotary, grouped kv heads, causal) over cat(input_layernorm(emb
  of token t + 1), hidden_norm(h)) with h as residual, the MLP, the final norm, the LM head over
  the draft vocabulary, mapped to target ids by d2t. -> logits [T-1, V], -inf outside it."""
  sd = {k: (x.float() if x.is_floating_point() else x) for k, x in sd.items()}
  ids = torch.tensor(tokens, dtype=torch.long)
  with torch.no_grad():
    out = hf_model(ids[None], output_hidden_states=True)
    hs, layers = out.hidden_states, len(out.hidden_states) - 1
    feats = torch.cat([hs[2][0], hs[layers // 2][0], hs[layers - 3][0]], -1)  # [T,3E]
    table = sd.get("embed_tokens.weight", hf_model.model.embed_tokens.weight)
    eps = cfg["rms_norm_eps"]
    rms = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w  # noqa: E731
    h = feats[:-1] @ sd["fc.weight"].T  # [n,E]
    p = "midlayer."
    x = torch.cat([rms(table[ids[1:]], sd[p + "input_layernorm.weight"]),
                   rms(h, sd[p + "hidden_norm.weight"])], -1)  # [n,2E]
    h = torch_decoder_layer(x, h, sd, p, cfg)  # attention reads [n,2E]; h is the residual
    draft = rms(h, sd["norm.weight"]) @ sd["lm_head.weight"].T  # [n,Vd]
    n, vd = draft.shape
    full = torch.full((n, cfg["vocab_size"]), -float("inf"))
    full[:, torch.arange(vd) + sd["d2t"]] = draft
  return full.numpy()


def test_logits_match_reference(hf, target, published):
  d, sd, cfg = published
  heads = sj.load_heads(d, target)
  c = heads.config
  assert heads.meta["layout"] == "eagle3" and (c.kind, c.taps, c.vocab_subset) == (
      "eagle3", (2, 3, 4), VD)
  assert "embed" not in heads.params  # none stored: the target's
  got = np.asarray(head_logits(target, heads, TOKENS))
  want = reference(hf[1], sd, cfg)
  assert got.shape == (len(TOKENS) - 1, V)
  np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_decoding_is_lossless(target, published):
  """Greedy: the dynamic tree at batch 1, the chain at batch 4, each output equal to what
  autoregressive greedy decoding emits (the target's argmax at every position, one forward);
  every draft lies in the draft vocabulary, whose misses the target then corrects."""
  heads = sj.load_heads(published[0], target)
  runs = []
  for method, batches in ((sj.Eagle(heads, acceptance="greedy", depth=3, top_k=3, num_nodes=8),
                           (1,)),
                          (sj.Eagle(heads, acceptance="greedy", tree=[(0,), (0, 0), (0, 0, 0)]),
                           (4,))):
    for b in batches:
      prompts = random_prompts(b, V, seed=b)
      out = sj.generate(target, prompts, method, max_new_tokens=12, stop_at_eos=False)
      runs.extend(zip(prompts, out.tokens))
  width = max(len(p) + len(t) for p, t in runs)
  seqs = np.zeros((len(runs), width), np.int32)
  for i, (p, t) in enumerate(runs):
    seqs[i, :len(p) + len(t)] = p + t
  logits, _, _ = jax.jit(lambda params, s: forward_sequence(target.config, target.module(params),
                                                            s))(target.params, seqs)
  greedy = np.asarray(logits).argmax(-1)
  for p, t in runs:
    assert len(t) == 12
  for i, (p, t) in enumerate(runs):
    assert t == greedy[i, len(p) - 1:len(p) + len(t) - 1].tolist(), p


def test_sampling_follows_the_target_distribution(target, published):
  from tests.helpers.lossless import tv_check

  heads = sj.load_heads(published[0], target)
  method = sj.Eagle(heads, depth=2, top_k=2, num_nodes=4)
  tv, expected = tv_check(target, method, dict(temperature=1.0, top_k=0, top_p=1.0))
  assert tv < 2 * expected, f"TV {tv:.4f} vs expected sampling error {expected:.4f}"


def test_export_round_trips_and_the_reference_reads_it(hf, target, published, tmp_path):
  heads = sj.load_heads(published[0], target)
  ours = sj.init_heads(target, "eagle3", scale=0.2, seed=1, vocab=np.arange(0, V, 2))
  assert ours.config.taps == (2, 3, 4) and ours.params["lm"].shape == (1, 31, E)
  for i, h in enumerate((heads, ours)):
    out = export_heads(h, "eagle3", str(tmp_path / str(i)), target)
    back = sj.load_heads(out, target)
    assert back.meta["layout"] == "eagle3"
    assert dataclasses.replace(back.config, target="") == dataclasses.replace(h.config, target="")
    assert np.array_equal(back.vocab, h.vocab) and sorted(back.params) == sorted(h.params)
    for name, x in h.params.items():
      assert np.array_equal(np.asarray(back.params[name]), np.asarray(x)), name
  # The exported files, in SafeAILab's dtypes, read by the reference: the same logits.
  from safetensors.torch import load_file

  sd = load_file(str(tmp_path / "0" / "model.safetensors"))
  assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
  with open(tmp_path / "0" / "config.json") as f:
    cfg = json.load(f)
  assert cfg["draft_vocab_size"] == VD and cfg["vocab_size"] == V
  np.testing.assert_allclose(reference(hf[1], sd, cfg), reference(hf[1], *published[1:]),
                             atol=1e-5)
  # The command line: a heads file (ours, saved) to the layout.
  from specjax import cli
  from specjax.heads import save_heads

  npz = save_heads(heads, str(tmp_path / "heads.npz"))
  cli.main(["export", "--format", "eagle3", npz, str(tmp_path / "cli"), "--model", hf[0]])
  back = sj.load_heads(str(tmp_path / "cli"), target)
  for name, x in sj.load_heads(npz, target).params.items():
    assert np.array_equal(np.asarray(back.params[name]), np.asarray(x)), name


def test_bad_input_is_named(target, published, tmp_path):
  d, sd, cfg = published
  narrow = sj.Model(dataclasses.replace(target.config, hidden_size=16, head_dim=4), None, None)
  with pytest.raises(InputError, match=r"width 32.*width 16"):
    sj.load_heads(d, narrow)
  small = sj.Model(dataclasses.replace(target.config, vocab_size=50), None, None)
  with pytest.raises(InputError, match=r"vocabulary is 61 tokens.*target's is 50"):
    sj.load_heads(d, small)
  shallow = sj.Model(dataclasses.replace(target.config, num_layers=6), None, None)
  with pytest.raises(InputError, match="6 layers"):
    sj.load_heads(d, shallow)
  missing = {k: x for k, x in sd.items() if k != "midlayer.hidden_norm.weight"}
  with pytest.raises(WeightsError, match="missing tensor 'midlayer.hidden_norm.weight'"):
    sj.load_heads(_write(str(tmp_path / "a"), missing, cfg, "model.safetensors"), target)
  bad = dict(sd, d2t=sd["d2t"].clone())
  bad["d2t"][VD - 1] = V  # the last draft id -> a target id past the vocabulary
  with pytest.raises(WeightsError, match=rf"d2t out of range: draft id {VD - 1} maps to target "
                                         rf"id {VD - 1 + V}, outside \[0, {V}\)"):
    sj.load_heads(_write(str(tmp_path / "b"), bad, cfg), target)
  with pytest.raises(InputError, match="pass target="):
    sj.load_heads(d)


def test_train_eagle3_lowers_the_loss_resumes_and_exports(hf, target, tmp_path):
  """`specjax train eagle3` trains exactly this architecture: a few steps on a small corpus lower
  the held-out loss, a second call resumes from the checkpoint, and the trained head exports to
  the published layout and reads back."""
  from specjax.training import heads as heads_train
  from specjax.training import trainer
  from tests.helpers.tinyhf import FakeCorpus

  rng = np.random.default_rng(0)
  seqs = [rng.integers(0, V, 24).tolist() for _ in range(24)]
  corpus = FakeCorpus(seqs, [2] * len(seqs), V)
  kw = dict(vocab_size=20, steps=16, batch_size=4, seq_len=16, lr=1e-2, warmup=2, held_out=0.2,
            ckpt_every=8, eval_every=8, progress=False, unroll=2)
  heads = heads_train.train_heads("eagle3", target, corpus, out_dir=str(tmp_path / "r"),
                                  export=str(tmp_path / "h.npz"), log=lambda *_: None, **kw)
  assert heads.config.kind == "eagle3" and heads.config.vocab_subset == 20
  held = [r for r in trainer.read_log(str(tmp_path / "r")) if r["split"] == "heldout"]
  assert [r["step"] for r in held] == [0, 8, 16] and held[-1]["loss"] < held[0]["loss"], held
  logs = []
  again = heads_train.train_heads("eagle3", target, corpus, out_dir=str(tmp_path / "r"),
                                  log=logs.append, **kw)
  assert any("resumed from checkpoint at step 16" in line for line in logs), logs
  for name, x in heads.params.items():
    assert np.array_equal(np.asarray(again.params[name]), np.asarray(x)), name
  back = sj.load_heads(export_heads(sj.load_heads(str(tmp_path / "h.npz"), target), "eagle3",
                                    str(tmp_path / "out"), target), target)
  assert back.meta["layout"] == "eagle3" and np.array_equal(back.vocab, heads.vocab)
