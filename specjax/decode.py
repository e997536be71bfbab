"""DecodeState, the method contract, and the shared jitted lax.while_loop driver.

A generation is one compiled program: prefill, then `lax.while_loop(method.step)` until every row
is done. Python tokenises before and detokenises after. A method is a small frozen object that
follows the `Method` contract below (what the driver reads, and the four phases every step goes
through); methods/ holds one file per method and the registry of them (methods/autoregressive.py
is the smallest). This module imports none of them: the default method and method names are
resolved above it (specjax/api.py).
"""

from __future__ import annotations

import dataclasses
import math
import time
import weakref
from typing import Any, Protocol, runtime_checkable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import cache as kv
from specjax import compile_options
from specjax import distributed
from specjax import kernels
from specjax import malloc
from specjax import sampling
from specjax import sharding
from specjax import validate
from specjax.errors import InputError
from specjax.model import forward_sequence
from specjax.sampling import SamplingParams


# ----------------------------------------------------------------------------- the decode state

ROWS, REPLICATED = "rows", "replicated"  # a state field's layout over a mesh


def rows(**kw):
  """A state field laid out by row: every array in it has leading axis B, split over the mesh's
  `data` axis (a KVCache: its buffers by sharding.cache_spec, its lengths over data)."""
  return flax.struct.field(metadata={"layout": ROWS}, **kw)


def replicated(pin: bool = True, **kw):
  """A state field held whole on every device (a PRNG key, stop tokens, a table all rows share).
  pin=False: placed whole on entry and left to XLA's propagation inside the loop, for a field
  the loop never changes or a scalar, where a constraint only moves the compiled loop's carry."""
  return flax.struct.field(metadata={"layout": REPLICATED, "pin": pin}, **kw)


@flax.struct.dataclass
class DecodeState:
  """The while_loop's carry. Every field declares its layout over a mesh (`rows` or
  `replicated`) and `constrain` pins exactly that: nothing is guessed from shapes.

  `method` is the method's own state (a draft cache, an n-gram pool, counters): any pytree, per-row
  by rule. Every array in it has leading axis B (a KVCache's buffers and lengths do), and
  `constrain` raises at trace time, on one device too, for one that does not. A leaf all rows
  share goes in a flax.struct.dataclass field declared `replicated()` (fields declared `rows()`,
  or not declared, follow the rule).
  """
  seq: jax.Array = rows()  # [B,S] int32: prompt then generated tokens; index = position
  seq_len: jax.Array = rows()  # [B] int32: valid tokens in seq
  prompt_len: jax.Array = rows()  # [B] int32
  max_new: jax.Array = rows()  # [B] int32
  done: jax.Array = rows()  # [B] bool
  cache: kv.KVCache = rows()  # target K/V for seq[:, :seq_len - 1]; the last token is pending
  key: jax.Array = replicated()  # PRNG key, split every step
  sp: SamplingParams = rows()  # [B] temperature, top_k, top_p
  eos: jax.Array = replicated(pin=False)  # [N_eos] int32 stop tokens (-1 = unused)
  steps: jax.Array = replicated(pin=False)  # [] int32: loop iterations so far
  calls: jax.Array = rows()  # [B] int32: target forwards while the row was active (prefill too)
  hist: jax.Array = rows()  # [B, max_emit + 1] int32: steps that emitted n tokens
  method: Any = rows(default=None)  # the method's own state (draft cache, n-gram pool, ...)

  @property
  def last_token(self) -> jax.Array:
    """[B] the pending token (emitted, not yet in the cache)."""
    return jnp.take_along_axis(self.seq, (self.seq_len - 1)[:, None], axis=1)[:, 0]


def _declares_layout(x) -> bool:
  return (dataclasses.is_dataclass(x) and not isinstance(x, type)
          and any("layout" in f.metadata for f in dataclasses.fields(x)))


def constrain(mesh, tree, batch: int):
  """Pins a decode state, a KV cache or a method's state inside jit to its declared layout:
  `rows` fields (and undeclared ones) with their leading axis B = batch over data, KV caches by
  sharding.constrain_cache, `replicated` fields whole on every device. With mesh None (one
  device) nothing is pinned, but the per-row rule is still checked, so a method whose state
  breaks it fails where it is written rather than first on a mesh."""
  pinned = _pin(mesh, tree, batch, {}, type(tree).__name__)
  return tree if mesh is None else pinned


