"""The paper-reproduction scripts (experiments/{leviathan,lookahead,medusa,eagle,dflash}/run.py) and
experiments/batched run end to end on a tiny random HF checkpoint: each writes its JSON / markdown
(/ PNG) report with the rows it promises, greedy runs are token-identical to autoregressive decoding, and Leviathan's target-as-
its-own-draft cell is exact (alpha = 1, tau = gamma + 1).

Every option is shrunk (one short prompt, 12 new tokens, one configuration per sweep), so the
time is compiling: one program per method configuration. Timing numbers from these runs mean
nothing (a 2-layer, 64-wide model) and are not checked.
"""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

from tests.helpers.tinyhf import save_tiny_hf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load_script(name: str, script: str = "run.py"):
  """experiments/<name>/<script> as a module (experiments/ is not a package)."""
  path = os.path.join(ROOT, "experiments", name, script)
  spec = importlib.util.spec_from_file_location(f"experiment_{name}_{script[:-3]}", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
  return save_tiny_hf(str(tmp_path_factory.mktemp("tinyhf")))


@pytest.fixture(scope="session")
def prompt_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("prompts") / "short.txt"
  path.write_text("The quick brown fox\n")
  return str(path)


def common(tiny_dir, prompt_file, out) -> list[str]:
  """The options every script shares: same prompt and length, so the autoregressive baseline's
  program compiles once for the whole session."""
  return ["--quick", "--model", tiny_dir, "--out", str(out), "--sets", prompt_file,
          "--prompts", "1", "--new", "12", "--cost-reps", "1", "--repeats", "1"]


def rerenders(mod, out, md: str, stem="results_quick") -> None:
  """`run.py --render` rebuilds the same markdown (and a PNG) from the raw JSON alone."""
  os.remove(os.path.join(out, f"{stem}.md"))
  os.remove(os.path.join(out, f"{stem}.png"))
  mod.main(["--render", os.path.join(out, f"{stem}.json")])
  assert report(out, stem)[1] == md


def report(out, stem="results_quick") -> tuple[dict, str]:
  """Checks the three files exist; returns (the JSON, the markdown)."""
  paths = {ext: os.path.join(out, f"{stem}.{ext}") for ext in ("json", "md", "png")}
  for p in paths.values():
    assert os.path.isfile(p) and os.path.getsize(p) > 0, p
  with open(paths["png"], "rb") as f:
    assert f.read(8) == PNG_MAGIC
  with open(paths["json"]) as f:
    data = json.load(f)
  with open(paths["md"]) as f:
    md = f.read()
  assert data["machine"]["load_average"] and data["machine"]["load_average_end"] and data["machine"]["date"]
  return data, md


def test_leviathan(tiny_dir, prompt_file, tmp_path):
  mod = load_script("leviathan")
  mod.main(common(tiny_dir, prompt_file, tmp_path) + ["--drafts", "self,random", "--gammas", "2"])
  data, md = report(tmp_path)
  rows = {r["draft"]: r for r in data["rows"]}
  assert set(rows) == {"target itself", "random"}
  own = rows["target itself"]
  assert own["gamma"] == 2 and own["alpha"] == 1.0 and own["alpha_cell"] == 1.0
  assert own["tau"] == 3.0 and own["E"] == 3.0 and own["rel_err"] == 0.0
  assert all(r["identical"] for r in data["rows"])  # greedy: the same tokens as autoregressive
  rnd = rows["random"]
  assert 0.0 <= rnd["alpha"] < 0.5 and 1.0 <= rnd["tau"] <= 3.0
  assert {"c", "c_verify", "pred_speedup", "speedup"} <= set(own)
  assert "| target itself | 0 | 2 | 1.000 | 3.000 | 3.000 | +0.0% | 3.000 (+0.0%) |" in md
  rerenders(mod, tmp_path, md)


def test_lookahead(tiny_dir, prompt_file, tmp_path):
  mod = load_script("lookahead")
  mod.main(common(tiny_dir, prompt_file, tmp_path) + ["--windows", "2", "--ngrams", "3"])
  data, md = report(tmp_path)
  (row,) = data["rows"]
  assert (row["window"], row["ngram"], row["guess"]) == (2, 3, 2)
  assert row["tokens_per_step"] == 1 + (2 + 2) * 2 and row["identical"] and row["tau"] >= 1.0
  assert "3" in data["fits"] and "| 2 | 3 | 2 | 9 |" in md
  rerenders(mod, tmp_path, md)


def test_medusa(tiny_dir, prompt_file, tmp_path):
  mod = load_script("medusa")
  mod.main(common(tiny_dir, prompt_file, tmp_path)
           + ["--heads", "random", "--nodes", "2", "--epsilons", "0.09", "--cost-sizes", "1,2,4"])
  data, md = report(tmp_path)
  assert len(data["accuracy"]) == 4 and all(0 <= r["bench_top5"] <= 1 for r in data["accuracy"])
  assert data["rows"] and all(r["identical"] for r in data["rows"])
  typical = {r["method"]: r for r in data["typical"]}
  assert set(typical) == {"autoregressive (sampling)", "medusa exact", "typical eps=0.09"}
  assert typical["typical eps=0.09"]["identical_at_T0"] is True  # typical is greedy at T = 0
  assert 0 <= typical["typical eps=0.09"]["differ_from_argmax"] <= 1
  assert "Typical acceptance" in md
  rerenders(mod, tmp_path, md)  # (how results.md was regenerated from the first version's run)


def test_eagle(tiny_dir, prompt_file, tmp_path):
  mod = load_script("eagle")
  mod.main(common(tiny_dir, prompt_file, tmp_path)
           + ["--heads", "random", "--mtp-heads", "random", "--nodes", "4", "--depth", "2",
              "--depths", "2", "--depth-nodes", "4", "--top-k", "2", "--static-nodes", "4"])
  data, md = report(tmp_path)
  kinds = [r["kind"] for r in data["rows"]]
  assert kinds == ["EAGLE-2 dynamic", "EAGLE-1 static", "MTP"]
  assert all(r["identical"] for r in data["rows"])
  mtp = data["rows"][-1]
  assert len(mtp["depth_acceptance"]) == 2  # two random MTP modules: depths 1 and 2
  assert "random eagle heads" in data["heads"]["eagle"] and "DeepSeek-V3" in md
  rerenders(mod, tmp_path, md)


def test_dflash_block_size(tiny_dir, prompt_file, tmp_path):
  """DFlash's acceptance-against-block-size experiment on random heads written with a held-out
  record: one row per block size and set, greedy-identical, each with the held-out prediction."""
  import specjax as sj
  from specjax.heads import save_heads

  target = sj.load_model(tiny_dir, tokenizer=False)
  heads = sj.init_heads(target, "dflash", mask_token_id=target.config.vocab_size - 1,
                        block_size=4)
  held = {"top1_0": 0.5, "top1_1": 0.4, "top1_2": 0.2}
  path = save_heads(heads, str(tmp_path / "d.npz"), meta={"held_out": held, "steps": 3})
  mod = load_script("dflash")
  mod.main(["--quick", "--model", tiny_dir, "--heads", path, "--out", str(tmp_path), "--sets",
            prompt_file, "--prompts", "1", "--new", "12", "--repeats", "1", "--blocks", "2,4",
            "--beside", ""])
  data, md = report(tmp_path)
  assert [(r["method"], r["block"]) for r in data["rows"]] == [("dflash/2", 2), ("dflash/4", 4)]
  assert all(r["identical"] and r["tau"] >= 1 for r in data["rows"])
  np.testing.assert_allclose([r["predicted"] for r in data["rows"]],
                             [1.5, 1 + 0.5 + 0.2 + 0.04])
  assert "| top-1 | 0.500 | 0.400 | 0.200 |" in md
  rerenders(mod, tmp_path, md)


def test_eagle_tau_compares_heads_files(tiny_dir, prompt_file, tmp_path):
  """experiments/eagle/tau.py: acceptance only, several heads files on the same prompts."""
  import importlib.util

  import specjax as sj
  from specjax.heads import save_heads

  path = os.path.join(ROOT, "experiments", "eagle", "tau.py")
  spec = importlib.util.spec_from_file_location("experiment_eagle_tau", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  target = sj.load_model(tiny_dir)
  files = []
  for seed in (0, 1):
    files.append(str(tmp_path / f"h{seed}.npz"))
    save_heads(sj.init_heads(target, "eagle", seed=seed), files[-1])
  rows = mod.main(["--model", tiny_dir, "--heads", ",".join(files), "--nodes", "4", "--depth",
                   "2", "--top-k", "2", "--sets", prompt_file, "--prompts", "1", "--new", "12",
                   "--json", str(tmp_path / "tau.json")])
  assert [r["heads"] for r in rows] == files and all(r["identical"] for r in rows)
  assert all(r["tau"] >= 1 and len(r["depth_acceptance"]) == 2 for r in rows)
  with open(tmp_path / "tau.json") as f:
    assert [r["tau"] for r in json.load(f)["rows"]] == [r["tau"] for r in rows]
  with pytest.raises(sj.SpecJaxError):
    mod.main(["--model", tiny_dir, "--heads", str(tmp_path / "missing.npz")])


def test_medusa_ceiling(tmp_path):
  """ceiling.py on the shipped heads' header: the predicted tau never falls with more nodes, the
  scale it reports brings the best tree to the goal (and no smaller scale does), and a goal the
  heads already meet needs no scale."""
  mod = load_script("medusa", "ceiling.py")
  out = mod.main(["--nodes", "4,8,16,64", "--goal", "2.3", "--at", "16", "--json", str(tmp_path / "c.json")])
  r = out["measured"]
  taus = list(r["predicted_tau"].values())
  assert taus == sorted(taus) and 1.0 < taus[0]
  acc = np.asarray(r["per_rank_accuracy"])
  s = r["needed_scale"]
  assert 1.0 < s < 64
  assert mod.predicted_tau(np.minimum(acc * s * (1 + 1e-9), 1), 16) >= 2.3 - 1e-6
  assert mod.predicted_tau(np.minimum(acc * s * 0.99, 1), 16) < 2.3
  assert mod.needed_scale(acc, taus[0] - 0.01, 4) == 1.0
  assert mod.needed_scale(acc, 100.0, 4) == float("inf")  # 4 nodes accept at most 4 tokens
  assert json.load(open(tmp_path / "c.json"))["measured"]["needed_scale"] == s


def test_eagle_taps_ablation(tiny):
  """taps.py: the held-out top-1 per depth it computes is make_loss's (one batch, so the same
  positions), and zeroing a fitted fused head's tap block changes what the head drafts."""
  import jax
  import jax.numpy as jnp

  from specjax.heads import init_heads
  from specjax.training import eagle as te

  from tests.helpers.models import random_prompts

  import specjax as sj

  mod = load_script("eagle", "taps.py")
  ps = random_prompts(12, 61, seed=4, lo=3, hi=8)
  gen = sj.generate(tiny, ps, max_new_tokens=24, stop_at_eos=False).tokens
  toks = np.array([(p + g)[:24] for p, g in zip(ps, gen)])  # the target's own text
  mask = np.ones(toks.shape, bool)
  heads, _ = te.fit(tiny, init_heads(tiny, "eagle", seed=3, taps=(1,), scale=0.3), toks, steps=80,
                    lr=3e-3)
  got = mod.held_out_top1(tiny, heads, toks, mask, unroll=2)
  _, m = jax.jit(te.make_loss(tiny, heads, noise=0.0, unroll=2))(
      heads.params, {"tokens": jnp.asarray(toks)}, jax.random.PRNGKey(0), te.frozen_arrays(tiny, heads))
  np.testing.assert_allclose(got, [float(m["top1"]), float(m["top1_2"])], rtol=1e-5)
  zeroed = mod.ablated(heads, [0])
  np.testing.assert_array_equal(np.asarray(zeroed.params["fuse_w"][0, :32]), 0.0)
  np.testing.assert_array_equal(np.asarray(zeroed.params["fuse_w"][0, 32:]),
                                np.asarray(heads.params["fuse_w"][0, 32:]))
  assert np.abs(np.asarray(heads.params["fuse_w"][0, :32])).max() > 0  # the original is intact
  assert mod.held_out_top1(tiny, zeroed, toks, mask, unroll=2) != got


def _copy_oracle_reference(prompt, out, limit):
  """A second, plain reading of the copying oracle: every run of the context, every length."""
  i = steps = 0
  while i < len(out):
    ctx, best = prompt + out[:i], 0
    for j in range(len(ctx)):
      for n in range(1, len(out) - i + 1):
        if (limit is None or n <= limit) and j + n <= len(ctx) and ctx[j:j + n] == out[i:i + n]:
          best = max(best, n)
    i, steps = i + best + 1, steps + 1
  return len(out) / steps


def test_copy_bound_oracle():
  """experiments/hybrid/copy_bound.py's oracle: hand cases, then random ones against the
  reference above (small vocabularies, so that runs repeat)."""
  mod = load_script("hybrid", "copy_bound.py")
  # Step 1 copies 2 3 4 5 from the prompt and the target adds 9; step 2 copies that 9 and the
  # target adds 5. With two copies at most: 2 3 +4, then 5 +9, then 9 +5.
  assert mod.oracle_tau([1, 2, 3, 4, 5], [2, 3, 4, 5, 9, 9, 5], None) == 7 / 2
  assert mod.oracle_tau([1, 2, 3, 4, 5], [2, 3, 4, 5, 9, 9, 5], 2) == 7 / 3
  assert mod.oracle_tau([1], [2, 3], None) == 1.0
  assert mod.needed_tau(4.0, 1.0) == 3.0 and mod.needed_tau(4.0, 2.5) == float("inf")
  rng = np.random.default_rng(0)
  for _ in range(200):
    prompt = rng.integers(0, 4, rng.integers(1, 12)).tolist()
    out = rng.integers(0, 4, rng.integers(1, 12)).tolist()
    for limit in (1, 3, None):
      assert mod.oracle_tau(prompt, out, limit) == _copy_oracle_reference(prompt, out, limit)


def test_batched_against_one_at_a_time(tiny_dir, tmp_path):
  """experiments/batched: one call of B prompts against B calls of one, greedy here, so every
  row of the batched call must have its own call's tokens (batch invariance end to end)."""
  mod = load_script("batched")
  mod.main(["--quick", "--model", tiny_dir, "--arithmetics", "float32", "--temperature", "0",
            "--split", "--out", str(tmp_path)])
  with open(tmp_path / "results_quick.json") as f:
    data = json.load(f)
  assert "| float32 |" in (tmp_path / "results_quick.md").read_text()
  (row,) = data["rows"]
  assert row["arithmetic"] == "float32" and row["identical"] is True
  assert data["batch"] == 4 and row["batched_tok_s"] > 0 and row["single_tok_s"] > 0
  rows = data["prefill_rows"]  # one call packs the prompts: their tokens up to a chunk's
  assert rows["tokens"] <= rows["batched"] < rows["tokens"] + 64 <= rows["padded"]
  assert rows["tokens"] <= rows["single"] <= rows["padded"]
  assert row["batched_prefill_s"] > 0 and row["single_decode_tok_s"] > 0


def test_quantized_draft_cost_per_arithmetic(tmp_path):
  """experiments/quantized/draft_cost.py: q for 4- and 8-bit self-drafts over each arithmetic of
  one GGUF (a tiny random one here), every figure a measured positive ratio."""
  from tests.helpers.gguf_files import write_gguf
  path = write_gguf(tmp_path / "t.gguf")
  mod = load_script("quantized", "draft_cost.py")
  mod.main(["--quick", "--model", str(path), "--out", str(tmp_path)])
  with open(tmp_path / "draft_cost_quick.json") as f:
    q = json.load(f)["q"]
  assert set(q) == {"float32", "blocks", "w4a8"}
  for row in q.values():
    assert set(row) == {"4", "8"} and all(r["q"] > 0 and len(r["qs"]) == 1 for r in row.values())
  assert "| w4a8 |" in (tmp_path / "draft_cost_quick.md").read_text()
