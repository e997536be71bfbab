"""The cost curve's cache (specjax/calibrate.py), the defaults chosen from it
(specjax/methods/defaults.py) and method="auto" (specjax/auto.py). Nothing here times anything
that matters: the timer is replaced by a counting fake, except one quick real measurement."""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import pytest

import specjax as sj
from specjax import calibrate, decode, methods
from specjax import tree as T
from specjax.heads import save_heads

from tests.helpers.models import random_prompts, tiny_config, tiny_model


@pytest.fixture
def fake_timer(monkeypatch, tmp_path):
  """Calibration on (quick), cached under tmp_path, measured by a fake that counts its calls."""
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  monkeypatch.setenv(calibrate.ENV, "quick")
  calls = []

  def seconds(model, sizes, **kw):
    calls.append(model.name)
    return {"seconds": {t: 1e-3 * (1.0 + 0.05 * (t - 1)) for t in sorted(set([1, *sizes]))},
            "others_share": 0.0, "tries": 1}

  monkeypatch.setattr(calibrate, "measure_seconds_quietly", seconds)
  return calls


def _files(tmp_path):
  d = tmp_path / "calibration"
  return sorted(os.listdir(d)) if d.is_dir() else []


def test_the_cache_is_written_reused_and_rewritten_when_corrupt(fake_timer, tmp_path):
  m = tiny_model()
  first = calibrate.calibration(m)
  assert first["source"] == "measured" and len(fake_timer) == 1
  assert first["curve"][1] == 1.0 and first["curve"][16] == pytest.approx(1.75)
  assert _files(tmp_path) == [os.path.basename(first["path"])]  # no temporary file left behind
  again = calibrate.calibration(m)
  assert again["source"] == "cache" and len(fake_timer) == 1 and again["curve"] == first["curve"]
  for bad in ("{not json", json.dumps({"key": first["key"], "curve": {"1": "x"}}),
              json.dumps({"key": dict(first["key"], jax="0.0"), "curve": {"1": 1.0}})):
    with open(first["path"], "w") as f:
      f.write(bad)
    assert calibrate.calibration(m)["source"] == "measured"
  assert len(fake_timer) == 4
  assert calibrate.calibration(m)["source"] == "cache" and len(fake_timer) == 4


def test_a_changed_key_measures_again(fake_timer, monkeypatch):
  from specjax import kernels

  base = tiny_model()
  calibrate.calibration(base)
  variants = [sj.Model.random(tiny_config(), seed=0, dtype=jnp.bfloat16),  # dtype
              tiny_model(num_layers=3),  # the model's config
              sj.Model(base.config, base.graphdef, base.params, name="other")]  # its name
  for v in variants:
    assert calibrate.calibration(v)["source"] == "measured"
  assert len(fake_timer) == 4
  monkeypatch.setattr(calibrate.packing, "on_kernel", lambda model: True)  # the kernel flag
  monkeypatch.setattr(kernels, "isa", lambda: "avx2")
  monkeypatch.setattr(kernels, "threads", lambda: 2)
  on = calibrate.calibration(base)
  assert on["source"] == "measured" and on["key"]["kernel"]["isa"] == "avx2"
  monkeypatch.setattr(kernels, "isa", lambda: "scalar")  # another ISA
  assert calibrate.calibration(base)["source"] == "measured" and len(fake_timer) == 6
  monkeypatch.setattr(kernels, "isa", lambda: "avx2")
  assert calibrate.calibration(base)["source"] == "cache" and len(fake_timer) == 6
  blocks = sj.Model(base.config, base.graphdef, base.params, name=base.name)
  blocks.weights = "blocks"  # what load_model(..., weights="blocks") sets: another kernel
  assert calibrate.calibration(blocks)["source"] == "measured" and len(fake_timer) == 7
  # Another processor (the machines change from day to day; a CPU's device kind is "cpu"
  # on every one of them): measured again.
  assert calibrate.cpu_identity().count(" / ") == 3
  monkeypatch.setattr(calibrate, "cpu_identity", lambda: "GenuineIntel / 6 / 143 / Xeon")
  assert calibrate.calibration(blocks)["source"] == "measured" and len(fake_timer) == 8