def _pin(mesh, tree, batch: int, declared: dict, where: str):
  """`constrain` for one field: `declared` is its metadata (layout, pin), empty for rows."""
  if declared.get("layout", ROWS) == REPLICATED:
    pin = mesh is not None and declared.get("pin", True)
    return sharding.constrain_replicated(mesh, tree) if pin else tree

  def one(path, x):
    name = where + jax.tree_util.keystr(path)
    if _declares_layout(x):
      return x.replace(**{f.name: _pin(mesh, getattr(x, f.name), batch, f.metadata,
                                       f"{name}.{f.name}") for f in dataclasses.fields(x)})
    shape = (x.batch,) if isinstance(x, kv.KVCache) else getattr(x, "shape", None)
    if shape is None:
      return x
    if len(shape) == 0 or shape[0] != batch:
      raise ValueError(
          f"{name} has shape {tuple(shape)}, but a decode state's `rows` fields, and a method's "
          f"state, hold per-row arrays with leading axis B={batch} (split over the mesh's data "
          f"axis): make it [B, ...], or put a leaf all rows share in a flax.struct.dataclass "
          f"field declared decode.replicated()")
    if mesh is None:
      return x
    if isinstance(x, kv.KVCache):
      return sharding.constrain_cache(mesh, x)
    return sharding.constrain_rows(mesh, x)

  return jax.tree_util.tree_map_with_path(
      one, tree, is_leaf=lambda x: isinstance(x, kv.KVCache) or _declares_layout(x))


def emit(state: DecodeState, tokens: jax.Array, n: jax.Array) -> DecodeState:
  """Appends the first n[b] of tokens [B,N] to each active row, stopping at EOS and max_new.

  Rows already done emit nothing. Counts the step in `calls` and `hist` for active rows.
  """
  b, num = tokens.shape
  active = ~state.done
  n = jnp.where(active, n, 0).astype(jnp.int32)
  j = jnp.arange(num)[None, :]
  is_eos = jnp.any(tokens[:, :, None] == state.eos[None, None, :], axis=-1) & (j < n[:, None])
  hit = jnp.any(is_eos, axis=1)
  n = jnp.where(hit, jnp.minimum(n, jnp.argmax(is_eos, axis=1) + 1), n)
  n = jnp.minimum(n, state.max_new - (state.seq_len - state.prompt_len))
  s = state.seq.shape[1]
  idx = jnp.where(j < n[:, None], state.seq_len[:, None] + j, s)  # s = out of range: dropped
  seq = jax.vmap(lambda row, i, t: row.at[i].set(t, mode="drop"))(state.seq, idx, tokens)
  seq_len = state.seq_len + n
  done = state.done | (hit & active) | (seq_len - state.prompt_len >= state.max_new)
  hist = state.hist.at[jnp.arange(b), jnp.minimum(n, state.hist.shape[1] - 1)].add(
      active.astype(jnp.int32))
  return state.replace(seq=seq, seq_len=seq_len, done=done, hist=hist,
                       calls=state.calls + active.astype(jnp.int32))


# Phase names a step's operations carry (jax.named_scope, so they show in the compiled program's
# op names): what specjax.breakdown attributes the loop's time to. The target's forward is always
# VERIFY unless it runs inside DRAFT (layer-skip drafts with the target's first layers).
DRAFT, VERIFY = "sj_draft", "sj_verify"


def phase(name: str):
  """Marks the operations traced inside `with phase(DRAFT):` as that phase of a step."""
  return jax.named_scope(name)


def emitted(draft: jax.Array, n: jax.Array, nxt: jax.Array) -> jax.Array:
  """What a step emits (the input of `emit(state, out, n + 1)`): the first n[b] tokens of
  draft [B,D] (the accepted ones), then nxt [B] (the target's own token) -> [B,D+1]. Entries past
  n[b] are never emitted."""
  b, d = draft.shape
  out = jnp.concatenate([draft, jnp.zeros((b, 1), draft.dtype)], axis=1)
  return jnp.where(jnp.arange(d + 1)[None, :] == n[:, None], nxt[:, None], out)


