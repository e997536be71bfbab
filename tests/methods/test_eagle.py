"""EAGLE (specjax/methods/eagle.py), its heads (specjax/heads.py kind "eagle") and its loss
(specjax/training/eagle.py). Greedy identity and the TV check are in test_lossless.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax import decode
from specjax.errors import InputError, WeightsError
from specjax.heads import init_heads, load_heads, save_heads
from specjax.methods.eagle import Eagle, capacity, expand_tree
from specjax.training import eagle as te

from tests.helpers.models import memoryless_model, random_prompts, tiny_config
from tests.helpers.training import own_text, stand_in


STATIC = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)]


# ----------------------------------------------------------------------------- EAGLE-2's tree

M_ROWS, MULT = 97, 7


def _table(v, seed, ties):
  """[M,V] float32 log-probabilities per path hash. ties=True: coarse values and near one-hot
  rows (log p = 0 exactly), so siblings, cousins and parent/child pairs tie in score."""
  rng = np.random.default_rng(seed)
  if not ties:
    x = rng.normal(size=(M_ROWS, v)) * 2
  else:
    x = rng.integers(0, 3, size=(M_ROWS, v)).astype(float)
    x[::3] = -200.0
    x[::3, 0] = 0.0  # log-softmax exactly 0 at token 0: a child scores its parent's score
  x = x - x.max(1, keepdims=True)
  return (x - np.log(np.exp(x).sum(1, keepdims=True))).astype(np.float32)


def _reference(table, b, depth, k, n):
  """Plain-Python EAGLE-2 expansion for batch row b (the spec the fixed-shape version follows)."""
  def row(h):
    return table[(h + 13 * b) % M_ROWS]

  def top(lp):
    return sorted(range(len(lp)), key=lambda v: (-lp[v], v))[:k]

  cands = []  # dicts: tok, score, parent (candidate index, -1 root), depth, hash
  lp = row(0)
  for v in top(lp):
    cands.append(dict(tok=v, score=np.float32(min(lp[v], 0)), parent=-1, depth=1,
                      hash=(v + 1) % M_ROWS))
  frontier = list(range(k))
  for d in range(1, depth):
    new = []
    for fi in frontier:
      c = cands[fi]
      lp = row(c["hash"])
      for v in top(lp):
        new.append(dict(tok=v, score=np.float32(c["score"] + np.float32(min(lp[v], 0))),
                        parent=fi, depth=d + 1, hash=(c["hash"] * MULT + v + 1) % M_ROWS))
    base = len(cands)
    cands += new
    frontier = [base + j for j in sorted(range(len(new)), key=lambda j: (-new[j]["score"], j))[:k]]
  sel = sorted(range(len(cands)), key=lambda i: (-cands[i]["score"], i))[:n]
  sel = sorted(sel, key=lambda i: cands[i]["depth"])  # stable: score order within a depth
  parents = [-1] + [0 if cands[i]["parent"] < 0 else 1 + sel.index(cands[i]["parent"])
                    for i in sel]
  return ([cands[i]["tok"] for i in sel], parents, [0] + [cands[i]["depth"] for i in sel],
          [cands[i]["score"] for i in sel])


def _fixed_shape(table, batch, depth, k, n):
  tab = jnp.asarray(table)
  rows = jnp.arange(batch)[:, None]

  def expand(carry, tok, parent_slot, d):
    parent_hash = carry if d == 1 else jnp.take_along_axis(carry, parent_slot - (d - 2) * k, axis=1)
    h = (parent_hash * MULT + tok + 1) % M_ROWS
    return h, tab[(h + 13 * rows) % M_ROWS]  # [B,k,V]

  logp0 = tab[(13 * jnp.arange(batch)) % M_ROWS]
  run = jax.jit(lambda: expand_tree(logp0, expand, jnp.zeros((batch, k), jnp.int32), depth, k, n))
  return [np.asarray(x) for x in run()[:4]]


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("depth,k,n", [(1, 3, 3), (2, 2, 6), (3, 3, 12), (4, 2, 9), (5, 3, 30)])
def test_dynamic_tree_matches_python_reference(depth, k, n, ties):
  v, batch = 9, 3
  table = _table(v, seed=depth * 10 + k, ties=ties)
  tok, parents, dep, score = _fixed_shape(table, batch, depth, k, n)
  assert tok.shape == (batch, n) and parents.shape == (batch, n + 1)
  for b in range(batch):
    rt, rp, rd, rs = _reference(table, b, depth, k, n)
    assert tok[b].tolist() == rt
    assert parents[b].tolist() == rp
    assert dep[b].tolist() == rd
    np.testing.assert_array_equal(score[b], np.array(rs, np.float32))
    # Parents come first, depth by depth; siblings are distinct; depth = parent's depth + 1.
    assert all(0 <= parents[b, i] < i for i in range(1, n + 1))
    assert all(dep[b, i] == dep[b, parents[b, i]] + 1 for i in range(1, n + 1))
    sib = {(parents[b, i], tok[b, i - 1]) for i in range(1, n + 1)}
    assert len(sib) == n


def test_capacity_bound():
  assert capacity(1, 8) == 8 and capacity(5, 8) == 8 + 4 * 64 and capacity(3, 2) == 10


# ----------------------------------------------------------------------------- decoding


@pytest.fixture(scope="module")
def memoryless():
  return memoryless_model()


@pytest.fixture(scope="module")
def fitted(memoryless):
  """EAGLE heads fitted to the memoryless model's own text."""
  return te.fit(memoryless, init_heads(memoryless, "eagle", seed=0), own_text(memoryless),
                steps=250, lr=3e-3)


