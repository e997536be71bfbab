"""experiments/accelerator/run.py --quick: every section runs at tiny sizes on the CPU and lands in
results_quick.json and results_quick.md. One shape (Llama-3-8B's, cut to two layers: untied, so
the LM head's conversion to transformers is exercised) and autoregressive decoding alone keep
the time here to compiling a few programs (tests/test_exactness.py judges methods by the same
criterion); the timings of a 2-layer model mean nothing and are not checked."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_script():
  path = os.path.join(ROOT, "experiments", "accelerator", "run.py")
  spec = importlib.util.spec_from_file_location("experiment_accelerator_run", path)
  mod = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = mod  # its dataclass looks its module up there
  spec.loader.exec_module(mod)
  return mod


def test_quick_run_writes_every_section(tmp_path):
  mod = load_script()
  mod.main(["--quick", "--out", str(tmp_path), "--shapes", "llama3-8b",
            "--methods", "autoregressive"])
  with open(tmp_path / "results_quick.json") as f:
    res = json.load(f)
  md = (tmp_path / "results_quick.md").read_text()
  for sec in mod.SECTIONS:
    assert sec in res, sec
    assert f"## {sec}" in md or sec == "device", sec
  assert res["device"]["platform"] == "cpu"
  rows = res["lossless"]["rows"]
  assert {(r["method"], r["dtype"]) for r in rows} == {
      ("autoregressive", d) for d in ("float32", "bfloat16")}
  assert res["lossless"]["all_ok"], [r for r in rows if r["status"] != "ok"]
  for shape in ("llama3-8b",):
    curve = res["cost_curve"][shape]
    assert curve["status"] == "ok" and curve["c"]["1"] == 1.0
    assert set(curve["c"]) == {str(t) for t in mod.QUICK_SIZES}
    roof = res["ar_vs_roofline"][shape]
    assert roof["status"] == "ok" and roof["tokens_per_s"] > 0 and roof["fraction_of_roofline"] > 0
    prof = res["profile"][shape]
    assert prof["status"] == "ok" and prof["top"] and prof["kernel_ms_per_token"] > 0, prof
    # The same random weights in transformers decode the same greedy tokens (torch on the CPU).
    tf = res["ar_vs_transformers"][shape]
    if tf["status"].startswith("skipped: torch"):
      continue
    assert tf["status"] == "ok", tf
    assert tf["transformers_tokens_per_s"] > 0 and tf["agreeing_prefix"] == 1.0
  assert res["ar_vs_roofline"]["copy_bandwidth_gbs"] > 0
  methods = {r["method"]: r for r in res["methods"]["rows"]}
  assert set(methods) == {"autoregressive"}
  assert all(r["status"] == "ok" and r["ms_per_round"] > 0 for r in methods.values())
  assert methods["autoregressive"]["round_in_ar_steps"] == 1.0


def test_merge_fills_what_one_run_skipped(tmp_path):
  """--merge: per shape and per (method, dtype) row the first run's entry that ran wins, a skipped
  entry is filled from a later run, and every run's command is kept."""
  mod = load_script()
  skip = {"status": mod.SKIPPED}
  first = {"command": "run a", "run_s": 10.0, "device": {"device_kind": "G"},
           "lossless": {"target": "t", "batch": 4, "new_tokens": 8, "all_ok": False, "rows": [
               {"method": "autoregressive", "dtype": "float32", "status": "ok", "failures": 0},
               dict(skip, method="suffix", dtype="float32")]},
           "ar_vs_roofline": {"copy_bandwidth_gbs": 5.0, "big": {"status": "ok", "x": 1},
                              "small": skip}}
  second = {"command": "run b", "run_s": 20.0, "device": {"device_kind": "H"},
            "lossless": {"target": "t", "batch": 4, "new_tokens": 8, "all_ok": True, "rows": [
                {"method": "suffix", "dtype": "float32", "status": "ok", "failures": 0}]},
            "ar_vs_roofline": {"copy_bandwidth_gbs": 6.0, "big": {"status": "ok", "x": 2},
                               "small": {"status": "ok", "x": 3}}}
  for i, part in enumerate((first, second)):
    (tmp_path / f"{i}.json").write_text(json.dumps(part))
  out = tmp_path / "out"
  merged = mod.main(["--merge", str(tmp_path / "0.json"), str(tmp_path / "1.json"),
                     "--out", str(out), "--note", "side by side"])
  assert merged["device"]["device_kind"] == "G"
  assert [r["status"] for r in merged["lossless"]["rows"]] == ["ok", "ok"]
  assert merged["lossless"]["all_ok"] is True
  roof = merged["ar_vs_roofline"]
  assert roof["big"]["x"] == 1 and roof["small"]["x"] == 3 and roof["copy_bandwidth_gbs"] == 5.0
  assert [r["command"] for r in merged["runs"]] == ["run a", "run b"]
  md = (out / "results.md").read_text()
  assert "- `run b` (20.0 s)" in md and "side by side" in md
  assert json.loads((out / "results.json").read_text()) == merged


def test_random_weights_are_drawn_like_model_random():
  """random_model (one compiled draw per weight shape, so building the 8B shape on a device costs
  a few compiles) gives sj.Model.random's kind of weights: the same arrays, the same constants
  (unit norm scales, zero biases) and N(0, 0.02) everywhere else."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import specjax as sj

  mod = load_script()
  for shape, hf in mod.QUICK_SHAPES.items():
    cfg = mod.config(shape, hf)
    ours = jax.tree_util.tree_flatten_with_path(mod.random_model(cfg).params)[0]
    ref = jax.tree_util.tree_flatten_with_path(sj.Model.random(cfg, dtype=jnp.bfloat16).params)[0]
    assert [p for p, _ in ours] == [p for p, _ in ref], shape
    for (path, a), (_, b) in zip(ours, ref):
      assert a.shape == b.shape and a.dtype == b.dtype, (shape, path)
      a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
      if np.all(b == b.flat[0]):
        np.testing.assert_array_equal(a, b, err_msg=f"{shape} {path}")
      else:
        assert 0.015 < a.std() < 0.025 and abs(a.mean()) < 0.005, (shape, path, a.std())