@runtime_checkable
class Method(Protocol):
  """The contract between a decoding method and the driver: all the driver reads, nothing else.

  A method is a frozen, hashable object (it is part of the jit cache key, so two equal methods
  share a compiled program). Subclass this class to inherit the defaults (no taps, nothing to
  validate, no arrays, no statistics of its own); any object with these members is also a method.

  Static attributes, read on the host before compiling:
    name          a short name for statistics and tables (the registry in methods/ knows it)
    lossless      whether outputs follow the target's distribution exactly (greedy: identical to
                  autoregressive decoding); the lossless suite holds every such method to it
    extra_slots   cache slots one step may write past the committed length
    max_emit      the most tokens one step can emit (the size of the acceptance histogram)
    taps          target layers whose outputs the target's forwards also return (EAGLE's fused
                  features); () for the rest

  Verbs:
    validate(model)                  host-side checks, raising InputError before anything compiles
    arrays(model)                    the device arrays it needs (a draft model's params, heads)
    init(prog, arrays, state, prefill_hidden [B,P,E]) -> its own state (inside jit, after prefill)
    step(prog, params, arrays, state) -> state                      one iteration of the loop
    stats(final state) -> dict       its own statistics, beside those every method reports

  Every `step` goes through the same four phases, the seams the methods' code follows:
    propose   draft candidate tokens for each row (a draft model, heads, an n-gram pool, ...);
    verify    score the pending token and the candidates in ONE target forward (`prog.forward`,
              a causal mask for a chain, `cache.tree_mask` for a tree);
    accept    keep the longest prefix the rule accepts (acceptance.py: greedy, exact rejection
              sampling, typical) plus the target's own next token: `emitted(draft, n, nxt)`;
    update    commit the accepted tokens' K/V (`cache.advance` / `cache.commit`), `emit` them,
              and advance the method's own state (draft cache, features, counters).
  """

  name: str
  lossless: bool
  extra_slots: int
  max_emit: int
  taps: tuple = ()

  def validate(self, model) -> None:
    """Raises InputError if this method cannot run on `model` (before anything compiles)."""

  def arrays(self, model) -> Any:
    return {}

  def init(self, prog: Program, arrays, state: DecodeState, prefill_hidden: jax.Array) -> Any:
    raise NotImplementedError

  def step(self, prog: Program, params, arrays, state: DecodeState) -> DecodeState:
    raise NotImplementedError

  def stats(self, state: DecodeState) -> dict:
    return {}


def check_method(method) -> None:
  """InputError unless `method` follows the contract (a class passed uncalled is the usual slip)."""
  if isinstance(method, type):
    raise InputError(f"method={method.__name__} is a class, not a decoding method: call it, "
                     f"e.g. method={method.__name__}()")
  if not isinstance(method, Method):
    members = sorted(set(Method.__annotations__) | {
        a for a in vars(Method) if not a.startswith("_") and callable(getattr(Method, a))})
    missing = [a for a in members if not hasattr(method, a)]
    raise InputError(f"method={method!r} is not a decoding method (it lacks "
                     f"{', '.join(missing)}): pass one such as sj.Autoregressive() or a name "
                     f"from sj.METHODS")


@dataclasses.dataclass(frozen=True)
class Program:
  """Everything static about one compiled generation (the jit cache key)."""
  graphdef: Any  # the target's nnx GraphDef
  config: Any  # the target's ModelConfig
  method: Any  # the (hashable) method object
  max_len: int  # S
  mesh: Any = None  # jax.sharding.Mesh ("data", "model") or None: one device

  def constrain(self, tree, batch: int):
    """Pins a decode state (or a KV cache) inside jit to its declared layout (`constrain`):
    rows over data, kv heads over model."""
    return constrain(self.mesh, tree, batch)

  def forward(self, params, tokens, positions, cache, mask, **kw):
    """The target's forward. A method with `taps` (EAGLE with fused features) gets, as hidden,
    those layers' outputs beside the final feature (model.Decoder)."""
    from flax import nnx

    taps = self.method.taps
    if taps and kw.get("num_layers") is None:
      kw.setdefault("taps", taps)
      if getattr(self.method, "raw_taps", False):  # EAGLE-3: the raw residual stream
        kw.setdefault("raw_taps", True)
    with phase(VERIFY):
      return nnx.merge(self.graphdef, params)(tokens, positions, cache, mask, **kw)

  def causal_mask(self, lengths, num_new):
    return kv.causal_mask(lengths, num_new, self.max_len, self.config.sliding_window)