def test_hybrid_tree_with_fitted_heads(memoryless, fitted):
  """EAGLE-2 beside prompt lookup in one hybrid tree (methods/hybrid.py). From the same states,
  one round: the hybrid's head state (a wider catch-up window, for the longer copied chain)
  drafts the same tree as EAGLE alone, so it accepts at least what either drafter does. Over
  many rounds, some commit a copied chain longer than EAGLE's depth, and EAGLE's feature buffer
  stays right through them: identical output, and the heads' candidates still accepted."""
  heads, _ = fitted
  start = random_prompts(1, memoryless.config.vocab_size, seed=3, lo=6, hi=7)[0]
  text = start + sj.generate(memoryless, [start], max_new_tokens=40, stop_at_eos=False).tokens[0]
  states = [text[:i] for i in range(6, 46, 4)]  # mixed lengths; the text repeats itself
  lookup = sj.PromptLookup(ngram=2, num_tokens=5)
  eagle = Eagle(heads, depth=2, top_k=3, num_nodes=6)
  hybrid = sj.Hybrid([lookup, eagle])
  assert hybrid.num_nodes == lookup.num_tokens + eagle.num_nodes  # every candidate kept
  got = {}
  for name, method in (("lookup", lookup), ("eagle", eagle), ("hybrid", hybrid)):
    out = sj.generate(memoryless, states, method, max_new_tokens=2, stop_at_eos=False)
    assert out.stats["steps"] == 2  # the prefill and exactly one round
    got[name] = out.stats["accepted_tokens"]
  assert got["hybrid"] >= max(got["lookup"], got["eagle"]) > 0, got
  orbit = text[5:16]  # the model's own text: each token is the greedy successor of the last
  assert len(set(orbit)) == len(orbit), "the test needs a stretch without repeats"
  ps = [orbit + orbit[:2], orbit[4:] + [1, 2] + orbit[4:6], states[3]]  # (copies of 5 fit)
  ref = sj.generate(memoryless, ps, max_new_tokens=24, stop_at_eos=False)
  out = sj.generate(memoryless, ps, hybrid, max_new_tokens=24, stop_at_eos=False)
  assert out.tokens == ref.tokens
  assert sum(out.stats["accepted_depth_hist"][eagle.depth + 1:]) > 0, "no copy past the depth"
  assert out.stats["accepted_by"]["1:eagle"] > 0, out.stats["accepted_by"]


