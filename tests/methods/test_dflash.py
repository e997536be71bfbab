"""DFlash drafters (specjax/drafters/dflash.py, specjax/methods/dflash.py).

Random weights written in z-lab's DFlash layout (a Qwen3 config.json with dflash_config, fp32
model.safetensors; the drafter's own attention shapes, unlike the target's) for a tiny random
transformers Llama of 5 layers, checked against a torch reference of the published architecture
written here (target features: transformers' own hidden states); the decoding path's drafts
against the teacher-forced block logits, round after round; export and read back bit for bit;
bad input named. Greedy identity at batch 1 and 4 and the sampling distribution are the lossless
suite's cases (tests/methods/test_lossless.py, "dflash/...")."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax import decode, sampling
from specjax.drafters import export_heads, head_logits
from specjax.errors import InputError, WeightsError

from tests.helpers.tinyhf import random_llama

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

E, V, LAYERS, BS, MASK = 32, 61, 5, 4, 60
H, KV, D, F = 2, 1, 16, 40  # the drafter's own attention and MLP shapes
IDS = [0, 2]  # target layers read
TOKENS = np.array([5, 17, 3, 44, 8, 8, 59, 0, 12, 33, 21, 7], np.int32)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
  return random_llama(str(tmp_path_factory.mktemp("target")), layers=LAYERS, vocab_size=V,
                      hidden=E)


@pytest.fixture(scope="module")
def target(hf):
  return sj.load_model(hf[0], tokenizer=False)


def _state(seed=0, layers=2):
  g = torch.Generator().manual_seed(seed)
  r = lambda *s: torch.randn(*s, generator=g) * 0.3  # noqa: E731
  sd = {"fc.weight": r(E, len(IDS) * E) / 2, "hidden_norm.weight": 1 + r(E),
        "norm.weight": 1 + r(E)}
  for i in range(layers):
    p = f"layers.{i}."
    sd.update({p + "input_layernorm.weight": 1 + r(E),
               p + "post_attention_layernorm.weight": 1 + r(E),
               p + "self_attn.q_proj.weight": r(H * D, E),
               p + "self_attn.k_proj.weight": r(KV * D, E),
               p + "self_attn.v_proj.weight": r(KV * D, E),
               p + "self_attn.o_proj.weight": r(E, H * D),
               p + "self_attn.q_norm.weight": 1 + r(D), p + "self_attn.k_norm.weight": 1 + r(D),
               p + "mlp.gate_proj.weight": r(F, E), p + "mlp.up_proj.weight": r(F, E),
               p + "mlp.down_proj.weight": r(E, F)})
  return sd


def _config(layers=2, **dflash):
  return dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=E,
              intermediate_size=F, num_attention_heads=H, num_key_value_heads=KV, head_dim=D,
              num_hidden_layers=layers, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=V,
              num_target_layers=LAYERS, block_size=BS, attention_bias=False,
              dflash_config=dict(dict(mask_token_id=MASK, target_layer_ids=IDS), **dflash))


def _write(d, sd, cfg):
  from safetensors.torch import save_file

  os.makedirs(d, exist_ok=True)
  save_file({k: x.contiguous() for k, x in sd.items()}, os.path.join(d, "model.safetensors"))
  with open(os.path.join(d, "config.json"), "w") as f:
    json.dump(cfg, f)
  return d


@pytest.fixture(scope="module")
def published(tmp_path_factory):
  sd, cfg = _state(), _config()
  return _write(str(tmp_path_factory.mktemp("dflash")), sd, cfg), sd, cfg


def reference(hf_model, sd, cfg, tokens=TOKENS):
  """z-lab's DFlash drafter over a block anchored at every position a: context c = hidden_norm(fc
  (cat of transformers' hidden_states[i + 1], i in target_layer_ids)) at positions < a; the block
  [x_a, mask, ..] at a .. a + bs - 1; each layer: queries from input_layernorm(block), keys and
  values from cat(c, input_layernorm(block)) (q/k norms per head, rotary, no mask), o_proj,
  residual, post_attention_layernorm, SwiGLU, residual; norm, the target's lm_head.
  -> [T - bs + 1, bs - 1, V]."""
  dc, eps = cfg["dflash_config"], cfg["rms_norm_eps"]
  h, kv, d, bs = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], BS
  rms = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w  # noqa: E731
  inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, d, 2).float() / d)

  def rope(x, pos):  # x [heads, n, d]
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin

  ids = torch.tensor(tokens, dtype=torch.long)
  out = []
  with torch.no_grad():
    hs = hf_model(ids[None], output_hidden_states=True).hidden_states
    ctx_all = rms(torch.cat([hs[i + 1][0] for i in dc["target_layer_ids"]], -1)
                  @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    for a in range(len(tokens) - bs + 1):
      block = torch.tensor([ids[a]] + [dc["mask_token_id"]] * (bs - 1))
      x = hf_model.model.embed_tokens.weight[block]
      for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        w = lambda n: sd[p + n + ".weight"]  # noqa: E731
        hn = rms(x, w("input_layernorm"))
        kin = torch.cat([ctx_all[:a], hn])
        q = rope(rms((hn @ w("self_attn.q_proj").T).view(bs, h, d), w("self_attn.q_norm"))
                 .transpose(0, 1), torch.arange(a, a + bs))
        k = rope(rms((kin @ w("self_attn.k_proj").T).view(-1, kv, d), w("self_attn.k_norm"))
                 .transpose(0, 1), torch.arange(a + bs))
        v = (kin @ w("self_attn.v_proj").T).view(-1, kv, d).transpose(0, 1)
        k, v = k.repeat_interleave(h // kv, 0), v.repeat_interleave(h // kv, 0)
        att = ((q @ k.transpose(1, 2)) / d ** 0.5).softmax(-1)
        x = x + (att @ v).transpose(0, 1).reshape(bs, h * d) @ w("self_attn.o_proj").T
        y = rms(x, w("post_attention_layernorm"))
        x = x + (torch.nn.functional.silu(y @ w("mlp.gate_proj").T) * (y @ w("mlp.up_proj").T)) \
            @ w("mlp.down_proj").T
      out.append(hf_model.lm_head(rms(x, sd["norm.weight"]))[1:])
  return torch.stack(out).numpy()


def test_logits_match_reference(hf, target, published):
  d, sd, cfg = published
  heads = sj.load_heads(d, target)
  c = heads.config
  assert heads.meta["layout"] == "dflash"
  assert (c.kind, c.block_size, c.mask_token_id, c.target_layer_ids, c.taps) == (
      "dflash", BS, MASK, (0, 2), (1, 3))
  assert (c.attn_heads, c.kv_heads, c.head_dim, c.intermediate_size) == (H, KV, D, F)
  got = np.asarray(head_logits(target, heads, TOKENS))
  assert got.shape == (len(TOKENS) - BS + 1, BS - 1, V)
  np.testing.assert_allclose(got, reference(hf[1], sd, cfg), atol=1e-4, rtol=1e-4)


# Two prompts of different lengths, padded into one batch.
PROMPTS = [[5, 17, 3, 44, 8], [12, 33, 21, 7, 8, 8, 59, 0]]


def _prompt_batch():
  toks = np.zeros((len(PROMPTS), 8), np.int32)
  for i, x in enumerate(PROMPTS):
    toks[i, :len(x)] = x
  return toks, jnp.array([len(x) for x in PROMPTS])


def _prefilled(prog, params, method, arr, toks, lengths):
  """The decoding state after the prompts' prefill and the drafter's `init` (greedy, 32 new
  tokens a row), inside the caller's jit."""
  b = toks.shape[0]
  state, hidden = decode.prefill(prog, params, toks, lengths, jnp.full((b,), 32),
                                 sampling.SamplingParams.make(b), jax.random.PRNGKey(0),
                                 jnp.full((1,), -1, jnp.int32), method.max_emit)
  return state.replace(method=method.init(prog, arr, state, hidden))


def test_decoding_drafts_what_the_teacher_forced_blocks_say(target, published):
  """The decoding path (context K/V in the drafter's own cache, written round by round from the
  verify forward) drafts, at each round's anchor, the argmax of head_logits' block there; two
  rows of different prompt lengths, two rounds."""
  heads = sj.load_heads(published[0], target)
  method = sj.DFlash(heads)
  b = len(PROMPTS)
  prog = decode.Program(target.graphdef, target.config, method, 48)
  arr = method.arrays(target)
  toks, lengths = _prompt_batch()

  @jax.jit
  def rounds(params, arr, toks):
    state = _prefilled(prog, params, method, arr, toks, lengths)
    drafts, starts = [], []
    for r in range(2):
      starts.append(state.cache.lengths)
      drafts.append(method.block_logits(prog, params, arr, state)[0].argmax(-1))
      if r == 0:
        state = method.step(prog, params, arr, state)
    return state.seq, jnp.stack(starts, 1), jnp.stack(drafts, 1)

  seq, starts, drafts = map(np.asarray, rounds(target.params, arr, toks))
  # (a block reads the context before its anchor and the anchor's token: what follows is moot)
  want = np.asarray(head_logits(target, heads, seq[:, :int(starts.max()) + BS])).argmax(-1)
  for i in range(b):
    for r in range(2):
      assert drafts[i, r].tolist() == want[i, starts[i, r]].tolist(), (i, r)


def test_export_round_trips_bit_exact(hf, target, published, tmp_path):
  heads = sj.load_heads(published[0], target)
  ours = sj.init_heads(target, "dflash", num_layers=2, block_size=6, mask_token_id=3, scale=0.2,
                       seed=1)
  assert ours.config.target_layer_ids == (1, 2) and ours.params["layers.1.wq"].shape == (E, 4, 8)
  for i, h in enumerate((heads, ours)):
    back = sj.load_heads(export_heads(h, "dflash", str(tmp_path / str(i))), target)
    assert back.meta["layout"] == "dflash"
    assert dataclasses.replace(back.config, target="") == dataclasses.replace(h.config, target="")
    assert sorted(back.params) == sorted(h.params)
    for name, x in h.params.items():
      assert np.array_equal(np.asarray(back.params[name]), np.asarray(x)), name
  # The exported files are what the published reader reads: the reference gives the same logits.
  from safetensors.torch import load_file

  sd = load_file(str(tmp_path / "0" / "model.safetensors"))
  with open(tmp_path / "0" / "config.json") as f:
    cfg = json.load(f)
  assert cfg["dflash_config"] == {"block_size": BS, "mask_token_id": MASK, "target_layer_ids": IDS}
  np.testing.assert_array_equal(reference(hf[1], sd, cfg), reference(hf[1], *published[1:]))
  # Our .npz and the command line.
  from specjax import cli
  from specjax.heads import save_heads

  npz = save_heads(ours, str(tmp_path / "ours.npz"))
  assert sj.load_heads(npz, target).config == ours.config
  cli.main(["export", "--format", "dflash", npz, str(tmp_path / "cli")])
  back = sj.load_heads(str(tmp_path / "cli"), target)
  for name, x in sj.load_heads(npz, target).params.items():
    assert np.array_equal(np.asarray(back.params[name]), np.asarray(x)), name


def test_training_on_from_a_subset_asset_is_training_over_the_whole_vocabulary(target, tmp_path):
  """A DFlash file that records a vocabulary subset for decoding (the shipped drafter does) trains
  on with `init=`: the drafter scores through the target's own LM head, so its loss is over the
  whole vocabulary (labels are token ids of it), and the run is the run from the same drafter
  without the subset, to the bit; the export keeps the subset. (The loss had taken subset rows
  with whole-vocabulary labels: NaN from the first step.)"""
  from specjax.drafters.heads_file import save_heads
  from specjax.training import heads as heads_train
  from tests.helpers.tinyhf import FakeCorpus

  heads = sj.init_heads(target, "dflash", mask_token_id=MASK, block_size=BS, seed=3, scale=0.3)
  ids = np.arange(1, V, 2)
  sub = dataclasses.replace(heads, vocab=jnp.asarray(ids), config=dataclasses.replace(
      heads.config, vocab_subset=ids.size))
  save_heads(heads, str(tmp_path / "full.npz"))
  save_heads(sub, str(tmp_path / "sub.npz"))
  rng = np.random.default_rng(0)
  corpus = FakeCorpus([rng.integers(0, V - 1, 24).tolist() for _ in range(24)], [2] * 24, V)
  kw = dict(steps=3, batch_size=4, seq_len=16, lr=1e-2, warmup=1, held_out=0.2, eval_every=3,
            progress=False, log=lambda *a: None)
  runs = {name: heads_train.train_heads(
      "dflash", target, corpus, out_dir=str(tmp_path / name), init=str(tmp_path / f"{name}.npz"),
      export=str(tmp_path / f"out-{name}.npz"), **kw) for name in ("full", "sub")}
  for name, run in runs.items():
    held = run.meta["held_out"]
    assert np.isfinite(held["loss"]) and held["top1_0"] > 0, (name, held)
  assert runs["sub"].meta["held_out"] == runs["full"].meta["held_out"]
  for name, x in runs["full"].params.items():
    assert np.array_equal(np.asarray(runs["sub"].params[name]), np.asarray(x)), name
  back = sj.load_heads(str(tmp_path / "out-sub.npz"), target)
  assert np.array_equal(np.asarray(back.vocab), ids) and back.config.vocab_subset == ids.size


def test_a_vocabulary_subset_scores_its_rows_of_the_full_block(target, published):
  """DFlash(vocab=ids): the block's logits over the subset are the full block's at those ids (the
  target's LM-head rows of the subset), and drafts map back to token ids; the subset's greedy and
  sampling exactness are the lossless suite's (dflash/subset, dflash/subset-exact)."""
  heads = sj.load_heads(published[0], target)
  ids = np.arange(1, V, 3)
  full, sub = sj.DFlash(heads, block_size=BS), sj.DFlash(heads, block_size=BS, vocab=ids)
  toks, lengths = _prompt_batch()
  out = {}
  for name, method in (("full", full), ("sub", sub)):
    prog = decode.Program(target.graphdef, target.config, method, 48)
    arr = method.arrays(target)

    def first_block(params, arr, toks, method=method, prog=prog):
      state = _prefilled(prog, params, method, arr, toks, lengths)
      return method.block_logits(prog, params, arr, state)[0]

    out[name] = np.asarray(jax.jit(first_block)(target.params, arr, toks))
  assert out["sub"].shape[-1] == ids.size
  np.testing.assert_allclose(out["sub"], out["full"][..., ids], rtol=1e-5, atol=1e-5)
  with pytest.raises(InputError, match=r"vocab must be distinct token ids in \[0, 61\)"):
    sj.DFlash(heads, vocab=[3, 3, 4])
  with pytest.raises(InputError, match=r"tree ranks \(max rank \+ 1\)=3 is invalid"):
    sj.DFlash(heads, vocab=[3, 4], tree=[(0,), (1,), (2,)])


def test_bad_input_is_named(target, published, tmp_path):
  d, sd, cfg = published
  heads = sj.load_heads(d, target)
  with pytest.raises(InputError, match=r"block_size=5 is invalid.*trained for blocks of 4"):
    sj.DFlash(heads, block_size=5)
  with pytest.raises(InputError, match=r"block_size=1 is invalid"):
    sj.DFlash(heads, block_size=1)
  shallow = sj.Model(dataclasses.replace(target.config, num_layers=3), None, None)
  with pytest.raises(InputError, match=r"target_layer_ids=\[0, 2\] are out of range.*\[0, 1\]"):
    sj.load_heads(d, shallow)
  with pytest.raises(InputError, match=r"target_layer_ids=\[0, 4\] are out of range.*\[0, 3\]"):
    sj.init_heads(target, "dflash", mask_token_id=MASK, target_layer_ids=(0, 4))
  with pytest.raises(InputError, match="mask_token_id is missing"):
    sj.init_heads(target, "dflash")
  with pytest.raises(InputError, match=r"mask_token_id=61 is invalid.*\[0, 61\)"):
    sj.init_heads(target, "dflash", mask_token_id=V)
  no_mask = _config(target_layer_ids=IDS)
  del no_mask["dflash_config"]["mask_token_id"]
  with pytest.raises(WeightsError, match="no mask_token_id"):
    sj.load_heads(_write(str(tmp_path / "a"), sd, no_mask), target)
  missing = {k: x for k, x in sd.items() if k != "hidden_norm.weight"}
  with pytest.raises(WeightsError, match="missing tensor 'hidden_norm.weight'"):
    sj.load_heads(_write(str(tmp_path / "b"), missing, cfg), target)
  missing = {k: x for k, x in sd.items() if k != "layers.1.self_attn.k_norm.weight"}
  with pytest.raises(WeightsError, match="missing tensor 'layers.1.self_attn.k_norm.weight'"):
    sj.load_heads(_write(str(tmp_path / "c"), missing, cfg), target)
  with pytest.raises(InputError, match=r"tree path \(0, 0, 0\) has depth 3, but a block of "
                     r"block_size=3 drafts 2 offsets"):
    sj.DFlash(heads, block_size=3, tree=[(0,), (0, 0), (0, 0, 0)])
  with pytest.raises(InputError, match=r"tree path \(0, 0, 0, 0\) has depth 4, but these heads draft "
                     r"at most 3 offsets \(trained for blocks of 4\)"):
    sj.DFlash(heads, tree=[(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)])
  with pytest.raises(InputError, match="heads of kind 'dflash' cannot run MTP"):
    sj.MTP(heads)
  with pytest.raises(InputError, match="options of DFlash heads, not eagle"):
    sj.init_heads(target, "eagle", block_size=4)


def test_train_lowers_the_loss_and_resumes_to_the_same_parameters(target, tmp_path,
                                                                  monkeypatch):
  """`specjax train dflash` (train_heads on the shared trainer): a few steps on a small corpus
  lower the held-out loss and record per-offset top-1; killed before its last checkpoint, the
  run resumes from the one before to exactly the uninterrupted run's parameters."""
  import shutil

  from specjax import cli
  from specjax.training import heads as heads_train
  from specjax.training import trainer
  from tests.helpers.tinyhf import FakeCorpus

  seen = {}
  with monkeypatch.context() as m:  # the command line reaches the same trainer
    m.setattr(heads_train, "train_heads",
              lambda kind, model, corpus, **kw: seen.update(kind=kind, **kw))
    cli.main(["train", "dflash", "--corpus", "/c", "--mask-token", "60", "--block-size", "4",
              "--target-layers", "0,2", "--num-layers", "2", "--loss-decay", "2.5",
              "--anchors", "12", "--warm"])
  assert seen["kind"] == "dflash" and seen["num_layers"] == 2 and seen["dflash"] == dict(
      block_size=4, mask_token_id=60, target_layer_ids=(0, 2), loss_decay=2.5, anchors=12,
      warm=True)

  rng = np.random.default_rng(0)
  corpus = FakeCorpus([rng.integers(0, V - 1, 24).tolist() for _ in range(24)], [2] * 24, V)
  kw = dict(steps=8, batch_size=4, seq_len=16, lr=1e-2, warmup=2, held_out=0.2, ckpt_every=4,
            eval_every=4, progress=False, dflash=dict(block_size=BS, mask_token_id=MASK))
  quiet = lambda *a: None  # noqa: E731
  whole = heads_train.train_heads("dflash", target, corpus, out_dir=str(tmp_path / "a"),
                                  export=str(tmp_path / "h.npz"), log=quiet, **kw)
  held = [r for r in trainer.read_log(str(tmp_path / "a")) if r["split"] == "heldout"]
  assert [r["step"] for r in held] == [0, 4, 8] and held[-1]["loss"] < held[0]["loss"], held
  rec = whole.meta["held_out"]
  assert {"top1_0", "top1_1", "top1_2", "top5_0", "top5_1", "top5_2"} <= set(rec)
  assert all(rec[f"top1_{k}"] <= rec[f"top5_{k}"] for k in range(BS - 1)), rec
  exported = sj.load_heads(str(tmp_path / "h.npz"), target)
  assert exported.config == whole.config
  assert exported.meta["loss_decay"] == 2.0  # the gamma used: the paper's default for block 4

  # Killed (hard) after step 8 but before its checkpoint was written: drop it, and the same
  # call resumes from step 4 to the same parameters.
  shutil.rmtree(tmp_path / "a" / "ckpt" / "8")
  logs = []
  again = heads_train.train_heads("dflash", target, corpus, out_dir=str(tmp_path / "a"),
                                  log=logs.append, **kw)
  assert any("resumed from checkpoint at step 4" in line for line in logs), logs
  for name, x in whole.params.items():
    assert np.array_equal(np.asarray(again.params[name]), np.asarray(x)), name


def test_loss_weighs_the_offsets_by_the_papers_decay(target):
  """Offset j's cross-entropy weighs exp(-(j - 1) / gamma), gamma the paper's for the block size
  by default (4 at 8, 5 at 10, 7 at 16): a vanishing gamma leaves offset 1's loss alone, gamma 0
  the plain mean, and the per-offset losses (ce_k) do not depend on it. A bad gamma is named
  before anything loads."""
  from specjax.training import dflash as dflash_train
  from specjax.training import heads as heads_train
  from specjax.training.features import frozen_arrays

  assert [dflash_train.default_decay(b) for b in (8, 10, 16)] == [4, 5, 7]
  heads = sj.init_heads(target, "dflash", mask_token_id=MASK, block_size=BS, seed=3)
  rng = np.random.default_rng(1)
  batch = {"tokens": jnp.asarray(rng.integers(0, V - 1, (2, 24)), jnp.int32),
           "mask": jnp.asarray(rng.random((2, 24)) < 0.9)}
  frozen = frozen_arrays(target, heads)
  out = {d: jax.jit(dflash_train.make_loss(target, heads, decay=d))(
      heads.params, batch, jax.random.key(0), frozen) for d in (0.0, 1e-3, 2.0, None)}
  ce = [float(out[0.0][1][f"ce_{k}"]) for k in range(BS - 1)]
  for d, (loss, m) in out.items():
    np.testing.assert_allclose([float(m[f"ce_{k}"]) for k in range(BS - 1)], ce, rtol=1e-6)
  np.testing.assert_allclose(float(out[1e-3][0]), ce[0], rtol=1e-5)  # offset 1 alone
  assert min(ce) <= float(out[2.0][0]) <= max(ce)
  # the default for block 4 is gamma 2
  np.testing.assert_allclose(float(out[None][0]), float(out[2.0][0]), rtol=1e-6)
  for bad in (-1.0, "4", True):
    with pytest.raises(InputError, match="loss_decay"):
      heads_train.train_heads("dflash", "/nowhere", None, dflash=dict(
          block_size=BS, mask_token_id=MASK, loss_decay=bad))


def test_block_size_comes_from_the_curve_and_an_explicit_one_wins(target, monkeypatch):
  """methods/defaults.py: block = 1 + argmax tau(g) / (c(g + 1) + one drafter forward), tau from
  the held-out per-offset top-1 the trainer records; nothing recorded: the trained block."""
  from specjax import calibrate, methods

  curve = {"now": {1: 1.0, 64: 1.0}}
  monkeypatch.setattr(calibrate, "cost_curve", lambda model: curve["now"])
  heads = sj.init_heads(target, "dflash", mask_token_id=MASK, block_size=6)
  held = dataclasses.replace(heads, meta={"held_out": {f"top1_{k}": 0.8 for k in range(5)}})
  assert methods.build("dflash", target, heads=held).block_size == 6  # verifying more is free
  curve["now"] = {1: 1.0, 2: 2.0, 3: 3.0}  # every verified token costs a forward
  assert methods.build("dflash", target, heads=held).block_size == 2
  assert sj.DFlash(held).prepare(target).block_size == 2  # built by class: the same choice
  assert methods.build("dflash", target, heads=held, block_size=5).block_size == 5
  assert methods.build("dflash", target, heads=heads).block_size == 6


def test_tree_or_chain_comes_from_the_curve(target, monkeypatch):
  """With top-5 recorded per offset, the cost curve picks a tree where verifying more tokens is
  nearly free (the runner-ups add accepted tokens) and the chain where every verified token costs
  a forward; without top-5, a chain. A tree given by hand fixes the block to its depth + 1."""
  from specjax import calibrate, methods
  from specjax.tree import Tree

  curve = {"now": {1: 1.0, 64: 1.05}}
  monkeypatch.setattr(calibrate, "cost_curve", lambda model: curve["now"])
  heads = sj.init_heads(target, "dflash", mask_token_id=MASK, block_size=6)
  top1 = {f"top1_{k}": 0.6 for k in range(5)}
  ranked = dataclasses.replace(heads, meta={"held_out": {**top1,
                                                         **{f"top5_{k}": 0.9 for k in range(5)}}})
  flat = methods.build("dflash", target, heads=ranked)
  assert isinstance(flat.tree, Tree) and flat.tree.num_nodes > flat.tree.max_depth
  assert flat.block_size == flat.tree.max_depth + 1
  chain_only = dataclasses.replace(heads, meta={"held_out": top1})
  assert methods.build("dflash", target, heads=chain_only).tree is None
  curve["now"] = {1: 1.0, 2: 2.0, 3: 3.0}
  steep = methods.build("dflash", target, heads=ranked)
  assert steep.tree is None and steep.block_size == 2
  assert sj.DFlash(heads, tree=[(0,), (1,), (0, 0)]).block_size == 3
  assert methods.build("dflash", target, heads=ranked, block_size=4).tree is None  # a knob given


def test_a_single_path_tree_is_the_chain():
  """A tree of one path (rank 0 at every depth) drafts and accepts what the chain of the same
  depth does, round by round (same tokens, same accepted-depth histogram), so the tree step's
  drafts and the context it writes back agree with the chain's; a wider tree, the same tokens."""
  from tests.helpers.lossless import DFLASH_TREE
  from tests.helpers.models import memoryless_model, random_prompts

  t = memoryless_model()
  heads = sj.init_heads(t, "dflash", mask_token_id=60, block_size=4, seed=4, scale=0.3)
  ps = random_prompts(4, 61, seed=3)
  chain = sj.generate(t, ps, sj.DFlash(heads), max_new_tokens=40)
  path = sj.generate(t, ps, sj.DFlash(heads, tree=[(0,), (0, 0), (0, 0, 0)]), max_new_tokens=40)
  wide = sj.generate(t, ps, sj.DFlash(heads, tree=DFLASH_TREE), max_new_tokens=40)
  assert path.tokens == chain.tokens == wide.tokens
  assert path.stats["accepted_depth_hist"] == chain.stats["accepted_depth_hist"]
  assert wide.stats["tree_nodes"] == len(DFLASH_TREE) and wide.stats["block_size"] == 4


def test_warm_start_is_the_targets_last_layers(hf, target):
  """warm=True: drafter layer i is target layer L - n + i, read back in z-lab's layout against the
  checkpoint's own tensors (so the fused-qkv split is checked against transformers' names), the
  final norm is the target's, and fc passes the deepest tap through: the first layer's context
  keys are that target layer's keys of the deepest tapped state (normed per head, as a Qwen3
  layer's are)."""
  from specjax.drafters.dflash import drafter, to_published
  from specjax.model import apply_rope, rms_unit

  heads = sj.init_heads(target, "dflash", mask_token_id=MASK, block_size=BS, num_layers=2,
                        target_layer_ids=(0, LAYERS - 3), warm=True)
  ts, _ = to_published(heads.config, heads.params)
  ref = transformers.AutoModelForCausalLM.from_pretrained(hf[0]).state_dict()
  for i in range(2):
    src = f"model.layers.{LAYERS - 2 + i}."
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                 "post_attention_layernorm"):
      np.testing.assert_allclose(ts[f"layers.{i}.{name}.weight"], ref[src + name + ".weight"]
                                 .numpy(), rtol=1e-6, atol=1e-7, err_msg=f"{i} {name}")
  np.testing.assert_allclose(ts["norm.weight"], ref["model.norm.weight"].numpy(), rtol=1e-6)
  feats = np.random.default_rng(0).standard_normal((1, 6, 2 * E)).astype(np.float32)
  pos = jnp.arange(6)[None]
  module = drafter(heads.config, heads.params)
  k, _ = module.context_kv(jnp.asarray(feats), pos)[0]
  w = ref[f"model.layers.{LAYERS - 2}.self_attn.k_proj.weight"].numpy()
  g = ref[f"model.layers.{LAYERS - 2}.input_layernorm.weight"].numpy()
  x = g * np.asarray(rms_unit(jnp.asarray(feats[..., E:]), heads.config.norm_eps))
  want = rms_unit(jnp.asarray((x @ w.T).reshape(1, 6, -1, heads.config.head_dim)),
                  heads.config.norm_eps)  # the drafter's per-head key norm, at one
  np.testing.assert_allclose(np.asarray(k), np.asarray(apply_rope(jnp.asarray(want),
                                                                  *module.rope(pos))),
                             rtol=1e-4, atol=1e-5)