def test_the_off_switch_gives_the_default_curve(monkeypatch, tmp_path):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  monkeypatch.setenv(calibrate.ENV, "0")
  monkeypatch.setattr(calibrate, "measure_seconds_quietly",
                      lambda *a, **k: pytest.fail("measured"))
  rec = calibrate.calibration(tiny_model())
  assert rec["source"] == "default" and rec["curve"] == calibrate.DEFAULT_CURVE
  assert not (tmp_path / "calibration").exists()


def test_a_disturbed_median_is_lowered_to_the_larger_sizes():
  """The curve is the envelope of the medians: a one-token median that a disturbance pushed
  above the two-token one would scale every c(T) down (and so every default up); it is lowered
  to the larger size's, and the curve never decreases."""
  secs = {1: 27.0, 2: 23.8, 4: 26.0, 8: 27.5, 16: 40.2, 32: 38.0, 64: 124.0}
  assert calibrate.envelope(secs) == {1: 23.8, 2: 23.8, 4: 26.0, 8: 27.5, 16: 38.0, 32: 38.0,
                                      64: 124.0}
  c = calibrate.curve_of(secs)
  assert c[1] == c[2] == 1.0 and c[8] == pytest.approx(27.5 / 23.8)
  assert all(c[a] <= c[b] for a, b in zip(sorted(c), sorted(c)[1:]))
  clean = {t: 1.0 + 0.1 * t for t in (1, 2, 4, 8)}
  assert calibrate.envelope(clean) == clean  # an increasing curve is kept as measured


def test_other_processes_busy_time_is_seen():
  """others_share: a process spinning beside this one (which sleeps) shows as about one CPU's worth
  of busy time; this process's own CPU time is read as the OS accounts it."""
  import subprocess
  import sys
  import time

  spin = "import time\nt = time.time()\nwhile time.time() - t < 2.0: pass"
  child = subprocess.Popen([sys.executable, "-c", spin])
  try:
    time.sleep(0.3)
    before = calibrate.cpu_use()
    time.sleep(1.0)
    after = calibrate.cpu_use()
  finally:
    child.wait()
  assert before is not None and after is not None  # Linux: /proc is there
  assert calibrate.others_share(before, after) * before[3] > 0.5  # CPUs' worth kept busy
  mine0, cpu0 = calibrate.cpu_use(), time.process_time()
  t = time.monotonic()
  while time.monotonic() - t < 0.5:
    pass
  mine1, cpu1 = calibrate.cpu_use(), time.process_time()
  # this process's own CPU time, as the OS accounts it (to its clock ticks)
  assert abs((mine1[2] - mine0[2]) - (cpu1 - cpu0)) < 0.05
  assert calibrate.others_share(None, mine1) is None