@pytest.mark.parametrize("tree", ["dynamic", "static"])
def test_fitted_heads_are_accepted_and_identical(memoryless, fitted, tree):
  heads, _ = fitted
  method = (Eagle(heads, depth=4, top_k=3, num_nodes=10) if tree == "dynamic"
            else Eagle(heads, tree=STATIC))
  prompts = random_prompts(4, 61, seed=9)
  ref = sj.generate(memoryless, prompts, max_new_tokens=24)
  out = sj.generate(memoryless, prompts, method, max_new_tokens=24)
  assert out.tokens == ref.tokens
  st = out.stats
  assert st["mean_accepted"] > 1.5, st  # tau: acceptance is real, not vacuous
  assert len(st["accepted_depth_hist"]) == 5 and sum(st["accepted_depth_hist"]) == st["draft_rounds"]
  assert st["accepted_depth_hist"][4] > 0 and st["depth_acceptance"][0] > 0.5
  assert st["tree"] == tree and st["tree_nodes"] == method.num_nodes
  # Sampling with the same program (temperature is an array): still accepted.
  hot = sj.generate(memoryless, prompts, method, max_new_tokens=24, temperature=0.7, seed=1)
  assert hot.stats["mean_accepted"] > 1.5


def test_vocab_subset_heads(memoryless):
  ids = np.arange(0, 61, 2)
  heads = init_heads(memoryless, "eagle", vocab=ids, seed=1, scale=0.3)
  prompts = random_prompts(4, 61, seed=2)
  ref = sj.generate(memoryless, prompts, max_new_tokens=24).tokens
  out = sj.generate(memoryless, prompts, Eagle(heads, depth=2, top_k=2, num_nodes=4),
                    max_new_tokens=24)
  assert out.tokens == ref
  assert "vocab" in Eagle(heads).arrays(memoryless)


def test_method_arrays_are_built_once_per_method_and_params(memoryless):
  """generate reuses a method's arrays (packed heads, LM-head subset) while the method, the model
  and model.params are the same objects, and rebuilds them when any of them changes."""
  heads = init_heads(memoryless, "eagle", vocab=np.arange(0, 61, 2), seed=1, scale=0.3)
  method = Eagle(heads, depth=2, top_k=2, num_nodes=4)
  prompts = random_prompts(2, 61, seed=3)
  other = sj.Model(memoryless.config, memoryless.graphdef,
                   jax.tree.map(lambda x: x * 1.5, memoryless.params), memoryless.tokenizer)
  ref_other = sj.generate(other, prompts, max_new_tokens=8).tokens
  cache = decode.arrays_cache
  n0 = cache.count
  first = sj.generate(memoryless, prompts, method, max_new_tokens=8).tokens
  assert sj.generate(memoryless, prompts, method, max_new_tokens=8).tokens == first
  assert cache.count == n0 + 1
  sj.generate(memoryless, prompts, Eagle(heads, depth=2, top_k=2, num_nodes=4), max_new_tokens=8)
  assert cache.count == n0 + 2  # another method object
  assert sj.generate(other, prompts, method, max_new_tokens=8).tokens == ref_other  # exact
  assert cache.count == n0 + 3  # another model
  other.params = memoryless.params  # the same model object, its params swapped
  assert sj.generate(other, prompts, method, max_new_tokens=8).tokens == first
  assert cache.count == n0 + 4


def test_default_and_hash(tiny):
  heads = init_heads(tiny, "eagle")
  m = Eagle(heads)
  assert (m.depth, m.top_k, m.num_nodes, m.acceptance) == (5, 8, 32, "exact")
  assert m.extra_slots == 33 and m.max_emit == 6 and m.lossless
  s = Eagle(heads, tree=[(1,), (0,), (0, 0)])
  assert (s.depth, s.top_k, s.num_nodes) == (2, 2, 3)
  assert s == Eagle(heads, tree=[(0,), (1,), (0, 0)]) and hash(s) == hash(
      Eagle(heads, tree=[(0,), (1,), (0, 0)]))
  assert not Eagle(heads, acceptance="typical").lossless


# ----------------------------------------------------------------------------- heads I/O