def prefill(prog: Program, params, prompt, prompt_len, max_new, sp, key, eos, max_emit):
  """Runs the prompt through the target and samples the first new token.

  prompt [B,P] int32 (right-padded); prompt_len, max_new [B]. Returns (state, hidden [B,P,E]).

  The forward is the one training reads the frozen target's features with
  (model.forward_sequence); a prefill differs only in what it passes: its own cache of max_len
  slots (sharded, and kept for decoding, where training drops a T-slot one), each row's prompt
  length (rows are right-padded), logits at each row's last prompt token only, empty_cache (no
  [S]-wide read of the empty cache), and the Program's forward, which adds the method's taps.
  On a CPU a long prompt runs in chunks instead (prefill_chunk, _prefill_chunks).
  """
  b, p = prompt.shape
  s = prog.max_len
  cfg = prog.config
  cache = kv.init(cfg.num_layers, b, s, cfg.num_kv_heads, cfg.head_dim,
                  jax.tree_util.tree_leaves(params)[0].dtype)
  cache = prog.constrain(cache, b)
  chunk = prefill_chunk(p, b)
  if chunk == p:
    logits, hidden, cache = forward_sequence(
        cfg, lambda *a, **kw: prog.forward(params, *a, **kw), prompt, cache=cache,
        lengths=prompt_len, logits_at=(prompt_len - 1)[:, None], empty_cache=True)
  else:
    logits, hidden, cache = _prefill_chunks(prog, params, prompt, prompt_len, cache, chunk)
  cache = kv.rollback(cache, prompt_len)
  key, sub = jax.random.split(key)
  first = sampling.sample(sub, logits[:, 0], sp)
  seq = jnp.zeros((b, s), jnp.int32).at[:, :p].set(prompt)
  state = DecodeState(
      seq=seq, seq_len=prompt_len.astype(jnp.int32), prompt_len=prompt_len.astype(jnp.int32),
      max_new=max_new.astype(jnp.int32), done=jnp.zeros((b,), bool), cache=cache, key=key, sp=sp,
      eos=eos, steps=jnp.int32(0), calls=jnp.zeros((b,), jnp.int32),
      hist=jnp.zeros((b, max_emit + 1), jnp.int32))
  return emit(state, first[:, None], jnp.ones((b,), jnp.int32)), hidden


