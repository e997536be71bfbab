"""sj.generate: the driver (specjax.decode.generate) with method names resolved.

It lives above both the driver and the methods so that decode/ never imports a method: the
default (None -> autoregressive) and registered names ("eagle", "pld", ...) are resolved here,
through the registry in specjax/methods.
"""

from __future__ import annotations

from specjax import auto, decode, methods
from specjax.decode import GenerateOutput
from specjax.errors import InputError
from specjax.model import Model


def generate(model, prompts, method=None, *, max_new_tokens: int = 64, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, chat: bool = False,
             stop_at_eos: bool = True, mesh=None) -> GenerateOutput:
  """Generates up to max_new_tokens for each prompt; see specjax.decode.generate.

  method: a method object (sj.Eagle(heads), ...), a registered name (one of sj.METHODS or an
  alias: "eagle" builds EAGLE with its defaults and the heads shipped for `model`), "auto" (the
  available method and settings with the highest predicted tokens per second on this device,
  specjax/auto.py; its choice is reported in `out.stats["auto"]`), or None (autoregressive
  decoding). The arguments are checked before a named method is built (which may load its
  drafter), so a bad one fails at once.
  """
  if not isinstance(model, Model):  # e.g. a name: its missing .config named nothing of the caller's
    hint = f" (load it first: sj.load_model({model!r}))" if isinstance(model, str) else ""
    raise InputError(f"model={model!r} is invalid: must be a loaded specjax Model{hint}")
  decode.check_arguments(max_new_tokens, temperature, top_k, top_p, seed, chat, stop_at_eos)
  report = None
  if auto.is_auto(method):
    method, report = auto.choose(model)
  out = decode.generate(model, prompts, methods.resolve(method, model),
                        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                        top_p=top_p, seed=seed, chat=chat, stop_at_eos=stop_at_eos, mesh=mesh)
  if report is not None:
    out.stats["auto"] = report
  return out