def test_more_anchors_score_more_blocks(target):
  """`anchors` sets the blocks per training window (default about one per block length): more
  anchors score more offsets from the same target forward; a bad count is named before loading."""
  from specjax.training import dflash as dflash_train
  from specjax.training import heads as heads_train
  from specjax.training.features import frozen_arrays

  heads = sj.init_heads(target, "dflash", mask_token_id=MASK, block_size=BS, seed=3)
  batch = {"tokens": jnp.asarray(np.random.default_rng(1).integers(0, V - 1, (2, 24)), jnp.int32),
           "mask": jnp.ones((2, 24), bool)}
  frozen = frozen_arrays(target, heads)
  count = {a: int(jax.jit(dflash_train.make_loss(target, heads, anchors=a))(
      heads.params, batch, jax.random.key(0), frozen)[1]["count"]) for a in (0, 20)}
  assert count[0] <= 2 * (24 // BS) * (BS - 1) < 2 * (20 * (BS - 1) - 6) <= count[20]
  for bad in (-1, 2.5, True):
    with pytest.raises(InputError, match="anchors"):
      heads_train.train_heads("dflash", "/nowhere", None, dflash=dict(
          block_size=BS, mask_token_id=MASK, anchors=bad))


@pytest.mark.slow
def test_shipped_smollm2_dflash(smollm2):
  """The shipped DFlash drafter fits SmolLM2, carries its training record (held-out acceptance
  per block offset, its start and anchors), and decodes exactly: greedy at batch 1 and 2 with
  the block it was trained for and a shorter one, and by name with its cost-curve sizes."""
  heads = sj.load_heads("smollm2-135m-dflash", smollm2)
  c, meta = heads.config, heads.meta
  assert c.kind == "dflash" and c.block_size == 8 and c.target_layer_ids == (1, 14, 27)
  held = meta["held_out"]
  assert held["top1_0"] > 0.2 and held["top5_0"] > held["top1_0"]
  assert meta["warm"] is True and meta["anchors"] == 48
  prompts = ["Write a haiku about the sea.", "def fibonacci(n):"]
  ref = sj.generate(smollm2, prompts, max_new_tokens=24, chat=True).tokens
  for block in (8, 3):
    out = sj.generate(smollm2, prompts, sj.DFlash(heads, block_size=block), max_new_tokens=24,
                      chat=True)
    assert out.tokens == ref, block
    assert out.stats["mean_accepted"] > 1.0
  assert sj.generate(smollm2, prompts[:1], "dflash", max_new_tokens=24,
                     chat=True).tokens == ref[:1]
