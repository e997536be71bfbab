"""llama.cpp on the same GGUF file and the same token ids as specjax, for the experiments that set
it beside specjax's decoding (experiments/blocks, experiments/spec_bench).

llama-cpp-python runs the file with `threads` threads (prompt and decoding alike), greedy as
top-k 1 or at a temperature with top-k / top-p / min-p off, repeat penalty off, and generates
exactly the requested number of tokens (no EOS stop). Every call evaluates its whole prompt, as
every sj.generate call does: its KV cache is reset first. It computes with 8-bit activations
(Q4_1 x Q8_1), so it is neither specjax's float32 nor its blocks arithmetic and its greedy tokens
may differ. `num_pred_tokens` > 0 adds llama-cpp-python's own prompt-lookup speculation
(`LlamaPromptLookupDecoding`: drafts up to that many tokens copied after the last match of the
context's final 1-2 tokens, verified in one forward). Install it with

    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python    # builds llama.cpp from source
"""

from __future__ import annotations

import time

INSTALL = ("needs llama-cpp-python (llama.cpp's Python binding, built from source): "
           "CMAKE_ARGS=\"-DGGML_NATIVE=ON\" pip install llama-cpp-python")


def import_llama_cpp(flag: str = "--llama-cpp"):
  """The llama_cpp module; a SystemExit saying how to install it when it is missing."""
  try:
    import llama_cpp
  except ImportError as e:
    raise SystemExit(f"{flag} {INSTALL}") from e
  return llama_cpp


class LlamaCpp:
  """One llama.cpp context on `gguf` (a path): `decode(ids, n_new, temperature, seed)`.

  n_ctx: the context it allocates (prompt + new tokens + drafted tokens must fit); with prompt
  lookup it keeps every position's logits (llama-cpp-python needs them to verify drafts)."""

  def __init__(self, gguf: str, threads: int, *, num_pred_tokens: int = 0, n_ctx: int = 2048):
    llama_cpp = import_llama_cpp()
    draft = None
    if num_pred_tokens:
      from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
      draft = LlamaPromptLookupDecoding(num_pred_tokens=num_pred_tokens)
    self.lib, self.num_pred_tokens = llama_cpp, num_pred_tokens
    self.version = llama_cpp.__version__
    self.llm = llama_cpp.Llama(gguf, n_ctx=n_ctx, n_batch=512, n_threads=threads,
                               n_threads_batch=threads, draft_model=draft, verbose=False)
    self.forwards = 0
    inner = self.llm.eval

    def counted(tokens):  # one call per target forward (the prompt, then each verification)
      self.forwards += 1
      return inner(tokens)
    self.llm.eval = counted

  def decode(self, ids: list[int], n_new: int, temperature: float = 0.0, seed: int = 0) -> dict:
    """Exactly n_new tokens after the prompt `ids` -> {tokens, wall_s (evaluating the prompt and
    decoding, from the first evaluation to the last token), forwards (target forwards, the
    prompt's included), and llama.cpp's own timers: prompt_s (evaluating the prompt), evals and
    eval_s (its one-token evaluations after it, and their seconds)}."""
    lib, llm = self.lib, self.llm
    llm.set_seed(seed)
    # Without the reset llama-cpp-python keeps the previous call's KV cache and re-evaluates
    # only the prompt's last token when the prompt matches it: a repeat of a prompt would skip
    # its prefill.
    llm.reset()
    lib.llama_perf_context_reset(llm.ctx)
    sample = dict(top_k=1, temp=0.0) if temperature == 0 else \
        dict(temp=temperature, top_k=0, top_p=1.0, min_p=0.0)
    self.forwards, new = 0, []
    t0 = time.perf_counter()
    for tok in llm.generate(ids, reset=True, repeat_penalty=1.0, **sample):
      new.append(int(tok))
      if len(new) == n_new:
        break
    wall = time.perf_counter() - t0
    perf = lib.llama_perf_context(llm.ctx)
    return {"tokens": new, "wall_s": wall, "forwards": self.forwards,
            "prompt_s": perf.t_p_eval_ms / 1e3, "evals": perf.n_eval,
            "eval_s": perf.t_eval_ms / 1e3}

  def close(self):
    """Frees the context before the interpreter exits (its finaliser fails at exit)."""
    self.llm.close()
