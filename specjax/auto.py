"""method="auto": the registered method and settings with the highest predicted tokens per second.

    out = sj.generate(model, prompts, "auto")
    out.stats["auto"]  # {"method", "settings", "predicted_speedup", "basis", "table", ...}

Candidates are the registered methods that can run on the model with their defaults
(`Entry.available`: a trained method needs its drafter shipped for the model). Each is built by
the registry, so its settings are the ones its factory chose from the device's cost curve
(specjax.calibrate) and its drafter's held-out acceptance (specjax/methods/defaults.py), and the
same choice gives its predicted speedup over autoregressive decoding at batch 1. Autoregressive
decoding stands at 1.0; the highest prediction wins (ties go to the earlier registered method).

Only predictions that rest on a recorded acceptance compete. Prompt lookup and lookahead record
none (their acceptance depends on the text: repetition in the prompt, n-grams the model repeats),
and layer-skip's rests on a prior; auto lists them in its table with the reason and never picks
them: a prior would decide the choice, not the device or the drafter. Every candidate is exact
(lossless at any temperature), so auto's output is the target's distribution whatever it picks.
"""

from __future__ import annotations

from specjax import calibrate, methods
from specjax.errors import SpecJaxError
from specjax.methods import defaults

NAME = "auto"


def is_auto(method) -> bool:
  return isinstance(method, str) and method.strip().lower() == NAME


def _candidate(name: str, model, cost) -> dict:
  """One table row: the method built with its chosen defaults and its prediction."""
  row = {"method": name, "settings": {}, "predicted_speedup": None, "tau": None}
  if name == "autoregressive":
    return dict(row, predicted_speedup=1.0, tau=1.0, basis="baseline",
                built=methods.build(name, model))
  if name not in defaults.CHOOSERS:
    return dict(row, basis="no chooser with recorded acceptance (specjax/methods/defaults.py): "
                           "not compared")
  try:
    m = methods.build(name, model)
  except SpecJaxError as e:  # e.g. a shipped drafter that does not fit: say why, go on
    return dict(row, basis=f"could not be built: {e}")
  ch = defaults.predict(name, model, m, cost)
  row = dict(row, settings=_plain(ch.settings), tau=ch.tau, built=m)
  if not ch.recorded:
    return dict(row, basis=f"{ch.basis}: not compared", predicted=ch.speedup)
  return dict(row, predicted_speedup=ch.speedup, basis=ch.basis)


def _plain(settings: dict) -> dict:
  """Settings as JSON-friendly values (a tree as its node count and paths)."""
  out = {}
  for k, v in settings.items():
    if hasattr(v, "paths"):
      out[k] = {"num_nodes": v.num_nodes, "paths": [list(p) for p in v.paths]}
    else:
      out[k] = v
  return out


def choose(model) -> tuple[object, dict]:
  """(the method to run, the report for out.stats["auto"])."""
  cal = calibrate.calibration(model)
  rows = [_candidate(n, model, cal["curve"]) for n in methods.available(model)]
  best = max((r for r in rows if r["predicted_speedup"] is not None),
             key=lambda r: r["predicted_speedup"])  # max keeps the first of equals
  table = [{k: v for k, v in r.items() if k != "built"} for r in rows]
  report = {"method": best["method"], "settings": best["settings"],
            "predicted_speedup": best["predicted_speedup"], "basis": best["basis"],
            "cost_source": cal["source"], "cost_curve": cal["curve"], "table": table}
  return best["built"], report