@pytest.mark.parametrize("kind,k", [("eagle", 1), ("mtp", 3)])
def test_save_load_roundtrip(tmp_path, tiny, kind, k):
  heads = init_heads(tiny, kind, num_heads=k, seed=2, vocab=[5, 1, 9])
  path = save_heads(heads, str(tmp_path / "h.npz"), meta={"steps": 3})
  back = load_heads(path, tiny)
  assert back.config == heads.config and back.meta["steps"] == 3
  assert set(back.params) == set(heads.params)
  assert "layer.attn.wqkv" in back.params and back.params["fc_w"].shape == (k, 64, 32)
  for name in heads.params:
    np.testing.assert_allclose(back.params[name], heads.params[name], rtol=2e-3, atol=2e-3)
  with pytest.raises(InputError, match="width 32 and vocabulary 61"):
    load_heads(path, stand_in(vocab_size=71))
  # Same width and vocabulary, another layer type (kv heads): the layer tensors do not fit.
  with pytest.raises(InputError, match="layer"):
    load_heads(path, stand_in(num_kv_heads=4))


def test_heads_file_without_layer(tmp_path, tiny):
  heads = init_heads(tiny, "eagle")
  import dataclasses
  bad = dataclasses.replace(heads, params={k: v for k, v in heads.params.items()
                                           if not k.startswith("layer.")})
  path = save_heads(bad, str(tmp_path / "bad.npz"))
  with pytest.raises(WeightsError, match="no layer"):
    load_heads(path)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kw,match", [
    (dict(depth=0), "depth=0"),
    (dict(top_k=0), "top_k=0"),
    (dict(top_k=62), "top_k=62"),
    (dict(num_nodes=7), "num_nodes=7"),  # < top_k = 8
    (dict(depth=2, top_k=3, num_nodes=13), "num_nodes=13"),  # > 3 + 9
    (dict(tree="eagle3"), "tree='eagle3'"),
    (dict(tree=[]), "empty"),
    (dict(tree=[(0,), (61,)]), "ranks"),
    (dict(acceptance="sampling"), "acceptance='sampling'"),
])
def test_bad_arguments(tiny, kw, match):
  heads = init_heads(tiny, "eagle")
  with pytest.raises(InputError, match=match):
    Eagle(heads, **kw)


def test_bad_heads_raise_before_compiling(tiny):
  n = decode.compile_cache.count
  with pytest.raises(InputError, match="Heads"):
    Eagle(object())
  with pytest.raises(InputError, match="kind 'medusa'"):
    Eagle(init_heads(tiny, "medusa", num_heads=2))
  with pytest.raises(InputError, match="one module"):
    init_heads(tiny, "eagle", num_heads=2)
  other = init_heads(stand_in(hidden_size=16, num_heads=2, num_kv_heads=1), "eagle")
  with pytest.raises(InputError, match="width 16"):
    sj.generate(tiny, [[1, 2, 3]], Eagle(other, depth=2, top_k=2, num_nodes=4), max_new_tokens=4)
  wrong_vocab = init_heads(stand_in(vocab_size=64), "eagle")
  with pytest.raises(InputError, match="vocabulary 64"):
    sj.generate(tiny, [[1, 2, 3]], Eagle(wrong_vocab, tree=[(0,)]), max_new_tokens=4)
  assert decode.compile_cache.count == n


# ----------------------------------------------------------------------------- training loss


def test_loss_decreases(fitted):
  _, losses = fitted
  assert losses[-1] < 0.3 * losses[0]


def test_loss_features_on_the_fly_and_batched(tiny):
  heads = init_heads(tiny, "eagle", seed=3)
  toks = np.asarray(random_prompts(5, 61, seed=4, lo=12, hi=13))
  feats = te.teacher_features(tiny, toks, batch_size=2)  # 3 batches, the last padded
  assert feats.shape == (5, 12, 32)
  one = te.teacher_features(tiny, toks[:1], batch_size=2)  # padded: the same program
  np.testing.assert_allclose(feats[:1], one, rtol=1e-5, atol=1e-5)
  loss_fn = jax.jit(te.make_loss(tiny, heads, noise=0.0))
  frozen = te.frozen_arrays(tiny, heads)
  rng = jax.random.PRNGKey(0)
  a, ma = loss_fn(heads.params, {"tokens": jnp.asarray(toks)}, rng, frozen)
  b, mb = loss_fn(heads.params, {"tokens": jnp.asarray(toks), "feats": jnp.asarray(feats)}, rng,
                  frozen)
  np.testing.assert_allclose(a, b, rtol=1e-4)
  np.testing.assert_allclose(a, ma["vloss"] + 0.1 * ma["ploss"], rtol=1e-5)
  assert int(ma["count"]) == 5 * 11
  # A mask drops positions; noise changes the loss; gradients reach the layer, not the target.
  mask = np.ones((5, 12), bool)
  mask[:, :6] = False
  _, mm = loss_fn(heads.params, {"tokens": jnp.asarray(toks), "mask": jnp.asarray(mask)}, rng,
                  frozen)
  assert int(mm["count"]) == 5 * 6
  noisy = jax.jit(te.make_loss(tiny, heads, noise=0.1))(heads.params,
                                                        {"tokens": jnp.asarray(toks)}, rng, frozen)[0]
  assert float(noisy) != float(a)
  g = jax.jit(jax.grad(lambda p: loss_fn(p, {"tokens": jnp.asarray(toks)}, rng, frozen)[0]))(
      heads.params)
  assert float(jnp.abs(g["layer.mlp.w_out"]).sum()) > 0 and float(jnp.abs(g["fc_w"]).sum()) > 0


