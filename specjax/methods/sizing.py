"""The sizes a method leaves out, chosen when it first meets its target: one rule for every path.

    sj.generate(model, p, "draft")          # by name: the registry builds DraftModel(d) ...
    sj.generate(model, p, sj.DraftModel(d)) # ... by class: the same object, so the same gamma

A size knob (a chain's gamma, a tree's nodes, a copy's length, ...) given as None, or left out,
means "from the cost curve": the class fills it with its own size at once (so the object is
whole, and a method that is never prepared runs as before) and records it in `left_out`; its
`prepare(target)`, which the driver calls before anything compiles, then asks the method's
chooser in methods/defaults.py for the sizes, as the registry's factory does. An explicit knob
wins: given any of a method's knobs, the class's own sizes fill the rest (defaults.choose's rule).
A chooser with nothing to go on (a drafter without held-out numbers) leaves the class's sizes.

`dataclasses.replace(method, ...)` passes every field, so a replaced method counts its sizes as
given: replace the unsized one, or prepare after.
"""

from __future__ import annotations

import dataclasses


def left_out(method, sizes: dict) -> None:
  """In a method's __post_init__: each knob in `sizes` that is None takes the class's own size
  there, and `method.left_out` names them (a frozen dataclass: set through object.__setattr__)."""
  names = tuple(k for k in sizes if getattr(method, k) is None)
  for k in names:
    object.__setattr__(method, k, sizes[k])
  object.__setattr__(method, "left_out", names)


def open_sizes(method, name: str) -> bool:
  """Whether `method` left out every knob of the registry's entry `name` (so the cost curve
  chooses its sizes)."""
  from specjax.methods import defaults

  return all(k in method.left_out for k in defaults.CHOOSERS[name][1])


def prepare(method, name: str, target, drafter):
  """`method` with the sizes it left out chosen for `target` as the registry's entry `name`
  chooses them (defaults.choose: the cost curve and the drafter's recorded acceptance); the
  method itself when it left none out, when a knob was given, or when nothing was chosen."""
  from specjax.methods import defaults

  if not open_sizes(method, name):
    return method  # none left out, or a knob given: the class's sizes fill the rest
  knobs = defaults.CHOOSERS[name][1]
  chosen = {k: v for k, v in defaults.choose(name, target, drafter, {}).items() if k in knobs}
  return dataclasses.replace(method, **chosen) if chosen else method
