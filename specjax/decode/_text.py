"""Text in and out: prompts (text or token ids, chat template or not) -> token ids per prompt,
and each row's new tokens -> text.
"""

from __future__ import annotations

import numpy as np

from specjax import validate
from specjax.errors import InputError


def _encode(model, prompts, chat: bool) -> list[list[int]]:
  """prompts (checked by validate.prompts) -> token ids per prompt. chat applies the tokenizer's
  chat template to text prompts; token-id prompts with chat=True are an error, not ignored."""
  checked = validate.prompts(prompts, model.config.vocab_size)
  if any(isinstance(p, str) for p in checked) and model.tokenizer is None:
    i = next(i for i, p in enumerate(checked) if isinstance(p, str))
    raise InputError(f"prompts[{i}] is text but model {model.name!r} has no tokenizer; "
                     f"pass token ids")
  if chat:
    _check_chat(model, checked)
  out = []
  for i, p in enumerate(checked):
    if not isinstance(p, str):
      ids = p
    elif chat:
      ids = model.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                add_generation_prompt=True, tokenize=True)
      ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    else:
      ids = model.tokenizer.encode(p)
    if len(ids) == 0:
      raise InputError(f"prompts[{i}] is empty (no tokens): give every prompt at least one token")
    out.append(ids)
  return out


def _check_chat(model, checked: list) -> None:
  """chat=True needs text prompts and a tokenizer with a chat template."""
  ids_at = [i for i, p in enumerate(checked) if not isinstance(p, str)]
  if ids_at:
    raise InputError(f"chat=True, but prompts[{ids_at[0]}] is token ids: the chat template "
                     f"applies to text only; pass the prompt as a string, or apply the template "
                     f"yourself and pass chat=False")
  if getattr(model.tokenizer, "chat_template", None) is None:
    raise InputError(f"chat=True, but model {model.name!r}'s tokenizer has no chat template; "
                     f"pass chat=False (the prompts are then tokenised as they are)")


def _decode_rows(model, state) -> tuple[list[list[int]], list[str]]:
  """The new tokens of each row (EOS included if produced) and their text."""
  seq, seq_len, plen = (np.asarray(x) for x in (state.seq, state.seq_len, state.prompt_len))
  tokens = [seq[i, plen[i]:seq_len[i]].tolist() for i in range(len(seq))]
  texts = ([model.tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
           if model.tokenizer is not None else [""] * len(tokens))
  return tokens, texts
