"""Sharding on 8 simulated CPU devices: every method on data=2 x model=4 (and each kind of method
state on data=8 and model=8) gives autoregressive decoding's tokens on one device (greedy), and the
same seed draws the same tokens as on one device (sampling);
parameters really are split (per-device shard shapes); bad meshes fail before compiling;
data-parallel training steps match; two processes on localhost run one mesh (multi-host path).

XLA reads the device count once, when the backend starts, and in a normal `pytest tests` run other
modules have started it with one device. So in that run `test_on_8_simulated_devices` re-runs this
file in a child pytest with XLA_FLAGS=--xla_force_host_platform_device_count=8, where the other
tests run; the parent deselects them (conftest) and runs them through that child. Run them directly with

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/test_sharding.py
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

N_DEV = 8
FLAG = f"--xla_force_host_platform_device_count={N_DEV}"
CHILD = FLAG in os.environ.get("XLA_FLAGS", "")
HERE = os.path.dirname(os.path.abspath(__file__))

# Runs only where 8 devices exist: conftest deselects these in the parent process, whose
# test_on_8_simulated_devices runs this file again in a child with the 8-device flag.
on_8 = pytest.mark.eight_devices

MESHES = ["data=8", "model=8", "data=2,model=4"]
# The methods test_two_processes_on_localhost runs by name across two processes (mesh
# data=2,model=4)
WORKER_METHODS = ("autoregressive", "draft", "eagle", "medusa", "prompt-lookup", "lookahead")
MAX_NEW = 12


@pytest.mark.skipif(CHILD, reason="this is the child")
def test_on_8_simulated_devices():
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + FLAG).strip()
  env["JAX_PLATFORMS"] = "cpu"  # the simulated devices are CPU devices, on a GPU machine too
  r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                      os.path.abspath(__file__), os.path.join(HERE, "test_weights_stream.py")],
                     env=env, cwd=os.path.dirname(HERE),
                     capture_output=True, text=True, timeout=1800)
  tail = r.stdout[-6000:] + r.stderr[-3000:]
  assert r.returncode == 0, f"8-device sharding tests failed:\n{tail}"
  assert " passed" in r.stdout and "failed" not in r.stdout, tail
  print(r.stdout[-800:])


# ----------------------------------------------------------------------------- helpers (child)

if CHILD:
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  import specjax as sj
  from specjax import decode, sharding
  from specjax.model import from_flat, path_key

  from tests.helpers.models import random_adapters, random_prompts, tiny_model

  def target_model(**kw):
    # Every head count divides 8 (K=8, H=16, G=2), MLP width 48 too; vocab 61 (the suite's
    # default, so registry drafts fit) does not, and falls back to replication.
    base = dict(seed=0, num_heads=16, num_kv_heads=8, head_dim=4)
    base.update(kw)
    return tiny_model(**base)

  def available_methods():
    """(name, factory) for every greedy case of the lossless suite (tests/helpers/lossless.py)."""
    from tests.helpers.lossless import GREEDY_METHODS
    return sorted(GREEDY_METHODS)

  METHODS = available_methods()
  _REF: dict = {}

  def prompts():
    # Repetitive prompts give prompt lookup / lookahead something to match.
    ps = random_prompts(N_DEV, 61, seed=1, lo=3, hi=14)
    return [p + p[:4] + p for p in ps]

  def reference(name, factory, **kw):
    """One device's tokens: for greedy decoding, autoregressive decoding's (every method's greedy
    tokens are autoregressive decoding's, test_lossless); for sampling, the method's own."""
    if not kw:
      name, factory = "autoregressive", lambda _: sj.Autoregressive()
    key = (name, tuple(sorted(kw.items())))
    if key not in _REF:
      t = target_model()
      _REF[key] = sj.generate(t, prompts(), factory(t), max_new_tokens=MAX_NEW, **kw).tokens
    return _REF[key]
else:
  METHODS = []


# ----------------------------------------------------------------------------- tests (child)


@on_8
def test_eight_devices():
  assert jax.device_count() == N_DEV
  assert {n for n, _ in METHODS} >= {"autoregressive"}
  print("methods:", [n for n, _ in METHODS])


def _first_of_each_family(methods):
  """One case per method (the first variant of "eagle/...", "draft/...", ...)."""
  seen, out = set(), []
  for n, f in methods:
    if n.split("/")[0] not in seen:
      seen.add(n.split("/")[0])
      out.append((n, f))
  return out


# Suffix decoding's search and merged per-row tree run inside the hybrid case (which also drafts
# with prompt lookup and Medusa heads), and the hybrid's sampling is the trees' shared rule: one
# greedy hybrid case on the mixed mesh covers both.
MESH_ONCE = {"suffix": (), "hybrid": ("greedy",)}
METHODS = [(n, f) for n, f in METHODS if "greedy" in MESH_ONCE.get(n.split("/")[0], ("greedy",))]

# Greedy: one variant of each method on the mixed mesh (rows over data, heads and MLP over model:
# the variants of a method differ in settings, not in what is sharded); on the one-axis meshes the
# baseline and Medusa (heads and a static tree); every other method's state is sharded by the same
# rules, which the mixed mesh checks. Each compile on 8 simulated devices costs ~10 s, and this
# child is CI's longest test.
# The methods the two-process test (test_two_processes_on_localhost) runs on the same mixed mesh,
# across two processes, greedy and sampling, are not run on it again here.
FAMILIES = _first_of_each_family(METHODS)
ONE_AXIS = ("autoregressive", "medusa")
GREEDY_CASES = [(n, f, "data=2,model=4") for n, f in FAMILIES
                if n.split("/")[0] not in WORKER_METHODS] + [
    (n, f, m) for n, f in FAMILIES if n.split("/")[0] in ONE_AXIS
    for m in MESHES if m != "data=2,model=4"]


@on_8
@pytest.mark.filterwarnings("ignore::specjax.sharding.ShardingFallbackWarning")
@pytest.mark.parametrize("name,factory,mesh", GREEDY_CASES,
                         ids=[f"{n}-{m}" for n, _, m in GREEDY_CASES])
def test_greedy_identical_on_mesh(name, factory, mesh):
  ref = reference(name, factory)
  t = target_model()
  out = sj.generate(t, prompts(), factory(t), max_new_tokens=MAX_NEW, mesh=mesh)
  assert out.tokens == ref, f"{name} on mesh {mesh} differs from autoregressive decoding on one device"


SAMPLING = dict(temperature=0.9, top_p=0.95, seed=3)


# Sampling: the same seed draws the same tokens on a mesh wherever the draws happen: the baseline
# on the one-axis meshes, and on the mixed mesh one method per rule (a chain's rejection sampling
# with a second model, a static and a dynamic tree's multi-draft rule), as one process with 8
# devices (the two-process test draws them across processes); the other methods draw through
# these same rules.
SAMPLING_ONE = ("draft", "medusa", "eagle")
SAMPLING_CASES = [(n, f, "data=2,model=4") for n, f in FAMILIES
                  if n.split("/")[0] in SAMPLING_ONE] + [
    (n, f, m) for n, f in METHODS if n == "autoregressive" for m in MESHES if m != "data=2,model=4"]


@on_8
@pytest.mark.filterwarnings("ignore::specjax.sharding.ShardingFallbackWarning")
@pytest.mark.parametrize("name,factory,mesh", SAMPLING_CASES,
                         ids=[f"{n}-{m}" for n, _, m in SAMPLING_CASES])
def test_sampling_same_seed_same_tokens(name, factory, mesh):
  ref = reference(name, factory, **SAMPLING)
  t = target_model()
  out = sj.generate(t, prompts(), factory(t), max_new_tokens=MAX_NEW, mesh=mesh, **SAMPLING)
  assert out.tokens == ref, f"{name} sampling on mesh {mesh} differs from one device"


@on_8
@pytest.mark.filterwarnings("ignore::specjax.sharding.ShardingFallbackWarning")
def test_method_state_declared_replicated_on_mesh():
  """A method state with a per-row counter and a table declared replicated (Tally, in
  tests/helpers/decode.py): on a mesh its rows split over data and the table stays whole, with one
  device's results."""
  from tests.helpers.decode import Tally

  t = target_model()
  one = sj.generate(t, prompts(), Tally(), max_new_tokens=MAX_NEW)
  out = sj.generate(t, prompts(), Tally(), max_new_tokens=MAX_NEW, mesh="data=2,model=4")
  assert out.tokens == one.tokens == reference("autoregressive", lambda _: sj.Autoregressive())
  assert out.stats["tally"] == one.stats["tally"]


@on_8
@pytest.mark.filterwarnings("ignore::specjax.sharding.ShardingFallbackWarning")
def test_medusa2_adapted_model_on_mesh():
  """Medusa-2 is Medusa on the target with LoRA adapters merged in (specjax.lora, a model built
  on one device): on the mixed mesh it gives the adapted model's own greedy tokens, which are
  not the original's."""
  from specjax import lora
  from specjax.heads import init_heads

  t = target_model()
  adapted = lora.merged_model(t, random_adapters(t, rank=4, seed=3), 0.5, name="adapted")
  want = sj.generate(adapted, prompts(), sj.Autoregressive(), max_new_tokens=MAX_NEW).tokens
  assert want != reference("autoregressive", lambda _: sj.Autoregressive())
  heads = init_heads(adapted, "medusa", num_heads=3, seed=4, scale=3.0)
  out = sj.generate(adapted, prompts(), sj.Medusa(heads, tree=[(0,), (1,), (0, 0), (0, 0, 0)]),
                    max_new_tokens=MAX_NEW, mesh="data=2,model=4")
  assert out.tokens == want


@on_8
@pytest.mark.parametrize("tied", [False, True])
def test_vocab_sharded_model_identical(tied):
  """Vocab 64 divides model=8: embedding and LM head really split (tied and untied)."""
  t = target_model(vocab_size=64, tie_word_embeddings=tied)
  ps = random_prompts(N_DEV, 64, seed=2)
  ref = sj.generate(t, ps, max_new_tokens=MAX_NEW).tokens
  with warnings.catch_warnings():
    warnings.simplefilter("error", sharding.ShardingFallbackWarning)  # nothing falls back here
    for mesh in ("model=8", "data=2,model=4"):
      assert sj.generate(t, ps, max_new_tokens=MAX_NEW, mesh=mesh).tokens == ref, mesh


@on_8
def test_params_really_sharded():
  """Per-device shard shapes follow the rules; each device holds ~1/4 of the parameters."""
  t = target_model(vocab_size=64)
  c = t.config
  e, k, g, d, h, f, v = (c.hidden_size, c.num_kv_heads, c.group_size, c.head_dim, c.num_heads,
                         c.intermediate_size, c.vocab_size)
  mesh = sharding.make_mesh("data=2,model=4")
  params = sharding.shard_params(mesh, t.params)
  flat = {path_key(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  want = {
      ("embed",): (v // 4, e),
      ("lm_head",): (e, v // 4),
      ("layers", 0, "attn", "wqkv"): (e, k // 4, g + 2, d),
      ("layers", 1, "attn", "wo"): (h // 4, d, e),
      ("layers", 0, "mlp", "w_in"): (e, 2, f // 4),
      ("layers", 1, "mlp", "w_out"): (f // 4, e),
      ("final_norm", "scale"): (e,),  # replicated
  }
  for key, shape in want.items():
    x = flat[key]
    assert len(x.addressable_shards) == N_DEV
    assert {tuple(s.data.shape) for s in x.addressable_shards} == {shape}, key
  # Different model-axis devices hold different slices (not copies).
  w = flat[("layers", 0, "mlp", "w_out")]
  s0, s1 = (np.asarray(s.data) for s in w.addressable_shards[:2])
  assert not np.array_equal(s0, s1)
  per_dev = sharding.device_bytes(params)
  report = sharding.memory_report(mesh, t.params)
  assert set(per_dev.values()) == {report.per_device_bytes}
  assert report.per_device_bytes < report.total_bytes / 3  # mostly split four ways
  assert report.fallbacks == []


@on_8
def test_load_places_sharded_without_whole_tensors():
  """from_flat(place=placer(mesh)) (what load_model(mesh=) uses) builds each device's shard
  from its slice of the host tensor; no device ever receives a whole sharded tensor."""
  t = target_model(vocab_size=64)
  flat = {path_key(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(t.params)[0]}
  mesh = sharding.make_mesh("model=8")
  place = sharding.placer(mesh)
  requested = []
  orig = jax.make_array_from_callback

  def spy(shape, sh, cb, *a, **kw):
    return orig(shape, sh, lambda idx: requested.append((shape, np.shape(cb(idx)))) or cb(idx),
                *a, **kw)

  jax.make_array_from_callback = spy
  try:
    _, params = from_flat(t.config, flat, place=place)
  finally:
    jax.make_array_from_callback = orig
  wqkv = [r for r in requested if r[0] == flat[("layers", 0, "attn", "wqkv")].shape]
  assert wqkv and all(r[1][1] == t.config.num_kv_heads // 8 for r in wqkv)
  ref = sj.generate(t, prompts(), max_new_tokens=MAX_NEW).tokens
  m2 = sj.Model(t.config, t.graphdef, params)
  assert sharding.mesh_of(m2.params) is not None
  assert sj.generate(m2, prompts(), max_new_tokens=MAX_NEW).tokens == ref  # mesh taken from params


@on_8
def test_load_model_mesh_from_checkpoint(tmp_path):
  """load_model(path, mesh=) on a saved HF-layout checkpoint: sharded params, same tokens."""
  safetensors = pytest.importorskip("safetensors.numpy")
  t = target_model(vocab_size=64)
  c = t.config
  flat = {path_key(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(t.params)[0]}
  k, g, d, e = c.num_kv_heads, c.group_size, c.head_dim, c.hidden_size
  out = {"model.embed_tokens.weight": flat[("embed",)], "model.norm.weight": flat[("final_norm", "scale")],
         "lm_head.weight": flat[("lm_head",)].T}
  for i in range(c.num_layers):
    L, p = ("layers", i), f"model.layers.{i}."
    w = flat[L + ("attn", "wqkv")].transpose(1, 2, 3, 0)  # [K,G+2,D,E]
    out[p + "self_attn.q_proj.weight"] = w[:, :g].reshape(k * g * d, e)
    out[p + "self_attn.k_proj.weight"] = w[:, g].reshape(k * d, e)
    out[p + "self_attn.v_proj.weight"] = w[:, g + 1].reshape(k * d, e)
    out[p + "self_attn.o_proj.weight"] = flat[L + ("attn", "wo")].reshape(-1, e).T
    out[p + "mlp.gate_proj.weight"] = flat[L + ("mlp", "w_in")][:, 0].T
    out[p + "mlp.up_proj.weight"] = flat[L + ("mlp", "w_in")][:, 1].T
    out[p + "mlp.down_proj.weight"] = flat[L + ("mlp", "w_out")].T
    out[p + "input_layernorm.weight"] = flat[L + ("attn_norm", "scale")]
    out[p + "post_attention_layernorm.weight"] = flat[L + ("mlp_norm", "scale")]
  safetensors.save_file({n: np.ascontiguousarray(a, np.float32) for n, a in out.items()},
                        str(tmp_path / "model.safetensors"))
  (tmp_path / "config.json").write_text(json.dumps(dict(
      architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=c.vocab_size,
      hidden_size=e, num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
      num_key_value_heads=k, head_dim=d, intermediate_size=c.intermediate_size,
      max_position_embeddings=c.max_position_embeddings, rope_theta=c.rope_theta,
      rms_norm_eps=c.norm_eps, tie_word_embeddings=False)))
  m = sj.load_model(str(tmp_path), tokenizer=False, dtype=jnp.float32, mesh="data=2,model=4")
  wqkv = m.params["layers"][0]["attn"]["wqkv"][...]
  assert {s.data.shape for s in wqkv.addressable_shards} == {(e, k // 4, g + 2, d)}
  ps = random_prompts(N_DEV, 64, seed=2)
  assert sj.generate(m, ps, max_new_tokens=MAX_NEW).tokens == \
      sj.generate(t, ps, max_new_tokens=MAX_NEW).tokens


@on_8
@pytest.mark.filterwarnings("ignore::specjax.sharding.ShardingFallbackWarning")
def test_draft_params_sharded_too():
  names = [n for n, _ in METHODS]
  factory = dict(METHODS)[next(n for n in names if "draft" in n and "self" not in n)]
  method = factory(target_model())
  arrays = sharding.shard_params("model=8", method.arrays(target_model()))
  flat = {path_key(p): x for p, x in jax.tree_util.tree_flatten_with_path(arrays)[0]}
  mlp = [x for key, x in flat.items() if key[-2:] == ("mlp", "w_out")]
  assert mlp and all(len({str(s.index) for s in x.addressable_shards}) == N_DEV for x in mlp)


@on_8
def test_cache_and_state_sharded_inside_the_program():
  """The KV cache built inside jit is split rows over data and kv heads over model."""
  t = target_model()
  mesh = sharding.make_mesh("data=2,model=4")
  prog = decode.Program(t.graphdef, t.config, sj.Autoregressive(), 64, mesh)
  b, p = 8, 16
  prompt = jnp.ones((b, p), jnp.int32)
  run = jax.jit(lambda params, prompt: decode.prefill(
      prog, params, prompt, jnp.full((b,), 5), jnp.full((b,), 4),
      sj.sampling.SamplingParams.make(b), jax.random.PRNGKey(0), jnp.array([-1]), 1)[0])
  state = run(sharding.shard_params(mesh, t.params), prompt)
  k = state.cache.layers[0]["k"]
  assert sharding.cache_spec(mesh, t.config.num_kv_heads) == P("data", "model", None, None)
  assert k.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, P("data", "model")), 4)
  assert {s.data.shape for s in k.addressable_shards} == {(b // 2, t.config.num_kv_heads // 4, 64,
                                                          t.config.head_dim)}
  assert state.seq.sharding.spec[0] == "data"


@on_8
def test_fallback_when_heads_do_not_divide():
  """SmolLM2 head counts (9 query, 3 kv) on model=2: attention replicated, said once,
  counted in the memory report, outputs still identical."""
  t = tiny_model(seed=0, num_heads=9, num_kv_heads=3, head_dim=8, vocab_size=64)
  ps = random_prompts(4, 64, seed=4)
  ref = sj.generate(t, ps, max_new_tokens=MAX_NEW).tokens
  with pytest.warns(sharding.ShardingFallbackWarning) as rec:
    params = sharding.shard_params("data=2,model=2", t.params)
  msgs = [str(w.message) for w in rec if issubclass(w.category, sharding.ShardingFallbackWarning)]
  assert len(msgs) == 1 and "attn/wqkv" in msgs[0] and "attn/wo" in msgs[0]
  report = sharding.memory_report("data=2,model=2", t.params)
  assert report.fallbacks and report.fallback_bytes > 0
  assert "replicated by fallback" in str(report)
  assert sj.generate(sj.Model(t.config, t.graphdef, params), ps, max_new_tokens=MAX_NEW).tokens == ref
  with pytest.raises(sharding.ShardingError, match="does not divide"):
    sharding.shard_params("model=2", t.params, strict=True)


@on_8
@pytest.mark.parametrize("mesh,match", [
    ("data=2,tensor=4", "unknown axis name"),
    ("data=16", "needs 16 devices but only 8 exist"),
    ("data=4,model=4", "needs 16 devices"),
    ("data:2", "not 'axis=size'"),
    ("model=0", "must be an integer >= 1"),
    ("model=5", "divides none of the dimensions"),
    ("data=8", "batch of 3 prompts does not divide by mesh axis data=8"),
])
def test_bad_mesh_raises_before_compiling(mesh, match):
  t = tiny_model(seed=0)  # K=2, H=4, F=48, V=61: model=5 divides none of them
  before = decode.compile_cache.count
  with pytest.raises(sharding.ShardingError, match=match):
    sj.generate(t, random_prompts(3, 61), max_new_tokens=4, mesh=mesh)
  assert decode.compile_cache.count == before
  assert issubclass(sharding.ShardingError, sj.InputError)


@on_8
def test_bad_mesh_objects_and_rules():
  from jax.sharding import Mesh
  with pytest.raises(sharding.ShardingError, match="unknown axis name"):
    sharding.make_mesh(Mesh(np.asarray(jax.devices()).reshape(2, 4), ("x", "y")))
  m = sharding.make_mesh(Mesh(np.asarray(jax.devices()[:4]), ("model",)))
  assert dict(m.shape) == {"data": 1, "model": 4}
  with pytest.raises(sharding.ShardingError, match="unknown mesh axis 'tensor'"):
    sharding.shard_params("model=2", tiny_model().params, rules=((r".*", P("tensor")),))
  with pytest.raises(sharding.ShardingError, match="load_model|unknown axis"):
    sj.load_model("smollm2-135m", mesh="data=2,heads=4")  # fails before reading the weights
  assert dict(sharding.make_mesh("model=-1").shape) == {"data": 1, "model": 8}


@on_8
def test_user_rules_override():
  t = tiny_model(seed=0, vocab_size=64)
  rules = ((r"(^|/)embed$", P(None, "model")),) + sharding.DEFAULT_RULES  # split E instead of V
  params = sharding.shard_params("model=4", t.params, rules=rules)
  assert {s.data.shape for s in params["embed"][...].addressable_shards} == {(64, 8)}


# Every family (specjax/arch) on the mixed mesh, loaded from its tiny random HF checkpoint
# (tests/helpers/families.py's builders) with 8 query / 4 kv heads, vocab 128 and MLP width 96
# (GPT-2: 8 heads, 256): every dimension the rules split divides model=4, so nothing may fall back
# to replication. One short greedy generation each (one compile), against transformers' own greedy
# generate, which the one-device model equals token for token (tests/arch/test_families.py).
# One model per family module beside llama's (tested above): Gemma 3 holds every Gemma tensor
# kind (q/k norms as Qwen3's, the post norms of Gemma 2), Phi-3 the fused projections, GPT-2 the
# biases and learned positions.
ARCH_FAMILIES = ("gemma3", "phi3", "gpt2")


@on_8
@pytest.mark.parametrize("family", ARCH_FAMILIES)
def test_every_family_sharded_by_the_rules(family, tmp_path):
  import torch
  import transformers
  from tests.helpers.families import build_hf

  if family == "gpt2":
    ref = build_hf(family, str(tmp_path), cfg=transformers.GPT2Config(
        vocab_size=128, n_embd=64, n_layer=2, n_head=8, n_positions=256, bos_token_id=None,
        eos_token_id=None))
  else:
    ref = build_hf(family, str(tmp_path), vocab_size=128, num_attention_heads=8,
                   num_key_value_heads=4)
  with warnings.catch_warnings():
    warnings.simplefilter("error", sharding.ShardingFallbackWarning)
    m = sj.load_model(str(tmp_path), tokenizer=False, mesh="data=2,model=4")
  for path, x in jax.tree_util.tree_flatten_with_path(m.params)[0]:
    name = sharding.path_str(path_key(path))
    if x.ndim >= 2 and name != "pos_embed":  # every matrix split over model, none replicated
      assert x.addressable_shards[0].data.size * 4 == x.size, (family, name)
  prompts = np.random.default_rng(3).integers(0, 128, size=(2, 8))
  out = sj.generate(m, prompts.tolist(), max_new_tokens=MAX_NEW)
  with torch.no_grad():
    want = ref.generate(torch.tensor(prompts), attention_mask=torch.ones(2, 8, dtype=torch.long),
                        max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
  assert out.tokens == want[:, 8:].tolist(), family


# SmolLM2-135M (from its config.json): 9 query / 3 kv heads, E=576, F=1536, V=49152, tied.
SMOLLM2 = dict(arch="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
               num_kv_heads=3, head_dim=64, intermediate_size=1536, max_position_embeddings=8192,
               rope_theta=100000.0, tie_word_embeddings=True)


@on_8
@pytest.mark.filterwarnings("ignore::specjax.sharding.ShardingFallbackWarning")
def test_smollm2_memory_report():
  """Per-device parameter memory on model=1, 2, 4, 8 from shard shapes (no weights needed)."""
  from flax import nnx
  from specjax.model import Decoder

  cfg = sj.ModelConfig(**SMOLLM2)
  abstract = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))))[1]
  rows = {n: sharding.memory_report(f"model={n}", abstract) for n in (1, 2, 4, 8)}
  for n, r in rows.items():
    print(r)
  norms = (2 * cfg.num_layers + 1) * cfg.hidden_size  # num_params leaves norms out
  assert rows[1].per_device_bytes == rows[1].total_bytes == (cfg.num_params + norms) * 2
  assert rows[8].per_device_bytes < rows[4].per_device_bytes < rows[2].per_device_bytes \
      < rows[1].per_device_bytes
  assert rows[2].fallbacks  # 3 kv heads / 9 query heads do not split in 2
  assert all(n.endswith(("attn/wqkv", "attn/wo")) for n in rows[2].fallbacks)


@on_8
def test_data_parallel_training_step_matches():
  """shard_batch + shard_params: an optax step on data=8 (and data=2,model=4) equals one device."""
  optax = pytest.importorskip("optax")
  from specjax import cache as kv

  # A realistically scaled model: the suite's scale=0.3 makes logits so sharp that float
  # reduction-order noise (1e-7) grows to 1e-3 in the gradients.
  t = target_model(vocab_size=64, scale=0.05)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 64, size=(16, 12)).astype(np.int32)
  opt = optax.sgd(0.1, momentum=0.9)  # adam divides by |g|: it would amplify float noise

  def loss_fn(params, tokens):
    b, n = tokens.shape
    cache = kv.init(t.config.num_layers, b, n, t.config.num_kv_heads, t.config.head_dim)
    mask = kv.causal_mask(cache.lengths, n, n)
    pos = jnp.broadcast_to(jnp.arange(n), (b, n))
    logits, _, _ = t.apply(params, tokens, pos, cache, mask)
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

  @jax.jit
  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  p1, _, l1 = step(t.params, opt.init(t.params), tokens)
  for mesh in ("data=8", "data=2,model=4"):
    params = sharding.shard_params(mesh, t.params)
    opt_state = sharding.shard_params(mesh, opt.init(params))
    p2, s2, l2 = step(params, opt_state, sharding.shard_batch(mesh, {"t": tokens})["t"])
    np.testing.assert_allclose(l2, l1, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(p2)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    if "model" in mesh:
      w = p2["layers"][0]["mlp"]["w_out"][...]
      assert {s.data.shape for s in w.addressable_shards} == {(12, 32)}  # stays sharded
  with pytest.raises(sharding.ShardingError, match="leading dim must divide"):
    sharding.shard_batch("data=8", {"t": tokens[:6]})


# ----------------------------------------------------------------------------- multi-process


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start_workers(tmp_path, mode: str, env_extra: dict | None = None) -> list:
  """Two worker processes of this file (`_worker`), 4 simulated CPU devices each."""
  port = _free_port()
  env = dict(os.environ)
  # The suite's XLA flags (conftest) too: the workers import no conftest to set them.
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
  env["JAX_PLATFORMS"] = "cpu"  # 4 simulated CPU devices per process, on a GPU machine too
  env["SPECJAX_CACHE"] = str(tmp_path / "cache")  # the processes' shared cache folder
  env.update(env_extra or {})
  return [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", mode, str(i),
                            str(port), str(tmp_path)], env=env, cwd=os.path.dirname(HERE),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
          for i in range(2)]


def _wait(procs, timeout: float) -> list[str]:
  logs = []
  for p in procs:
    try:
      logs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      pytest.fail("multi-process workers timed out")
  return logs


@pytest.mark.skipif(CHILD, reason="run once, from the parent")
def test_two_processes_on_localhost(tmp_path):
  """The multi-host path for real: 2 processes x 4 CPU devices, jax.distributed on localhost
  (specjax.distributed.initialize), target and drafters sharded over the 8 global devices,
  data=2,model=4. Every method built by name, its sizes from a cost curve that process 0
  measures for both: in both processes the one-device tokens, greedy (autoregressive's) and at
  temperature 0.8 with a fixed seed (the method's own on one device). Files written once; prompts
  that differ across processes and a mesh leaving a process out are named errors."""
  logs = _wait(_start_workers(tmp_path, "agree"), timeout=600)
  for i, log in enumerate(logs):
    assert f"worker {i} ok" in log, f"worker {i} failed:\n{log[-3000:]}"
  outs = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(2)]
  assert outs[0] == outs[1]  # the same sizes, tokens, files and errors in both processes
  o = outs[0]
  assert o["devices"] == 8 and o["processes"] == 2
  assert o["curve_source"] == "measured" and len(o["curve"]) > 2
  assert sorted(o["sharded"]) == sorted(WORKER_METHODS)
  for name, runs in o["sharded"].items():
    assert runs["greedy"] == o["one_device"]["autoregressive/greedy"], name
    assert runs["sampled"] == o["one_device"][f"{name}/sampled"], name
  calibration = os.listdir(tmp_path / "cache" / "calibration")
  assert len(calibration) == 1 and calibration[0].endswith(".json"), calibration
  assert sorted(os.listdir(tmp_path / "report")) == ["r.json", "r.md"]
  assert "prompts and generation settings differ" in o["errors"]["prompts"]
  assert "leaves out process(es) [1]" in o["errors"]["mesh"]


@pytest.mark.skipif(CHILD, reason="run once, from the parent")
def test_lost_process_is_named(tmp_path):
  """One of two workers dies mid-generation (os._exit): the other ends within 60 s with exit
  status distributed.LOST_EXIT and a line naming the lost process."""
  from specjax import distributed

  procs = _start_workers(tmp_path, "kill")
  try:
    log0 = procs[0].communicate(timeout=150)[0]
    ended = time.time()
    log1 = procs[1].communicate(timeout=30)[0]
  finally:
    for p in procs:
      p.kill()
  died = [float(line.split()[1]) for line in log1.splitlines() if line.startswith("dying ")]
  assert died, f"worker 1 never reached its end:\n{log1[-3000:]}"
  assert procs[0].returncode == distributed.LOST_EXIT, log0[-3000:]
  assert "specjax: process 0 of 2 lost process 1" in log0, log0[-3000:]
  assert ended - died[0] < 60, f"the survivor ended {ended - died[0]:.1f} s after the loss"
  print(f"the survivor ended {ended - died[0]:.1f} s after worker 1 died")


WORKER_SAMPLING = dict(temperature=0.8, seed=11)


def _worker_drafters(target, tiny_model, init_heads) -> dict:
  """name -> the drafter keyword for methods.build, held-out numbers set so that the cost curve
  chooses each method's sizes (methods/defaults.py)."""
  draft = tiny_model(seed=7, scale=0.15, vocab_size=target.config.vocab_size)
  draft.asset_header = {"held_out_top1": 0.6}
  eagle = dataclasses.replace(init_heads(target, "eagle", seed=5, scale=0.5), meta={
      "held_out": {"top1": 0.7, "top1_2": 0.5, "top1_3": 0.4}})
  medusa = dataclasses.replace(init_heads(target, "medusa", num_heads=3, seed=4, scale=3.0), meta={
      "held_out": {f"top{r}_{k}": (0.6 if r == 1 else 0.85) / (k + 1)
                   for k in range(3) for r in (1, 5)}})
  return {"draft": {"draft": draft}, "eagle": {"heads": eagle}, "medusa": {"heads": medusa}}


def _on_mesh(model, mesh):
  """model with its params placed on mesh (each process builds only its own shards)."""
  import specjax as sj
  from specjax import sharding

  out = sj.Model(model.config, model.graphdef, sharding.shard_params(mesh, model.params),
                 model.tokenizer, name=model.name, dtype=model.dtype)
  out.asset_header = getattr(model, "asset_header", None)
  return out


def _agree(i: int, tmp: str) -> dict:
  """The agreeing worker's runs (test_two_processes_on_localhost)."""
  import jax

  import specjax as sj
  from specjax import bench, calibrate, distributed, methods, sharding
  from specjax.heads import init_heads
  from specjax.methods import defaults
  from tests.helpers.models import random_prompts, tiny_model

  os.environ["SPECJAX_CALIBRATION"] = "quick"  # (conftest switches it off)
  mesh = sharding.make_mesh("data=2,model=4")
  t = tiny_model(seed=0, num_heads=8, num_kv_heads=4, head_dim=8, vocab_size=64)
  t.name = "tiny-target"
  st = _on_mesh(t, mesh)
  ps = [p + p[:4] + p for p in random_prompts(4, 64, seed=1, lo=3, hi=10)]
  rec = calibrate.calibration(st)
  out = {"devices": jax.device_count(), "processes": jax.process_count(), "sharded": {},
         "curve": rec["curve"], "curve_source": rec["source"], "one_device": {}, "errors": {}}
  one = {n: kw for n, kw in _worker_drafters(t, tiny_model, init_heads).items()}
  on = {n: {k: _on_mesh(v, mesh) if k == "draft" else v for k, v in kw.items()}
        for n, kw in one.items()}
  gen = dict(max_new_tokens=8)
  out["one_device"]["autoregressive/greedy"] = sj.generate(t, ps, **gen).tokens
  for name in WORKER_METHODS:
    drafter = next(iter(one.get(name, {None: None}).values()))
    chosen = defaults.choose(name, st, drafter, {})
    m = methods.build(name, st, **on.get(name, {}))  # by name: sizes from the agreed curve
    out["sharded"][name] = {"greedy": sj.generate(st, ps, m, **gen).tokens,
                            "sampled": sj.generate(st, ps, m, **gen, **WORKER_SAMPLING).tokens}
    local = methods.build(name, t, **one.get(name, {}), **chosen)
    out["one_device"][f"{name}/sampled"] = sj.generate(t, ps, local, **gen,
                                                       **WORKER_SAMPLING).tokens
  bench.save_report(os.path.join(tmp, "report"), "r", {"process": "0"}, "| one table |")
  for what, fn in (("prompts", lambda: sj.generate(st, ps if i == 0 else ps[::-1], **gen)),
                   ("mesh", lambda: sharding.make_mesh("data=1,model=4"))):
    try:
      fn()
    except distributed.DistributedError as e:
      out["errors"][what] = str(e)
  return out


def _lose_one(i: int, tmp: str) -> None:
  """The kill test's worker: decodes on the mesh in a loop; worker 1 dies (os._exit) just after
  its second call starts, mid-generation; worker 0 should end in the watchdog."""
  import threading

  import specjax as sj
  from tests.helpers.models import random_prompts, tiny_model

  t = tiny_model(seed=0, num_heads=8, num_kv_heads=4, head_dim=8, vocab_size=64)
  ps = random_prompts(4, 64, seed=1)
  for k in range(200):
    if i == 1 and k == 2:
      threading.Timer(0.05, lambda: (print(f"dying {time.time()}", flush=True),
                                     os._exit(9))).start()
    sj.generate(t, ps, max_new_tokens=64, mesh="data=2,model=4")


def _worker(mode: str, i: int, port: int, tmp: str) -> None:
  from specjax import distributed

  distributed.initialize(f"127.0.0.1:{port}", 2, i)
  import jax

  sys.path.insert(0, os.path.dirname(HERE))  # the repository: tests.helpers
  if mode == "kill":
    _lose_one(i, tmp)
    return
  out = _agree(i, tmp)
  with open(os.path.join(tmp, f"out{i}.json"), "w") as f:
    json.dump(out, f)
  print(f"worker {i} ok", flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "--worker":
  _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
