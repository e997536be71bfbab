"""The self-distillation corpus: the target's own responses to a large, evaluation-free prompt pool.

    specjax data generate --model smollm2-135m --out corpus/ --tokens 2M   ->   generate_corpus(...)

Every drafter we train (draft models, Medusa, EAGLE and MTP heads) learns to predict what the
*target* says next, so its training text should be what the target says: responses it generated
itself (Medusa-1 and EAGLE do the same with ShareGPT prompts). Generation is batched through
specjax's own `generate`: on a CPU a batch of 64 rows costs a few single-row steps, because every
step reads the same weights (see the throughput figures in docs/training.md).

Layout of a corpus directory:

  meta.json            model name, vocab size, sha256 of the weights, tokenizer, generation settings,
                       the prompt pool's mix and seed; written first, checked on every resume
  shard-00000.npz ...  one generate call each: tokens (uint16 when the vocabulary fits, else uint32)
                       of every row's prompt + response concatenated, offsets [n+1] into them,
                       prompt_lens [n], finished [n] (ended at EOS, else capped), temperature [n],
                       pool_index [n] (the prompt's place in the pool). Written to a temporary name
                       and renamed, so an interrupted run never leaves half a shard.

Shard i always takes pool prompts [i*B, (i+1)*B) and temperature temperatures[i % len] with seed
(seed, i), so rerunning an interrupted command continues from the last complete shard and yields
exactly the corpus an uninterrupted run would have written.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import numpy as np

from specjax.errors import InputError
from specjax.training import folders

META = "meta.json"
FORMAT_VERSION = 1
DEFAULT_TEMPERATURES = (0.0, 0.7, 1.0, 0.8)  # one greedy shard in four


def weights_sha256(model) -> str:
  """sha256 over the model's parameter bytes (tree order): which weights produced a corpus.
  Load-time copies (the CPU kernel's packed weights) are derived data and not hashed."""
  import jax

  from specjax.packing import unpack

  h = hashlib.sha256()
  for x in jax.tree_util.tree_leaves(unpack(model).params):
    h.update(np.ascontiguousarray(np.asarray(x)).tobytes())
  return h.hexdigest()


def _shard_path(d: str, i: int) -> str:
  return os.path.join(d, f"shard-{i:05d}.npz")


def _complete_shards(d: str) -> list[int]:
  out = []
  i = 0
  while os.path.isfile(_shard_path(d, i)):
    out.append(i)
    i += 1
  return out


def parse_count(text) -> int:
  """'2M', '500k', '1_000', 2000 -> int (for --tokens); anything else ('inf', '2.5', 'lots', 0) is
  an InputError."""
  from specjax import validate

  return validate.count("tokens", text)


def _check_out_dir(out_dir: str) -> None:
  if not isinstance(out_dir, str) or not out_dir:
    raise InputError(f"out_dir={out_dir!r} is invalid: give a directory path")
  try:
    os.makedirs(out_dir, exist_ok=True)
    probe = os.path.join(out_dir, ".write-test")
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise InputError(f"out_dir={out_dir!r} is not a writable directory: {e}") from None


def generate_corpus(model, out_dir: str, *, tokens=2_000_000, batch_size: int = 64,
                    micro_batch: int = 16, max_new_tokens: int = 256,
                    temperatures=DEFAULT_TEMPERATURES, top_p: float = 1.0,
                    seed: int = 0, max_prompt_chars: int = 900, max_minutes: float | None = None,
                    progress: bool = True, on_shard=None, pool=None) -> "Corpus":
  """Generates shards until the corpus holds at least `tokens` response tokens (or max_minutes).

  model: a loaded specjax Model (with a tokenizer) or a name / path for `load_model`.
  batch_size: rows per shard. micro_batch: rows per `generate` call; a shard's rows are sorted
  by prompt length and decoded micro_batch at a time, so a call's KV cache is sized by prompts of
  similar length (one 375-token prompt made a 64-row call attend 528 slots for every row) and a
  call stops when its own rows are done. 16 is the fastest batch on the 2-core CPU (`specjax data
  throughput`). It changes which tokens are sampled, not the settings a corpus is made with, and
  each shard records the value it was made with.
  on_shard(i, shard_dict) is called after shard i is written (tests use it to interrupt a run).
  pool: the prompt list [{"text", "chat", "source"}] (default: `prompt_pool.build(seed)`). A
  tokenizer without a chat template (a base model, or a GGUF that carries none, e.g. Gemma 3
  270M's) gets every prompt as raw text, and the corpus records "raw_prompts": true.
  Rerunning with the same arguments resumes; different settings on an existing corpus raise.
  """
  # A failed run removes the folder it created, unless a complete shard is there to resume from.
  with folders.removed_on_failure(out_dir, lambda d: bool(_complete_shards(d))):
    total, temps = _check_corpus_args(tokens, batch_size, micro_batch, max_new_tokens,
                                      temperatures, seed, out_dir)
    if isinstance(model, str):
      from specjax.weights import load_model
      name = model
      model = load_model(model)
    else:
      name = model.name or "model"
    if model.tokenizer is None:
      raise InputError(f"model {name!r} has no tokenizer: a corpus needs text prompts")
    pool, pool_info = _prompt_pool(pool, seed, max_prompt_chars)
    raw = not getattr(model.tokenizer, "chat_template", None)
    if raw:  # a model without a chat template (a base model, or a GGUF that carries none)
      pool = [dict(p, chat=False) for p in pool]
    v = model.config.vocab_size
    meta = {
        "format": FORMAT_VERSION, "model": name, "vocab_size": v,
        "weights_sha256": weights_sha256(model),
        "tokenizer": getattr(model.tokenizer, "name_or_path", ""),
        "token_dtype": "uint16" if v <= 1 << 16 else "uint32",
        "batch_size": batch_size, "max_new_tokens": max_new_tokens, "temperatures": list(temps),
        "top_p": top_p, "seed": seed, "pool": pool_info,
    }
    if raw:  # recorded only then, so corpora made with chat prompts resume as before
      meta["raw_prompts"] = True
    _check_or_write_meta(out_dir, meta)
    done = _complete_shards(out_dir)
    have = sum(_response_tokens(np.load(_shard_path(out_dir, i))) for i in done)
    bar = None
    if progress:
      from tqdm.auto import tqdm
      bar = tqdm(total=total, initial=min(have, total), unit="tok", desc="corpus",
                 dynamic_ncols=True)
    t0 = time.time()
    i = len(done)
    dtype = np.uint16 if meta["token_dtype"] == "uint16" else np.uint32
    while have < total:
      if max_minutes is not None and time.time() - t0 > 60 * max_minutes:
        break
      shard = _generate_shard(model, pool, i, batch_size, max_new_tokens, temps[i % len(temps)],
                              top_p, seed, dtype, micro_batch)
      _atomic_npz(_shard_path(out_dir, i), shard)
      n = _response_tokens(shard)
      have += n
      if bar is not None:
        bar.update(min(n, max(0, total - bar.n)))
      if on_shard is not None:
        on_shard(i, shard)
      i += 1
    if bar is not None:
      bar.close()
    return load(out_dir)


def _check_corpus_args(tokens, batch_size, micro_batch, max_new_tokens, temperatures, seed,
                       out_dir):
  """generate_corpus's checks that need no model. Returns (response tokens wanted, temperatures
  as a tuple of floats)."""
  from specjax import validate
  from specjax.errors import check_int

  total = parse_count(tokens)
  check_int("batch_size", batch_size, 1, 4096)
  check_int("micro_batch", micro_batch, 1, 4096)
  check_int("max_new_tokens", max_new_tokens, 1, 1 << 16)
  validate.integer("seed", seed, 0, validate.SEED_MAX)  # the prompt pool's numpy generator's
  listed = not isinstance(temperatures, (str, bytes)) and hasattr(temperatures, "__iter__")
  temps = list(temperatures) if listed else []
  if not temps:
    raise InputError(f"temperatures={temperatures!r} is invalid: a list of finite numbers >= 0 "
                     f"(0 = greedy)")
  temps = tuple(validate.number(f"temperatures[{i}]", t, 0, what=" (0 = greedy)")
                for i, t in enumerate(temps))
  _check_out_dir(out_dir)
  return total, temps


def _prompt_pool(pool, seed: int, max_prompt_chars: int):
  """The prompts a corpus is generated from (the caller's, or `prompt_pool.build(seed)`), those
  longer than max_prompt_chars dropped. Returns (pool, its description for meta.json)."""
  from specjax.training import prompt_pool

  pool_info = {"seed": seed, "max_prompt_chars": max_prompt_chars}
  if pool is None:
    pool, info = prompt_pool.build(seed)
    pool_info.update(info)
  else:
    pool_info["sources"] = "caller"
  pool = [p for p in pool if len(p["text"]) <= max_prompt_chars]
  if not pool:
    raise InputError(f"no prompt of at most max_prompt_chars={max_prompt_chars} characters")
  return pool, pool_info


def _check_or_write_meta(out_dir: str, meta: dict) -> None:
  """A new corpus gets meta.json; an existing one must have been made with the same settings
  (rerunning resumes it), else InputError naming the settings that differ."""
  path = os.path.join(out_dir, META)
  if os.path.isfile(path):
    with open(path) as f:
      old = json.load(f)
    keys = [k for k in meta if k != "pool"] + ["pool"]
    diff = [k for k in keys if old.get(k) != meta[k]]
    if diff:
      raise InputError(f"{out_dir} holds a corpus made with other settings ({', '.join(diff)} "
                       f"differ: e.g. {diff[0]}={old.get(diff[0])!r}, now {meta[diff[0]]!r}); "
                       f"use another directory or the same arguments to resume")
  else:
    _atomic_json(path, meta)


def _generate_shard(model, pool, i, batch_size, max_new_tokens, temperature, top_p, seed, dtype,
                    micro_batch):
  from specjax.api import generate
  from specjax.decode import _encode

  idx = [(i * batch_size + j) % len(pool) for j in range(batch_size)]
  rows = []
  for k in idx:  # chat and raw prompts are both token lists here
    rows.append(_encode(model, [pool[k]["text"]], pool[k]["chat"])[0])
  mb = min(micro_batch, batch_size)
  order = sorted(range(batch_size), key=lambda j: (len(rows[j]), j))  # stable: deterministic
  responses = [None] * batch_size
  for c, lo in enumerate(range(0, batch_size, mb)):
    part = order[lo:lo + mb]
    call_seed = [seed, i] if mb == batch_size else [seed, i, c]  # whole-shard calls as before
    out = generate(model, [rows[j] for j in part], max_new_tokens=max_new_tokens,
                   temperature=temperature, top_p=top_p,
                   seed=int(np.random.SeedSequence(call_seed).generate_state(1)[0] >> 1))
    for j, t in zip(part, out.tokens):
      responses[j] = t
  eos = set(model.config.eos_token_ids) | ({model.tokenizer.eos_token_id}
                                           if model.tokenizer.eos_token_id is not None else set())
  seqs = [r + t for r, t in zip(rows, responses)]
  offsets = np.zeros(len(seqs) + 1, np.int64)
  offsets[1:] = np.cumsum([len(s) for s in seqs])
  return {
      "tokens": np.concatenate([np.asarray(s, dtype) for s in seqs]),
      "offsets": offsets,
      "prompt_lens": np.asarray([len(r) for r in rows], np.int32),
      "finished": np.asarray([bool(t) and t[-1] in eos for t in responses]),
      "temperature": np.full(len(seqs), temperature, np.float32),
      "pool_index": np.asarray(idx, np.int64),
      "micro_batch": np.asarray(mb, np.int32),
  }


def _response_tokens(shard) -> int:
  return int((shard["offsets"][-1] - shard["offsets"][0]) - np.sum(shard["prompt_lens"]))


def _atomic_npz(path: str, arrays: dict) -> None:
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    np.savez_compressed(f, **arrays)
  os.replace(tmp, path)


def _atomic_json(path: str, obj: dict) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1)
  os.replace(tmp, path)