@pytest.mark.parametrize("window", [0, 5])
def test_unrolled_passes_equal_chain_drafting(window):
  """Training-time test: pass d's entry i is what drafting d+1 steps from prefix i computes at
  inference (a cache of the true prefix, then one entry per drafted step on its own features)."""
  from specjax import cache as kv
  from specjax.heads import drafter, module_arrays

  target = sj.Model.random(tiny_config(sliding_window=window), seed=1, scale=0.3)
  cfg = target.config
  heads = init_heads(target, "eagle", seed=5)
  mod = drafter(heads.config, cfg, module_arrays(heads.params, 0))
  toks = np.asarray(random_prompts(2, 61, seed=9, lo=12, hi=13))
  feats = jnp.asarray(te.teacher_features(target, toks))
  embed = target.params["embed"][...]
  steps, t = 3, 12 - 3
  embs = [embed[toks[:, 1 + d:1 + d + t]] for d in range(steps)]
  outs = jax.jit(lambda e, f: te.run_unrolled(cfg, mod, e, f))(embs, feats[:, :t])
  for i in (0, 3, t - 1):
    s = i + steps
    layer = kv.init(1, 2, s, cfg.num_kv_heads, cfg.head_dim, jnp.float32).layers[0]
    zero = jnp.zeros((2,), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(i + 1), (2, i + 1))
    x, layer = mod(embed[toks[:, 1:i + 2]], feats[:, :i + 1], pos, layer,
                   zero, kv.causal_mask(zero, i + 1, s, cfg.sliding_window))
    x = x[:, -1:]
    np.testing.assert_allclose(outs[0][:, i], x[:, 0], rtol=1e-5, atol=1e-5)
    for d in range(1, steps):
      at = jnp.full((2,), i + d, jnp.int32)
      x, layer = mod(embed[toks[:, i + 1 + d:i + 2 + d]], x,
                     at[:, None], layer, at,
                     kv.causal_mask(at, 1, s, cfg.sliding_window))
      np.testing.assert_allclose(outs[d][:, i], x[:, 0], rtol=1e-5, atol=1e-5)


def test_unrolled_loss(tiny):
  heads = init_heads(tiny, "eagle", seed=3)
  toks = jnp.asarray(random_prompts(3, 61, seed=4, lo=12, hi=13))
  frozen = te.frozen_arrays(tiny, heads)
  rng = jax.random.PRNGKey(0)
  one = jax.jit(te.make_loss(tiny, heads, noise=0.0))(heads.params, {"tokens": toks}, rng, frozen)
  loss, m = jax.jit(te.make_loss(tiny, heads, noise=0.0, unroll=3, unroll_decay=0.5))(
      heads.params, {"tokens": toks}, rng, frozen)
  # Pass 1 is the one-step loss; pass d scores d-1 fewer positions; the total is the weighted mean.
  for k in ("vloss", "ploss", "top1"):
    np.testing.assert_allclose(m[k], one[1][k], rtol=1e-5)
  parts = [m[f"vloss{s}"] + 0.1 * m[f"ploss{s}"] for s in ("", "_2", "_3")]
  np.testing.assert_allclose(loss, (parts[0] + 0.5 * parts[1] + 0.25 * parts[2]) / 1.75, rtol=1e-5)
  assert int(m["count"]) == 3 * 11 and not np.isclose(m["vloss_3"], m["vloss"])
  g = jax.grad(lambda p: te.make_loss(tiny, heads, noise=0.0, unroll=2)(
      p, {"tokens": toks}, rng, frozen)[0])(heads.params)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(g))
  for kw, match in (({"unroll": 0}, "unroll"), ({"unroll_decay": 0.0}, "unroll_decay")):
    with pytest.raises(InputError, match=match):
      te.make_loss(tiny, heads, **kw)