def test_a_curve_timed_beside_other_work_is_timed_again_and_kept_only_if_quiet(monkeypatch,
                                                                               tmp_path):
  """A full calibration times the compiled probes again while other processes kept more than
  QUIET of the CPUs busy (at most TRIES times), uses the least disturbed timing, and writes it to
  disk only if it was quiet: a disturbed curve is used once, never kept."""
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  monkeypatch.delenv(calibrate.ENV, raising=False)  # the full measurement
  compiled, shares = [], []
  monkeypatch.setattr(calibrate, "_probes", lambda m, sizes, *a: compiled.append(1) or
                      {t: None for t in sorted({1, *sizes})})
  monkeypatch.setattr(calibrate, "_time_probes", lambda m, fns, reps, loop: {
      t: 1e-3 * (1 + t * (1 + len(shares))) for t in fns})
  monkeypatch.setattr(calibrate, "cpu_use", lambda: None)
  monkeypatch.setattr(calibrate, "others_share", lambda b, a: shares.append(plan.pop(0)) or
                      shares[-1])
  m = tiny_model()
  plan = [0.5, 0.3, 0.4]
  rec = calibrate.calibration(m)
  assert compiled == [1] and rec["tries"] == 3 and rec["others_share"] == 0.3
  assert rec["curve"][2] == pytest.approx((1 + 2 * 2) / (1 + 1 * 2))  # the second timing's
  assert rec["path"] is None and not (tmp_path / "calibration").exists()
  shares.clear()
  plan = [0.5, 0.05, 0.9]
  rec = calibrate.calibration(m)  # measured again: nothing was kept
  assert rec["source"] == "measured" and rec["tries"] == 2 and rec["others_share"] == 0.05
  assert os.path.exists(rec["path"]) and plan == [0.9]
  assert calibrate.calibration(m)["source"] == "cache"


def test_a_real_quick_measurement():
  c = calibrate.measure(tiny_model(), (2, 4), reps=2)
  assert sorted(c) == [1, 2, 4] and c[1] == 1.0 and all(v > 0 for v in c.values())


def test_choose_chain_follows_the_curve():
  assert T.chain_tau([0.5], 2) == pytest.approx(1.75)
  assert T.chain_tau([0.9, 0.5], 3) == pytest.approx(1 + 0.9 + 0.45 + 0.225)
  flat = T.choose_chain({1: 1.0, 64: 1.0}, [0.9], max_gamma=8)
  steep = T.choose_chain({1: 1.0, 2: 2.0, 3: 3.0}, [0.9], max_gamma=8)
  assert flat["gamma"] == 8 and steep["gamma"] == 1 and len(flat["table"]) == 8
  costly = T.choose_chain({1: 1.0, 64: 1.0}, [0.9], draft_cost=0.3, max_gamma=8)
  assert costly["gamma"] < 8
  assert costly["speedup"] == pytest.approx(max(r[3] for r in costly["table"]))


def _heads(target, kind, held, **kw):
  return dataclasses.replace(sj.init_heads(target, kind, seed=1, scale=0.3, **kw),
                             meta={"held_out": held})


MEDUSA_HELD = {f"top{k}_{i}": a for i in range(4) for k, a in ((1, 0.9 - 0.1 * i), (5, 0.97))}


def test_defaults_come_from_the_curve_and_explicit_arguments_win(monkeypatch):
  target = tiny_model(num_layers=8)  # (a drafter of one layer then costs a fraction of it)
  curve = {"now": {1: 1.0, 64: 1.0}}
  monkeypatch.setattr(calibrate, "cost_curve", lambda model: curve["now"])
  mtp = _heads(target, "mtp", {"top1_0": 0.9, "top1_1": 0.8, "top1_2": 0.7}, num_heads=3)
  draft = tiny_model(seed=1, num_layers=1)
  draft.asset_header = {"held_out_top1": 0.95}
  medusa = _heads(target, "medusa", MEDUSA_HELD)
  eagle = _heads(target, "eagle", {"top1": 0.8, "top1_2": 0.7, "top1_3": 0.6})
  assert methods.build("mtp", target, heads=mtp).gamma == 3  # verifying more is free
  assert methods.build("draft", target, draft=draft).gamma > 5
  assert methods.build("medusa", target, heads=medusa).tree.num_nodes == 64
  assert methods.build("eagle", target, heads=eagle).num_nodes == 64
  curve["now"] = {1: 1.0, 2: 2.0, 3: 3.0}  # every verified token costs a forward
  assert methods.build("mtp", target, heads=mtp).gamma == 1
  assert methods.build("draft", target, draft=draft).gamma == 1
  assert methods.build("medusa", target, heads=medusa).tree.num_nodes == 1
  e = methods.build("eagle", target, heads=eagle)
  assert (e.num_nodes, e.depth, e.top_k) == (1, 1, 1)
  assert methods.build("mtp", target, heads=mtp, gamma=2).gamma == 2
  assert methods.build("draft", target, draft=draft, gamma=3).gamma == 3
  assert methods.build("medusa", target, heads=medusa, tree=[(0,), (0, 0)]).tree.num_nodes == 2
  e = methods.build("eagle", target, heads=eagle, num_nodes=16)
  assert (e.num_nodes, e.depth, e.top_k) == (16, 5, 8)  # the class fills what was not given
  assert methods.build("layer-skip", target, gamma=4).gamma == 4
  unrecorded = sj.init_heads(target, "mtp", num_heads=2, seed=4, scale=0.3)
  assert methods.build("mtp", target, heads=unrecorded).gamma == 2  # nothing recorded: the class's