# ----------------------------------------------------------------------------- reading


class Corpus:
  """A corpus directory, read whole into memory (uint16 ids: 2M tokens are 4 MB)."""

  def __init__(self, path: str, meta: dict, tokens: np.ndarray, offsets: np.ndarray,
               prompt_lens: np.ndarray, extra: dict):
    self.path, self.meta = path, meta
    self.tokens, self.offsets, self.prompt_lens = tokens, offsets, prompt_lens
    self.extra = extra  # finished, temperature, pool_index per sequence

  def __len__(self) -> int:
    return len(self.prompt_lens)

  @property
  def num_response_tokens(self) -> int:
    return int(self.offsets[-1] - np.sum(self.prompt_lens))

  def sequence(self, i: int) -> tuple[np.ndarray, int]:
    """(tokens [n] int32: prompt then response, prompt_len)."""
    return self.tokens[self.offsets[i]:self.offsets[i + 1]].astype(np.int32), int(self.prompt_lens[i])

  def response(self, i: int) -> np.ndarray:
    toks, p = self.sequence(i)
    return toks[p:]

  def split(self, held_out: float = 0.02, seed: int = 0) -> np.ndarray:
    """[n] bool: True for held-out sequences (a pure function of (seed, index))."""
    if not 0.0 <= held_out < 1.0:
      raise InputError(f"held_out={held_out!r} is invalid: a fraction in [0, 1)")
    return np.random.default_rng([seed, 7919]).random(len(self)) < held_out

  def windows(self, seq_len: int, split: str = "train", held_out: float = 0.02, seed: int = 0):
    """Consecutive windows of every sequence in the split.

    Returns (tok [Nw, seq_len] int32, 0-padded; mask [Nw, seq_len] bool, True where the NEXT token
    tok[:, t+1] is a response token: the positions a drafter learns to predict from). Windows
    overlap by one token, so every transition is inside exactly one window. Held-out windows
    come from held-out sequences only: they never overlap training windows.
    """
    if split not in ("train", "heldout"):
      raise InputError(f"split={split!r} is invalid: 'train' or 'heldout'")
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 2:
      raise InputError(f"seq_len={seq_len!r} is invalid: an integer >= 2")
    chosen = self.split(held_out, seed) == (split == "heldout")
    toks, masks = [], []
    stride = seq_len - 1
    for i in np.flatnonzero(chosen):
      seq, p = self.sequence(i)
      n = len(seq)
      for s in range(0, max(n - 1, 1), stride):
        w = seq[s:s + seq_len]
        t = np.zeros(seq_len, np.int32)
        t[:len(w)] = w
        nxt = s + 1 + np.arange(seq_len)  # absolute index of each position's next token
        m = (nxt < s + len(w)) & (nxt >= p)  # the next token is inside this window
        if m.any():
          toks.append(t)
          masks.append(m)
    if not toks:
      return np.zeros((0, seq_len), np.int32), np.zeros((0, seq_len), bool)
    return np.stack(toks), np.stack(masks)

  def check_compatible(self, target) -> None:
    """Raises InputError if the corpus was made with another vocabulary than `target`'s; warns if
    it was made with other weights (the text is still the same tokenizer's)."""
    v = target.config.vocab_size
    if self.meta.get("vocab_size") != v:
      raise InputError(
          f"corpus {self.path} was generated by {self.meta.get('model')!r} with vocab_size="
          f"{self.meta.get('vocab_size')}, but the target has vocab_size={v}: build a corpus "
          f"with this target (`specjax data generate --model ...`)")
    want = self.meta.get("weights_sha256")
    if want and want != weights_sha256(target):
      import warnings
      warnings.warn(f"corpus {self.path} was generated by other weights ({self.meta.get('model')!r}) "
                    f"than the target's: drafters learn that model's outputs", stacklevel=2)

  def __repr__(self):
    return (f"Corpus({self.path}: {len(self)} sequences, {self.num_response_tokens} response tokens, "
            f"model {self.meta.get('model')!r})")