# ----------------------------------------------------------------------------- fused features


def test_decoder_taps_are_the_normalised_residual_stream(tiny):
  """Decoder(..., taps=(1,)) returns the residual stream after layer 1, RMS-normalised, beside the
  unchanged final feature; the logits do not move."""
  from specjax.model import rms_unit

  cfg = tiny.config
  toks = jnp.asarray(random_prompts(2, 61, seed=3, lo=9, hi=10))
  pos = jnp.broadcast_to(jnp.arange(9), (2, 9))

  def run(**kw):
    from specjax import cache as kv
    cache = tiny.init_cache(2, 16)
    return tiny.apply(tiny.params, toks, pos, cache, kv.causal_mask(cache.lengths, 9, 16), **kw)

  plain_logits, plain, _ = run()
  logits, both, _ = run(taps=(1,))
  assert both.shape == (2, 9, 2 * cfg.hidden_size)
  np.testing.assert_array_equal(np.asarray(both[..., cfg.hidden_size:]), np.asarray(plain))
  np.testing.assert_array_equal(np.asarray(logits), np.asarray(plain_logits))
  # After one layer: the one-layer forward's final-normed output, its norm scale divided out.
  _, one, _ = run(num_layers=1)
  scale = np.asarray(tiny.params["final_norm"]["scale"][...])
  np.testing.assert_allclose(np.asarray(both[..., :cfg.hidden_size]), np.asarray(one) / scale,
                             rtol=1e-5, atol=1e-5)
  x = np.asarray(both[..., :cfg.hidden_size])
  np.testing.assert_allclose(np.sqrt((x * x).mean(-1)), 1.0, rtol=1e-3)
  np.testing.assert_allclose(np.asarray(rms_unit(jnp.asarray(x) * 3.0, 1e-9)), x, rtol=1e-5,
                             atol=1e-6)


def test_taps_grown_head_drafts_exactly_as_before(memoryless, fitted):
  """add_taps makes fuse_w the identity on the final feature: the grown head's drafts (hence its
  acceptance histogram) equal the unfused head's, bit for bit."""
  from specjax.heads import add_taps

  heads, _ = fitted
  grown = add_taps(heads, (1,), memoryless)
  assert grown.config.taps == (1,) and grown.params["fuse_w"].shape == (1, 64, 32)
  assert heads.config.taps == () and "fuse_w" not in heads.params  # the caller's heads intact
  assert add_taps(grown, "1", memoryless) is grown
  prompts = random_prompts(4, 61, seed=9)
  ref = sj.generate(memoryless, prompts, max_new_tokens=24)
  a = sj.generate(memoryless, prompts, Eagle(heads, depth=4, top_k=3, num_nodes=10),
                  max_new_tokens=24)
  b = sj.generate(memoryless, prompts, Eagle(grown, depth=4, top_k=3, num_nodes=10),
                  max_new_tokens=24)
  assert a.tokens == b.tokens == ref.tokens
  assert a.stats["accepted_depth_hist"] == b.stats["accepted_depth_hist"]
  assert a.stats["mean_accepted"] > 1.5
  with pytest.raises(InputError, match="already fuse taps"):
    add_taps(grown, (2,), stand_in(num_layers=3))


