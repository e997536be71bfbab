"""The user-facing call: `generate` checks its arguments, encodes the prompts, plans the shapes
and the mesh, runs the compiled loop and reports the statistics every method reports.
"""

from __future__ import annotations

import dataclasses
import math
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from specjax import distributed
from specjax import malloc
from specjax import sharding
from specjax import validate
from specjax.decode._loop import compile_cache
from specjax.decode._method import Method, Program, check_method
from specjax.decode._text import _decode_rows, _encode
from specjax.errors import InputError
from specjax.sampling import SamplingParams


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


class _ArraysCache:
  """build(method, model) (default: method.arrays(model)), kept while the method and the model
  live and model.params is the same object. Building arrays repacks heads for the CPU kernel and
  gathers a vocabulary subset's LM-head rows, a noticeable part of a short generate call, which
  every call paid before this (measured: docs/performance.md); a prepared method (`prepare`) is
  kept so that its arrays are too. `count` tells tests when one was built."""

  def __init__(self, build=lambda method, model: method.arrays(model)):
    self._build = build
    self._entries = {}
    self.count = 0

  def get(self, method, model):
    key = (id(method), id(model))
    hit = self._entries.get(key)
    if hit is not None and hit[0]() is method and hit[1]() is model and hit[2]() is model.params:
      return hit[3]
    arrays = self._build(method, model)
    self.count += 1
    drop = lambda _ref: self._entries.pop(key, None)  # noqa: E731
    try:
      refs = (weakref.ref(method, drop), weakref.ref(model, drop), weakref.ref(model.params, drop))
    except TypeError:  # something that cannot be weakly referenced: build every time
      return arrays
    self._entries[key] = (*refs, arrays)
    return arrays


arrays_cache = _ArraysCache()


def _prepare(method, model):
  """method.prepare(model) where the method has that verb (the contract's optional one)."""
  prepare = getattr(method, "prepare", None)
  return method if prepare is None else prepare(model)


prepared_cache = _ArraysCache(_prepare)


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
  method = prepared_cache.get(method, model)
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