def prefill_chunk(p: int, batch: int) -> int:
  """Prompt rows per prefill forward for B = batch rows padded to P: P (one forward), or on a CPU
  for P > 64 chunks of min(P / 4, 64 / B) rows (at least 16), which keep every product on the
  CPU kernels (kernels.MAX_ROWS = 64 rows of B x rows). A chunked prefill stops after the chunk
  that holds the longest row's last prompt token, so the bucket's padding (up to half of P) costs
  at most a chunk; every chunk reads the weights once more, which a CPU's products at 16-64 rows
  hide behind their arithmetic. Measured on SmolLM2-135M, one prompt, 2 cores: 65 tokens (bucket
  128) 192-216 -> 151-152 ms; 520 tokens (bucket 768) 1179 -> 968 ms; 1000 tokens (bucket
  1024, little padding) 1845-1867 -> 1835-1984 ms. Accelerators keep one forward: large
  products are what they do best."""
  rows = kernels.MAX_ROWS // batch
  if p <= kernels.MAX_ROWS or rows < 16 or jax.default_backend() != "cpu":
    return p
  chunk = min(p // 4, rows)
  return chunk if p % chunk == 0 else p


def _prefill_chunks(prog: Program, params, prompt, prompt_len, cache, chunk: int):
  """The prefill's forward as a loop over chunks of `chunk` prompt rows, each written to the
  cache after the ones before it and attending to them there, as a decoding step attends to
  the tokens before it; it stops after the chunk holding the longest row's last prompt token.
  Returns what forward_sequence does: (logits [B,1,V] at each row's last prompt token, hidden
  [B,P,E] (zero past the last chunk run: padding, which no method reads), cache)."""
  b, p = prompt.shape
  last = prompt_len - 1
  in_prompt = (jnp.arange(prog.max_len)[None, :] < prompt_len[:, None])[:, None, :]  # [B,1,S]

  def forward(i, cache):
    start = i * chunk
    cache = cache.replace(lengths=jnp.full((b,), start, jnp.int32))
    tokens = jax.lax.dynamic_slice_in_dim(prompt, start, chunk, axis=1)
    positions = start + jnp.broadcast_to(jnp.arange(chunk, dtype=jnp.int32), (b, chunk))
    mask = prog.causal_mask(cache.lengths, chunk) & in_prompt
    return prog.forward(params, tokens, positions, cache, mask,
                        logits_at=jnp.clip(last - start, 0, chunk - 1)[:, None])

  shapes = jax.eval_shape(forward, jnp.int32(0), cache)
  logits = jnp.zeros(shapes[0].shape, shapes[0].dtype)
  hidden = jnp.zeros((b, p) + shapes[1].shape[2:], shapes[1].dtype)

  def body(carry):
    i, logits, hidden, cache = carry
    lg, h, cache = forward(i, cache)
    here = (last >= i * chunk) & (last < (i + 1) * chunk)
    logits = jnp.where(here[:, None, None], lg, logits)
    hidden = jax.lax.dynamic_update_slice_in_dim(hidden, h, i * chunk, axis=1)
    return i + 1, logits, hidden, prog.constrain(cache, b)

  todo = (jnp.max(prompt_len) + chunk - 1) // chunk
  _, logits, hidden, cache = jax.lax.while_loop(lambda c: c[0] < todo, body,
                                                (jnp.int32(0), logits, hidden, cache))
  return logits, hidden, cache


def _run(prog: Program, params, arrays, prompt, prompt_len, max_new, sp, key, eos):
  method = prog.method
  state, hidden = prefill(prog, params, prompt, prompt_len, max_new, sp, key, eos, method.max_emit)
  state = state.replace(method=method.init(prog, arrays, state, hidden))
  b = prompt.shape[0]
  state = prog.constrain(state, b)
  limit = prog.max_len  # every active step emits >= 1 token, so this bound is never the reason

  def cond(s):
    return jnp.any(~s.done) & (s.steps < limit)

  def body(s):
    s = method.step(prog, params, arrays, s)
    return prog.constrain(s.replace(steps=s.steps + 1), b)

  state = jax.lax.while_loop(cond, body, state)
  # The cache is large and nobody needs it back; the rest is replicated so every host can read it.
  return sharding.replicate_outputs(prog.mesh, state.replace(cache=None))


_run_jit = jax.jit(_run, static_argnums=0)


# ----------------------------------------------------------------------------- public API


@dataclasses.dataclass
class GenerateOutput:
  tokens: list[list[int]]  # new tokens per prompt, EOS included if produced
  texts: list[str]
  stats: dict


def _next_pow2(n: int, minimum: int) -> int:
  return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def bucket_prompt_len(n: int) -> int:
  """The padded prompt length P: lengths in a bucket share a program. Powers of two (>= 16) up to
  256; past that also three quarters of one (384, 768, 1536, ...). The prefill computes all P
  rows, so a long prompt pays for its padding: with these buckets at most a third of it is
  padding (a 750-token prompt: 768 rows, not 1024)."""
  p = _next_pow2(n, 16)
  return 3 * p // 4 if p > 256 and n <= 3 * p // 4 else p


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


class _CompileCache:
  """Compiled programs by (Program, argument shapes). `count` tells tests when we compiled.

  Bounded: every compiled XLA CPU program keeps its JIT code in a few hundred memory mappings
  (measured ~270 for a tiny model's program), and Linux refuses new mappings past
  vm.max_map_count (65530 by default), which crashes the next compile. A process that compiles
  many programs (a long notebook, a test suite, a sweep over methods and shapes) would get
  there, so once `max_programs` are held, this cache and jax's own caches are cleared (the next
  call of each program recompiles).
  """

  def __init__(self, max_programs: int = 96):
    self.programs: dict = {}
    self.count = 0
    self.max_programs = max_programs

  def clear(self) -> None:
    """Drops every compiled program (ours and jax's caches), freeing their code."""
    self.programs.clear()
    jax.clear_caches()

  def get(self, prog: Program, args) -> tuple[Any, float]:
    shapes = tuple((x.shape, x.dtype, getattr(x, "sharding", None))
                   for x in jax.tree_util.tree_leaves(args))
    treedef = jax.tree_util.tree_structure(args)
    key = (prog, shapes, treedef)
    if key in self.programs:
      return self.programs[key], 0.0
    if len(self.programs) >= self.max_programs:
      self.clear()
    t0 = time.perf_counter()
    compiled = _run_jit.lower(prog, *args).compile(compile_options.for_weights(args[0]))
    self.count += 1
    self.programs[key] = compiled
    return compiled, time.perf_counter() - t0


compile_cache = _CompileCache()


class _ArraysCache:
  """method.arrays(model), kept while the method and the model live and model.params is the same
  object. Building them repacks heads for the CPU kernel and gathers a vocabulary subset's
  LM-head rows: 10-80 ms for SmolLM2's shipped heads and draft, paid on every generate call
  before this (a tenth of a 64-token EAGLE call). `count` tells tests when arrays were built."""

  def __init__(self):
    self._entries = {}
    self.count = 0

  def get(self, method, model):
    key = (id(method), id(model))
    hit = self._entries.get(key)
    if hit is not None and hit[0]() is method and hit[1]() is model and hit[2]() is model.params:
      return hit[3]
    arrays = method.arrays(model)
    self.count += 1
    drop = lambda _ref: self._entries.pop(key, None)  # noqa: E731
    try:
      refs = (weakref.ref(method, drop), weakref.ref(model, drop), weakref.ref(model.params, drop))
    except TypeError:  # something that cannot be weakly referenced: build every time
      return arrays
    self._entries[key] = (*refs, arrays)
    return arrays


arrays_cache = _ArraysCache()


def generate(model, prompts, method: Method, *, max_new_tokens: int = 64,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             chat: bool = False, stop_at_eos: bool = True, mesh=None) -> GenerateOutput:
  """Generates up to max_new_tokens for each prompt with `method` (a `Method` object; the
  public sj.generate also takes a registered name, and None for autoregressive decoding).

  mesh: "data=2,model=4", a jax Mesh, or None (the mesh the model's params are already sharded
  on, if any; else one device). Prompts are split over `data` (their count must divide by it);
  parameters (the target's and a method's, e.g. a draft model's) are placed by
  sj.sharding.DEFAULT_RULES unless already placed (load_model(..., mesh=)). Outputs are identical
  to one device. See docs/sharding.md.

  prompts: a list of strings (tokenised; chat=True wraps each in the tokenizer's chat template)
  or of token-id lists (ints in [0, V); chat=True with token ids is an error). temperature: 0 is
  greedy, and so is any temperature below sampling.MIN_TEMPERATURE (1e-5), where logits /
  temperature would overflow float32. Every argument is checked (specjax.validate) before
  anything compiles: a bad one raises InputError naming it, its value and what is allowed.
  """
  malloc.tune()
  a = check_arguments(max_new_tokens, temperature, top_k, top_p, seed, chat, stop_at_eos)
  max_new_tokens = a["max_new_tokens"]
  check_method(method)
  method.validate(model)
  ids = _encode(model, prompts, a["chat"])
  _check_context(model, ids, max_new_tokens)
  mesh = _plan_mesh(model, mesh, len(ids))
  if distributed.spans_processes(mesh):
    distributed.check_same([ids, a], "prompts and generation settings")
  p, s = _plan_shapes(ids, max_new_tokens, method)
  args = _device_args(model, method, ids, p, max_new_tokens,
                      SamplingParams.make(len(ids), a["temperature"], a["top_k"], a["top_p"]),
                      jax.random.PRNGKey(a["seed"]), _eos_ids(model, a["stop_at_eos"]))
  if mesh is not None:
    args = _place_on_mesh(mesh, args)
  prog = Program(model.graphdef, model.config, method, s, mesh)
  compiled, compile_s = compile_cache.get(prog, args)
  t0 = time.perf_counter()
  state = jax.block_until_ready(compiled(*args))
  wall = time.perf_counter() - t0
  tokens, texts = _decode_rows(model, state)
  stats = _stats(method, state, tokens, wall, compile_s)
  stats.update(prompt_bucket=p, cache_len=s, **method.stats(state))
  return GenerateOutput(tokens, texts, stats)


def check_arguments(max_new_tokens, temperature, top_k, top_p, seed, chat, stop_at_eos) -> dict:
  """The sampling arguments, before anything is encoded or compiled -> them as plain Python
  values (numpy / JAX scalars converted)."""
  return dict(
      max_new_tokens=validate.integer("max_new_tokens", max_new_tokens, 1),
      temperature=validate.number("temperature", temperature, 0, what=" (0 = greedy)"),
      top_k=validate.integer("top_k", top_k, 0, what=" (0 = off)"),
      top_p=validate.number("top_p", top_p, 0, 1, lo_open=True, what=" (1 = off)"),
      seed=validate.seed("seed", seed),
      chat=validate.boolean("chat", chat),
      stop_at_eos=validate.boolean("stop_at_eos", stop_at_eos))


def _check_context(model, ids: list[list[int]], max_new_tokens: int) -> None:
  cfg = model.config
  longest = max(len(x) for x in ids)
  if longest + max_new_tokens > cfg.max_position_embeddings:
    raise InputError(
        f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds the model's context "
        f"of {cfg.max_position_embeddings} tokens")


def _plan_mesh(model, mesh, batch: int):
  """The mesh to run on (None: one device), checked against the batch and the params."""
  if mesh is None:
    mesh = sharding.mesh_of(model.params)
  if mesh is not None:
    mesh = sharding.make_mesh(mesh)
    sharding.check_batch(mesh, batch)
    sharding.check_model_axis(mesh, model.params)
  return mesh


def _plan_shapes(ids: list[list[int]], max_new_tokens: int, method: Method) -> tuple[int, int]:
  """(P, S): the prompt bucket and the cache length, rounded so nearby requests share a program."""
  p = bucket_prompt_len(max(len(x) for x in ids))
  s = p + _next_pow2(max_new_tokens, 16) + method.extra_slots
  return p, -(-s // 16) * 16


def _eos_ids(model, stop_at_eos: bool) -> np.ndarray:
  """[N_eos] int32 stop tokens: the config's and the tokenizer's (one -1 = none)."""
  cfg = model.config
  eos_ids = sorted(set(cfg.eos_token_ids) | (
      {model.tokenizer.eos_token_id} if model.tokenizer is not None
      and model.tokenizer.eos_token_id is not None else set())) if stop_at_eos else []
  eos = np.full((max(1, len(eos_ids)),), -1, np.int32)
  eos[:len(eos_ids)] = eos_ids
  return eos


def _device_args(model, method, ids, p: int, max_new_tokens: int, sp, key, eos) -> tuple:
  """`_run`'s arguments after the Program: params, method arrays, prompt [B,P] right-padded,
  prompt_len [B], max_new [B], sampling params, key, eos [N_eos]."""
  b = len(ids)
  prompt = np.zeros((b, p), np.int32)
  for i, x in enumerate(ids):
    prompt[i, :len(x)] = x
  return (model.params, arrays_cache.get(method, model), jnp.asarray(prompt),
          jnp.asarray([len(x) for x in ids], jnp.int32),
          jnp.full((b,), max_new_tokens, jnp.int32), sp, key, jnp.asarray(eos))


def _place_on_mesh(mesh, args) -> tuple:
  """Params by the sharding rules, per-row arguments over `data`, the key and eos replicated."""
  params, arrays, *batch_args, key, eos_arr = args
  return (sharding.shard_params(mesh, params), sharding.shard_params(mesh, arrays),
          *sharding.rows(mesh, tuple(batch_args)), *sharding.replicate(mesh, (key, eos_arr)))


def _decode_rows(model, state) -> tuple[list[list[int]], list[str]]:
  """The new tokens of each row (EOS included if produced) and their text."""
  seq, seq_len, plen = (np.asarray(x) for x in (state.seq, state.seq_len, state.prompt_len))
  tokens = [seq[i, plen[i]:seq_len[i]].tolist() for i in range(len(seq))]
  texts = ([model.tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
           if model.tokenizer is not None else [""] * len(tokens))
  return tokens, texts


def _stats(method, state, tokens, wall: float, compile_s: float) -> dict:
  """The statistics every method reports."""
  calls = np.asarray(state.calls)
  new = int(sum(len(t) for t in tokens))
  return {
      "method": method.name,
      "batch": len(tokens),
      "new_tokens": new,
      "steps": int(state.steps) + 1,  # loop iterations + the prefill call
      "target_calls_per_row": calls.tolist(),
      "mean_accepted": float(new / max(1, calls.sum())),  # tau: tokens per target call
      "accept_hist": np.asarray(state.hist).sum(0).tolist(),
      "wall_time_s": wall,
      "tokens_per_second": new / wall if wall > 0 else float("inf"),
      "compile_time_s": compile_s,
  }
