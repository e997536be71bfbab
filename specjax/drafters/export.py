"""Our heads written in a published layout: `export_heads`; `specjax export`'s `export_files`."""

from __future__ import annotations

import dataclasses

import numpy as np

from specjax.drafters import dflash, writers
from specjax.drafters.heads_file import Heads
from specjax.drafters.kinds import check_fits, load_heads
from specjax.errors import InputError

FORMATS = ("medusa", "eagle", "eagle3", "dflash")  # export formats


def _write_dflash(c, fields, params, vocab, out_dir, target):
  return writers.save(*dflash.to_published(c, params), out_dir, "model.safetensors")


def _write_medusa(c, fields, params, vocab, out_dir, target):
  return writers.write_medusa(fields, params, vocab, out_dir)


def _write_eagle(c, fields, params, vocab, out_dir, target):
  return writers.write_eagle(fields, params, vocab, out_dir, target.config)


def _write_eagle3(c, fields, params, vocab, out_dir, target):
  return writers.write_eagle3(fields, params, vocab, out_dir, target.config)


# format -> (its writer, whether it needs the target: EAGLE's config.json carries its rope and
# norm settings)
_WRITERS = {"dflash": (_write_dflash, False), "medusa": (_write_medusa, False),
            "eagle": (_write_eagle, True), "eagle3": (_write_eagle3, True)}


def export_heads(heads: Heads, fmt: str, out_dir: str, target=None) -> str:
  """Writes `heads` to out_dir in a published layout: "dflash" (z-lab's DFlash: Qwen3
  config.json with dflash_config + model.safetensors), "medusa" (FasterDecoding's Medusa-1:
  config.json + medusa_lm_head.safetensors), "eagle" (SafeAILab's EAGLE-1/2: Llama config.json
  + model.safetensors; needs `target` for its rope and norm settings) or "eagle3" (SafeAILab's
  EAGLE-3, likewise, with d2t / t2d). Returns out_dir."""
  if not isinstance(heads, Heads):
    raise InputError(f"heads={heads!r} is invalid: must be specjax Heads")
  if fmt not in FORMATS:
    raise InputError(f"format={fmt!r} is invalid: must be one of {', '.join(FORMATS)}")
  c = heads.config
  if c.kind != fmt:
    raise InputError(f"format={fmt!r}, but these are {c.kind} heads")
  fields = dataclasses.asdict(c)
  params = {k: np.asarray(x) for k, x in heads.params.items()}
  write, needs_target = _WRITERS[fmt]
  if needs_target:
    if target is None:
      raise InputError(f"export --format {fmt} needs the target (its rope and norm settings go "
                       f"into the head's config.json)")
    check_fits(heads, target)
  return write(c, fields, params, heads.vocab, out_dir, target)


def export_files(heads: str, fmt: str, out_dir: str, model: str | None = None) -> str:
  """`specjax export --format medusa|eagle|eagle3|dflash HEADS OUT_DIR [--model M]`: heads from a
  file, a directory or a shipped name, written in a published layout. The target (`model`, else the
  one the heads were made for) is loaded for EAGLE / EAGLE-3, whose config.json carries its rope and
  norm settings, and for any heads when `model` is given (to check they fit it)."""
  from specjax.weights import load_model

  if fmt not in FORMATS:
    raise InputError(f"--format {fmt!r} is invalid: must be one of {', '.join(FORMATS)}")
  target = None
  if model is None and _WRITERS[fmt][1]:
    model = load_heads(heads).config.target or None
    if model is None:
      raise InputError(f"{heads}: the heads do not name their target; pass --model")
  if model is not None:
    target = load_model(model, tokenizer=False)
  return export_heads(load_heads(heads, target), fmt, out_dir, target)