def test_a_method_built_by_class_is_sized_as_the_one_built_by_name(monkeypatch):
  """A size left out means "from the cost curve" whichever way a method is built: the class,
  prepared for its target (as sj.generate does first), equals the registry's; explicit sizes
  win. The curve here makes every chosen size differ from the class's own."""
  target = tiny_model(num_layers=8)
  monkeypatch.setattr(calibrate, "cost_curve", lambda model: {1: 1.0, 2: 1.02, 4: 1.05, 8: 1.5,
                                                               16: 2.5})
  draft = tiny_model(seed=1, num_layers=1)
  draft.asset_header = {"held_out_top1": 0.8}
  eagle = _heads(target, "eagle", {"top1": 0.8, "top1_2": 0.7, "top1_3": 0.6})
  medusa = _heads(target, "medusa", MEDUSA_HELD)
  mtp = _heads(target, "mtp", {"top1_0": 0.9, "top1_1": 0.5, "top1_2": 0.3}, num_heads=3)
  by_class = {
      "draft": (sj.DraftModel(draft), dict(draft=draft)),
      "eagle": (sj.Eagle(eagle), dict(heads=eagle)),
      "medusa": (sj.Medusa(medusa), dict(heads=medusa)),
      "mtp": (sj.MTP(mtp), dict(heads=mtp)),
      "prompt-lookup": (sj.PromptLookup(), {}),
      "lookahead": (sj.Lookahead(), {}),
      "layer-skip": (sj.SelfSpeculative(exit_layer=2), {}),
      "quantized": (sj.QuantizedDraft(), {}),
      "hybrid": (sj.Hybrid([sj.PromptLookup(), sj.Eagle(eagle)]), dict(heads=eagle)),
  }
  for name, (method, options) in by_class.items():
    named = methods.build(name, target, **options)
    assert method.prepare(target) == named, name
    assert method != named, name  # (the class's own sizes, before it meets its target)
  compiled = []  # what sj.generate would compile (stopped there: nothing compiles here)

  def stop(prog, args):
    compiled.append(prog.method)
    raise KeyboardInterrupt

  monkeypatch.setattr(decode.compile_cache, "get", stop)
  with pytest.raises(KeyboardInterrupt):
    sj.generate(target, [[1, 2, 3]], by_class["draft"][0], max_new_tokens=3)
  assert compiled == [methods.build("draft", target, draft=draft)]
  assert compiled[0].gamma != 5
  assert sj.DraftModel(draft, gamma=5).prepare(target).gamma == 5
  e = sj.Eagle(eagle, num_nodes=16).prepare(target)
  assert (e.num_nodes, e.depth, e.top_k) == (16, 5, 8)  # a knob given: the class fills the rest
  h = sj.Hybrid([sj.PromptLookup(num_tokens=4), sj.Eagle(eagle)], num_nodes=9).prepare(target)
  assert (h.num_nodes, h.drafters[0].num_tokens) == (9, 4)
  assert h.drafters[1] == methods.build("eagle", target, heads=eagle)
  assert sj.Lookahead(window=2).prepare(target) == sj.Lookahead(window=2)


