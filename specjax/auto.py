"""method="auto": the registered method and settings with the highest predicted tokens per second.

    out = sj.generate(model, prompts, "auto")
    out.stats["auto"]  # {"method", "settings", "predicted_speedup", "basis", "table", ...}

Candidates are the registered methods that can run on the model with their defaults
(`Entry.available`: a trained method needs its drafter shipped for the model). Each is built by
the registry, so its settings are the ones its factory chose from the device's cost curve
(specjax.calibrate) and its drafter's held-out acceptance (specjax/methods/defaults.py), and the
same choice gives its predicted speedup over autoregressive decoding at batch 1. Autoregressive
decoding stands at 1.0; the highest prediction wins (ties go to the earlier registered method).

Every registered method with a prediction competes. Most rest on the drafter's recorded
acceptance; the quantized self-draft's and layer-skip's on a measured prior (nothing is trained,
so nothing is held out: `basis` says "prior"); the hybrid's on its predicting drafter's records
alone (its copies add what the text repeats, which nothing predicts: a lower bound, so a tie
with that drafter goes to the drafter). Prompt lookup, lookahead, suffix decoding and a hybrid
without heads predict nothing (their acceptance is the text's): auto lists them in its table
with the reason. Every candidate is exact (lossless at any temperature), so auto's output is the
target's distribution whatever it picks. On a terminal a progress bar counts the candidates
(building one may load its drafter, and the first one measures the cost curve).
"""

from __future__ import annotations

import dataclasses
import sys

from tqdm import tqdm

from specjax import calibrate, methods
from specjax.errors import SpecJaxError
from specjax.methods import defaults
from specjax.methods.hybrid import PREDICTORS

NAME = "auto"


def is_auto(method) -> bool:
  return isinstance(method, str) and method.strip().lower() == NAME


def _candidate(name: str, model, cost) -> dict:
  """One table row: the method built with its chosen defaults and its prediction."""
  row = {"method": name, "settings": {}, "predicted_speedup": None, "tau": None}
  if name == "autoregressive":
    return dict(row, predicted_speedup=1.0, tau=1.0, basis="baseline",
                built=methods.build(name, model))
  if name not in defaults.CHOOSERS and name != "hybrid":
    return dict(row, basis="nothing to predict from (no chooser in specjax/methods/defaults.py): "
                           "not compared")
  try:
    m = methods.build(name, model)
  except SpecJaxError as e:  # e.g. a shipped drafter that does not fit: say why, go on
    return dict(row, basis=f"could not be built: {e}")
  ch = _prediction(name, model, m, cost)
  row = dict(row, settings=_plain(ch.settings), tau=ch.tau, built=m)
  if ch.speedup is None:
    return dict(row, basis=f"{ch.basis}: nothing recorded to predict from, not compared")
  return dict(row, predicted_speedup=ch.speedup, basis=ch.basis)


def _prediction(name: str, model, m, cost) -> defaults.Choice:
  """The Choice behind built method m's settings; a hybrid's is its predicting drafter's."""
  if name != "hybrid":
    return defaults.predict(name, model, m, cost)
  pred = next((d for d in m.drafters if isinstance(d, PREDICTORS)), None)
  if pred is None:
    return defaults.Choice({"num_nodes": m.num_nodes}, basis="copies only")
  ch = defaults.predict(pred.name, model, pred, cost)
  return dataclasses.replace(ch, settings={"num_nodes": m.num_nodes, pred.name: ch.settings},
                             basis=f"{ch.basis} (its copies not counted: a lower bound)")


def _plain(settings: dict) -> dict:
  """Settings as JSON-friendly values (a tree as its node count and paths)."""
  out = {}
  for k, v in settings.items():
    if hasattr(v, "paths"):
      out[k] = {"num_nodes": v.num_nodes, "paths": [list(p) for p in v.paths]}
    else:
      out[k] = _plain(v) if isinstance(v, dict) else v
  return out


def choose(model) -> tuple[object, dict]:
  """(the method to run, the report for out.stats["auto"])."""
  cal = calibrate.calibration(model)
  names = methods.available(model)
  bar = tqdm(names, desc="auto: comparing methods", unit="method", file=sys.stderr,
             disable=None, leave=False)
  rows = []
  for n in bar:
    bar.set_postfix_str(n)
    rows.append(_candidate(n, model, cal["curve"]))
  best = max((r for r in rows if r["predicted_speedup"] is not None),
             key=lambda r: r["predicted_speedup"])  # max keeps the first of equals
  table = [{k: v for k, v in r.items() if k != "built"} for r in rows]
  report = {"method": best["method"], "settings": best["settings"],
            "predicted_speedup": best["predicted_speedup"], "basis": best["basis"],
            "cost_source": cal["source"], "cost_curve": cal["curve"], "table": table}
  return best["built"], report