def load(path: str) -> Corpus:
  """Reads a corpus directory written by `generate_corpus`."""
  if not isinstance(path, str) or not os.path.isfile(os.path.join(path, META)):
    raise InputError(f"corpus={path!r} is not a corpus directory (no {META}); build one with "
                     f"`specjax data generate`")
  with open(os.path.join(path, META)) as f:
    meta = json.load(f)
  if meta.get("format") != FORMAT_VERSION:
    raise InputError(f"corpus {path}: format {meta.get('format')!r}, this specjax reads {FORMAT_VERSION}")
  shards = [np.load(_shard_path(path, i)) for i in _complete_shards(path)]
  if not shards:
    return Corpus(path, meta, np.zeros((0,), np.uint16), np.zeros((1,), np.int64),
                  np.zeros((0,), np.int32), {})
  toks = np.concatenate([s["tokens"] for s in shards])
  base = np.cumsum([0] + [len(s["tokens"]) for s in shards[:-1]])
  offsets = np.concatenate([s["offsets"][:-1] + b for s, b in zip(shards, base)] + [[len(toks)]])
  extra = {k: np.concatenate([s[k] for s in shards]) for k in ("finished", "temperature", "pool_index")}
  return Corpus(path, meta, toks, offsets.astype(np.int64),
                np.concatenate([s["prompt_lens"] for s in shards]), extra)


def measure_throughput(model, batch_sizes=(1, 16, 32, 64), *, new_tokens: int = 64,
                       prompt_tokens: int = 48, seed: int = 0) -> list[dict]:
  """Generation tokens/s at each batch size (random prompts, no EOS, second of two runs)."""
  from specjax.api import generate

  rng = np.random.default_rng(seed)
  rows = []
  for b in batch_sizes:
    prompts = [rng.integers(100, model.config.vocab_size - 1, size=prompt_tokens).tolist()
               for _ in range(b)]
    runs = [generate(model, prompts, max_new_tokens=new_tokens, temperature=0.8, seed=s,
                     stop_at_eos=False).stats for s in range(2)]
    st = runs[-1]
    rows.append({"batch": b, "tokens_per_second": st["tokens_per_second"],
                 "step_ms": 1000 * st["wall_time_s"] / new_tokens})
  base = rows[0]["tokens_per_second"]
  for r in rows:
    r["vs_batch1"] = r["tokens_per_second"] / base
  return rows