def test_quantized_gamma_follows_the_kernel_and_the_curve(monkeypatch):
  """The quantized self-draft's gamma: its prior acceptance over a draft forward that costs 0.4
  of a float32 target's step on the integer-dot kernel (4 or 8 bits), 0.9-1.05 of a W4A8
  target's, 1.5 without the kernel, and 1.3 on an accelerator; explicit gamma wins."""
  from specjax.kernels import qdot

  target = tiny_model()
  curve = {"now": {1: 1.0, 64: 1.0}}
  monkeypatch.setattr(calibrate, "cost_curve", lambda model: curve["now"])
  monkeypatch.setattr(qdot, "available", lambda: True)
  on = methods.build("quantized", target)
  assert on.bits == 4 and 3 <= on.gamma <= 8
  assert methods.build("quantized", target, gamma=2).gamma == 2
  # 8 bits on the kernel: the same cost here, a higher prior acceptance, so a longer chain
  assert methods.build("quantized", target, bits=8).gamma > on.gamma
  w4a8 = tiny_model()
  w4a8.weights, w4a8.activations = "blocks", "int8"  # (as load_model marks a W4A8 target)
  assert methods.build("quantized", w4a8).gamma < on.gamma  # a draft costs about a target step
  monkeypatch.setattr(qdot, "available", lambda: False)
  assert methods.build("quantized", target).gamma < on.gamma
  monkeypatch.setattr(qdot, "available", lambda: True)
  curve["now"] = {1: 1.0, 2: 2.0, 3: 3.0}
  assert methods.build("quantized", target).gamma == 1
  with pytest.raises(sj.InputError, match="bits=5"):
    methods.build("quantized", target, bits=5)
  # On an accelerator the CPU kernel never runs: a draft forward costs more than a target step
  # (XLA's int8, dequantized per call), so even a flat curve gives the shortest chain, predicted
  # slower than decoding alone.
  from specjax import packing
  from specjax.methods import defaults

  curve["now"] = {1: 1.0, 64: 1.0}
  monkeypatch.setattr(packing, "on_cpu_devices", lambda model: False)
  assert methods.build("quantized", target).gamma == 1
  assert defaults.quantized_gamma(target, 8, curve["now"]).speedup < 1.0


def test_prompt_lookup_copies_what_verifies_nearly_free(monkeypatch):
  """Prompt lookup's num_tokens: the longest copy (<= 10) whose verification costs at most
  LOOKUP_FREE one-token forwards on the curve; explicit num_tokens and ngram win."""
  target = tiny_model()
  curve = {"now": {1: 1.0, 64: 1.0}}
  monkeypatch.setattr(calibrate, "cost_curve", lambda model: curve["now"])
  assert methods.build("prompt-lookup", target).num_tokens == 10  # flat: the class's 10
  curve["now"] = {1: 1.0, 2: 2.0, 3: 3.0}
  assert methods.build("prompt-lookup", target).num_tokens == 1
  curve["now"] = {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.5}  # c(5) = 1.2 > 1.15 >= c(4)
  assert methods.build("prompt-lookup", target).num_tokens == 3
  m = methods.build("prompt-lookup", target, num_tokens=7, ngram=2)
  assert (m.num_tokens, m.ngram) == (7, 2)
  assert methods.build("prompt-lookup", target, ngram=4).ngram == 4


