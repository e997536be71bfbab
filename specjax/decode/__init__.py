"""The driver: DecodeState, the method contract, prefill and the jitted lax.while_loop.

A generation is one compiled program: prefill, then `lax.while_loop(method.step)` until every row
is done. Python tokenises before and detokenises after. A method is a small frozen object that
follows the `Method` contract (what the driver reads, and the four phases every step goes
through); methods/ holds one file per method and the registry of them (methods/autoregressive.py
is the smallest). This package imports none of them: the default method and method names are
resolved above it (specjax/api.py).

Split by job, as google-deepmind/gemma's sampler is; each file answers one question:
  _state.py      what the loop carries (DecodeState, each field's layout over a mesh) and how a
                 step appends what it emits (emitted, emit)
  _method.py     what a method must provide (Method), what one generation compiles (Program), and
                 the phase names a step's operations carry (DRAFT, VERIFY)
  _prefill.py    how the prompt enters the cache (in one forward, or in chunks on a CPU)
  _loop.py       the while_loop itself, jitted, and the compiled programs kept by shape
  _text.py       prompts to token ids, and rows back to text
  _generate.py   the user-facing call: check, encode, plan shapes and mesh, run, report
Import from `specjax.decode`, not from these files: the names below are the package's surface.
"""

from specjax.decode._generate import (GenerateOutput, arrays_cache, bucket_prompt_len,
                                      check_arguments, generate)
from specjax.decode._loop import compile_cache
from specjax.decode._method import DRAFT, VERIFY, Method, Program, check_method, phase
from specjax.decode._prefill import prefill, prefill_chunk
from specjax.decode._state import (REPLICATED, ROWS, DecodeState, constrain, emit, emitted,
                                   replicated, rows)
from specjax.decode._text import _encode

__all__ = [
    "DRAFT", "REPLICATED", "ROWS", "VERIFY", "DecodeState", "GenerateOutput", "Method", "Program",
    "arrays_cache", "bucket_prompt_len", "check_arguments", "check_method", "compile_cache",
    "constrain", "emit", "emitted", "generate", "phase", "prefill", "prefill_chunk",
    "replicated", "rows", "_encode",
]