def test_taps_heads_train_read_the_taps_and_stay_exact(tiny):
  """A fused head's loss reads the taps (gradients reach fuse_w's tap block from its zero start;
  precomputed features under "full" give the on-the-fly loss), fitting lowers it, and the
  fitted head generates exactly the autoregressive tokens."""
  heads = init_heads(tiny, "eagle", seed=3, taps=(1,))
  assert heads.config.taps == (1,)
  np.testing.assert_array_equal(np.asarray(heads.params["fuse_w"][0, :32]), 0.0)
  toks = np.asarray(random_prompts(5, 61, seed=4, lo=12, hi=13))
  full = te.teacher_features(tiny, toks, batch_size=2, taps=(1,))
  assert full.shape == (5, 12, 64)
  np.testing.assert_allclose(full[..., 32:], te.teacher_features(tiny, toks, batch_size=2),
                             rtol=1e-6, atol=1e-6)
  loss_fn = jax.jit(te.make_loss(tiny, heads, noise=0.0))
  frozen = te.frozen_arrays(tiny, heads)
  rng = jax.random.PRNGKey(0)
  a, _ = loss_fn(heads.params, {"tokens": jnp.asarray(toks)}, rng, frozen)
  b, _ = loss_fn(heads.params, {"tokens": jnp.asarray(toks), "feats": jnp.asarray(full[..., 32:]),
                                "full": jnp.asarray(full)}, rng, frozen)
  np.testing.assert_allclose(a, b, rtol=1e-4)
  # At the identity start the fused head's loss is the unfused one's.
  plain = dict(heads.params)
  plain.pop("fuse_w"), plain.pop("fuse_b")
  import dataclasses
  unfused = dataclasses.replace(heads, params=plain,
                                config=dataclasses.replace(heads.config, taps=()))
  c, _ = jax.jit(te.make_loss(tiny, unfused, noise=0.0))(plain, {"tokens": jnp.asarray(toks)},
                                                        rng, frozen)
  np.testing.assert_allclose(a, c, rtol=1e-5)
  g = jax.grad(lambda p: loss_fn(p, {"tokens": jnp.asarray(toks)}, rng, frozen)[0])(heads.params)
  assert float(jnp.abs(g["fuse_w"][0, :32]).sum()) > 0  # the taps' block learns
  fitted, losses = te.fit(tiny, heads, own_text(tiny, n=16), steps=60, lr=3e-3)
  assert losses[-1] < 0.7 * losses[0]
  assert float(jnp.abs(fitted.params["fuse_w"][0, :32]).max()) > 1e-3
  prompts = random_prompts(4, 61, seed=6)
  ref = sj.generate(tiny, prompts, max_new_tokens=16).tokens
  assert sj.generate(tiny, prompts, Eagle(fitted, depth=3, top_k=2, num_nodes=6),
                     max_new_tokens=16).tokens == ref


def test_taps_save_load_and_bad_taps(tmp_path, tiny):
  heads = init_heads(tiny, "eagle", seed=2, taps=(1,), scale=0.3)
  path = save_heads(heads, str(tmp_path / "f.npz"))
  back = load_heads(path, tiny)
  assert back.config == heads.config and back.config.taps == (1,)
  np.testing.assert_allclose(back.params["fuse_w"], heads.params["fuse_w"], rtol=2e-3, atol=2e-3)
  assert "fused taps [1]" in repr(back)
  with pytest.raises(InputError, match="fuse the outputs of target layers"):
    load_heads(path, stand_in(num_layers=1))
  n = decode.compile_cache.count
  for taps, match in (((0,), "taps"), ((2,), r"\[1, 1\]"), ((1, 1), "distinct"), ("1,x", "taps"),
                      ((1.5,), "integers")):
    with pytest.raises(InputError, match=match):
      init_heads(tiny, "eagle", taps=taps)
  with pytest.raises(InputError, match="EAGLE heads, not mtp"):
    init_heads(tiny, "mtp", taps=(1,))
  with pytest.raises(InputError, match="EAGLE heads, not medusa"):
    init_heads(tiny, "medusa", taps=(1,))
  # A fused head on a shallower target: refused before compiling.
  shallow = sj.Model.random(tiny_config(num_layers=1), seed=0, scale=0.3)
  with pytest.raises(InputError, match="has 1 layers"):
    sj.generate(shallow, [[1, 2, 3]], Eagle(heads, depth=2, top_k=2, num_nodes=4),
                max_new_tokens=4)
  assert decode.compile_cache.count == n
  from specjax.heads import check_taps
  assert check_taps("auto", 30) == (2, 15) and check_taps("2,15", 30) == (2, 15)