def test_lookahead_window_verifies_nearly_free(monkeypatch):
  """Lookahead's (window, ngram, guess): the largest shape whose one forward over 1 + (W + G)(N - 1)
  tokens costs at most LOOKUP_FREE one-token forwards; explicit knobs win."""
  target = tiny_model()
  curve = {"now": {1: 1.0, 64: 1.0}}
  monkeypatch.setattr(calibrate, "cost_curve", lambda model: curve["now"])

  def shape(**kw):
    m = methods.build("lookahead", target, **kw)
    return m.window, m.ngram, m.guess

  assert shape() == (4, 3, 4)  # flat: the class's own
  curve["now"] = {1: 1.0, 2: 2.0, 3: 3.0}
  assert shape() == (1, 2, 1)  # steep: the smallest
  curve["now"] = {1: 1.0, 4: 1.1, 8: 1.2}  # c(5) = 1.125, c(7) = 1.175
  assert shape() == (2, 2, 2)
  assert shape(window=3) == (3, 3, 4)  # a knob given: the class fills the rest
  assert shape(ngram=2, guess=1) == (4, 2, 1)


def _ship_medusa(monkeypatch, target, path):
  save_heads(_heads(target, "medusa", MEDUSA_HELD), str(path))
  monkeypatch.setattr(methods, "shipped", lambda kind, t: str(path) if kind == "medusa" else None)


def test_auto_compares_every_method_it_can_predict_and_is_exact(monkeypatch, tmp_path):
  """Every available method is in auto's table; all with a prediction compete (the quantized
  self-draft on its prior, the hybrid on its heads' records), the highest wins, and the output is
  autoregressive's."""
  from specjax import auto

  target = tiny_model()
  _, plain = auto.choose(target)  # no drafter shipped: the hybrid copies only
  rows = {r["method"]: r for r in plain["table"]}
  assert rows["quantized"]["predicted_speedup"] > 1.0 and "prior" in rows["quantized"]["basis"]
  assert rows["hybrid"]["predicted_speedup"] is None
  _ship_medusa(monkeypatch, target, tmp_path / "medusa.npz")
  _, report = auto.choose(target)
  rows = {r["method"]: r for r in report["table"]}
  assert list(rows) == methods.available(target)
  assert rows["autoregressive"]["predicted_speedup"] == 1.0
  assert rows["hybrid"]["predicted_speedup"] == rows["medusa"]["predicted_speedup"] > 1.0
  assert rows["hybrid"]["settings"]["medusa"] == rows["medusa"]["settings"]
  for name in ("prompt-lookup", "lookahead", "suffix"):
    assert rows[name]["predicted_speedup"] is None and "not compared" in rows[name]["basis"]
  best = max(rows.values(), key=lambda r: r["predicted_speedup"] or 0)
  assert report["method"] == best["method"] and report["cost_source"] == "default"
  json.dumps(report)  # plain data
  prompts = random_prompts(3, target.config.vocab_size, seed=2)
  out = sj.generate(target, prompts, "auto", max_new_tokens=12)
  assert out.stats["method"] == report["method"]
  assert out.tokens == sj.generate(target, prompts, max_new_tokens=12).tokens


def test_auto_in_the_cli_and_a_bad_name(monkeypatch, tmp_path):
  import argparse

  from specjax import cli

  target = tiny_model()
  _ship_medusa(monkeypatch, target, tmp_path / "medusa.npz")
  assert isinstance(cli._make_method("auto", target, argparse.Namespace()), sj.Medusa)
  with pytest.raises(sj.InputError, match="'autox' is not a decoding method: registered names"):
    sj.generate(target, [[1, 2, 3]], "autox", max_new_tokens=2)


def test_auto_reads_the_shipped_drafters_records(smollm2):
  """On the embedded model every shipped drafter's held-out numbers give a prediction (nothing is
  compiled: auto builds the methods and predicts, generate is not called)."""
  from specjax import auto

  method, report = auto.choose(smollm2)
  rows = {r["method"]: r for r in report["table"]}
  for name in ("draft", "medusa", "eagle", "mtp"):
    assert rows[name]["predicted_speedup"] > 0 and "held-out" in rows[name]["basis"], rows[name]
  assert report["predicted_speedup"] == max(r["predicted_speedup"] or 0 for r in rows.values())
  assert method.name == methods.get(report["method"]).cls.name
