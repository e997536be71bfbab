"""Distilling a small draft model from its target (optax, orbax checkpoints, resumable).

    specjax train draft   ->   train_draft(...)

1. Data, two kinds, both labelled by the target (cached to `data.npz`):
   - generated: the target's own continuations of prompts (greedy and temperature 0.7, batched
     through `sj.generate`); labels = the target's next tokens (sequence-level distillation);
   - teacher-forced: prompt / answer / code text run through the target in one forward per batch;
     labels = the target's argmax at every position. Far cheaper per label than generating (one
     parallel forward instead of one step per token), which matters on a 2-core CPU.
2. Vocabulary subset (FR-Spec): the Vs tokens the target emits most often in that data, topped up
   with the lowest token ids (BPE merge order ~ frequency). The draft proposes only over these, so
   its LM head costs Vs/V of the target's; lossless, since verification uses the full p.
3. Draft: the target's first `num_layers` layers and final norm as the starting point, sharing the
   target's embeddings and LM head rows (frozen, not stored). Only the layers and final norm train.
4. Training: cross-entropy of the draft's subset logits against the target's labels (labels
   outside the subset are skipped), AdamW with warmup + cosine decay, orbax checkpoints every
   `ckpt_every` steps and on interruption; rerunning the same command resumes from the latest.
5. Export: only the draft's own tensors (float16) + the subset ids + a small JSON header, to
   `specjax/assets/<name>.npz`; `load_draft_asset` rebuilds the Model with the target's tensors.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import cache as kv
from specjax.errors import InputError
from specjax.model import Model, path_key

PROMPTS_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "prompts")
ASSETS_DIR = os.path.join(os.path.dirname(__file__), "assets")
_FALLBACK = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a",
             "Explain why the sky is blue.", "Write a haiku about the sea.", "What is 12 times 13?",
             "List three prime numbers:", "Translate 'good morning' into French:"]


# ----------------------------------------------------------------------------- prompts


def training_prompts(prompts_dir: str = PROMPTS_DIR, *, held_out: int = 20, max_chars: int = 800,
                     limit: int = 400, seed: int = 0) -> list[tuple[str, bool]]:
  """(prompt, chat) pairs for distillation, disjoint from the benchmark's first `held_out`
  MT-Bench and HumanEval prompts. Falls back to a built-in list when the directory is absent."""
  out: list[tuple[str, bool]] = []

  def jsonl(name, opener=open):
    path = os.path.join(prompts_dir, name)
    if not os.path.isfile(path):
      return []
    with opener(path, "rt") as f:
      return [json.loads(line) for line in f if line.strip()]

  mt = jsonl("mt_bench.jsonl")
  out += [(r["turns"][0], True) for r in mt[held_out:]]
  spec = jsonl("spec_bench.jsonl")
  out += [(r["turns"][0], True) for r in spec[80:]]  # the first 80 rows are MT-Bench
  out += [(r["question"], True) for r in jsonl("gsm8k_test.jsonl")[:150]]
  out += [(r["prompt"], False) for r in jsonl("humaneval.jsonl.gz", gzip.open)[held_out:]]
  out = [(p, c) for p, c in out if len(p) <= max_chars]
  if not out:
    out = [(p, True) for p in _FALLBACK]
  rng = np.random.default_rng(seed)
  rng.shuffle(out)
  return out[:limit]


# ----------------------------------------------------------------------------- data


def generate_data(target: Model, prompts: list[tuple[str, bool]], *, max_new_tokens: int = 128,
                  batch_size: int = 16, max_minutes: float = 10.0, log=print) -> dict:
  """Target continuations: {"tokens": [N,T] int32 (0-padded), "labels": [N,T] (-1 = none)}.

  Alternate batches are greedy and temperature 0.7; stops early after max_minutes.
  """
  from specjax.decode import generate

  seqs, plens = [], []
  t0 = time.time()
  by_mode = {True: [p for p, c in prompts if c], False: [p for p, c in prompts if not c]}
  batches = []
  for chat, ps in by_mode.items():
    ps = sorted(ps, key=len)  # similar lengths share a prompt bucket (fewer compiles)
    batches += [(chat, ps[i:i + batch_size]) for i in range(0, len(ps), batch_size)]
  for i, (chat, batch) in enumerate(batches):
    if time.time() - t0 > 60 * max_minutes:
      log(f"data: time limit after {i} batches")
      break
    out = generate(target, batch, max_new_tokens=max_new_tokens, temperature=0.0 if i % 2 == 0 else 0.7,
                   seed=i, chat=chat, stop_at_eos=True)
    for prompt, toks in zip(batch, out.tokens):
      ids = _encode(target, prompt, chat)
      seqs.append(ids + toks)
      plens.append(len(ids))
    log(f"data: batch {i + 1}/{len(batches)} ({sum(len(s) - p for s, p in zip(seqs, plens))} "
        f"target tokens, {time.time() - t0:.0f}s)")
  n, t = len(seqs), max(len(s) for s in seqs)
  tokens = np.zeros((n, t), np.int32)
  for i, s in enumerate(seqs):
    tokens[i, :len(s)] = s
  labels = np.full((n, t), -1, np.int32)  # label at t = the token the target put at t + 1
  for i, (s, p) in enumerate(zip(seqs, plens)):
    labels[i, p - 1:len(s) - 1] = s[p:]
  return {"tokens": tokens, "labels": labels}


def training_texts(prompts_dir: str = PROMPTS_DIR, *, held_out: int = 20) -> list[tuple[str, bool]]:
  """(text, chat) pairs for teacher forcing: questions (chat template) and answers / code (raw),
  disjoint from the benchmark's first `held_out` MT-Bench and HumanEval prompts."""
  out = list(training_prompts(prompts_dir, held_out=held_out, max_chars=4000, limit=10 ** 6))
  path = os.path.join(prompts_dir, "gsm8k_test.jsonl")
  if os.path.isfile(path):
    with open(path) as f:
      rows = [json.loads(line) for line in f]
    out += [(r["question"] + "\n" + r["answer"], False) for r in rows[150:]]
  path = os.path.join(prompts_dir, "humaneval.jsonl.gz")
  if os.path.isfile(path):
    with gzip.open(path, "rt") as f:
      rows = [json.loads(line) for line in f]
    out += [(r["prompt"] + r["canonical_solution"], False) for r in rows[held_out:]]
  return out


def teacher_data(target: Model, texts: list[tuple[str, bool]], *, seq_len: int = 256,
                 batch_size: int = 8, max_minutes: float = 5.0, seed: int = 0, log=print) -> dict:
  """Texts packed into [N, seq_len] windows, labelled by the target's argmax at every position."""
  stream: list[int] = []
  for text, chat in texts:
    stream += _encode(target, text, chat)
  n = len(stream) // seq_len
  windows = np.asarray(stream[:n * seq_len], np.int32).reshape(n, seq_len)
  np.random.default_rng(seed).shuffle(windows)
  cfg = target.config

  @jax.jit
  def label(params, toks):  # [B,T] -> [B,T] argmax next tokens
    b, t = toks.shape
    cache = kv.init(cfg.num_layers, b, t, cfg.num_kv_heads, cfg.head_dim, target.dtype)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, _, _ = target.apply(params, toks, pos, cache, kv.causal_mask(cache.lengths, t, t))
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)

  t0 = time.time()
  toks, labels = [], []
  for i in range(0, n - batch_size + 1, batch_size):
    if time.time() - t0 > 60 * max_minutes:
      break
    x = windows[i:i + batch_size]
    toks.append(x)
    labels.append(np.asarray(label(target.params, jnp.asarray(x))))
    log(f"teacher: {i + batch_size}/{n} windows ({time.time() - t0:.0f}s)")
  return {"tokens": np.concatenate(toks), "labels": np.concatenate(labels)}


def _encode(model, prompt, chat):
  from specjax.decode import _encode as enc

  return enc(model, [prompt], chat)[0]


def vocab_subset(data: dict, vocab_size: int, size: int) -> np.ndarray:
  """[Vs] int32: the `size` tokens the target predicts most often, topped up with the lowest ids."""
  lab = data["labels"]
  counts = np.bincount(lab[lab >= 0].ravel(), minlength=vocab_size)
  seen = np.flatnonzero(counts)
  seen = seen[np.argsort(-counts[seen], kind="stable")][:size]
  rest = np.setdiff1d(np.arange(vocab_size), seen)[:size - len(seen)]
  return np.sort(np.concatenate([seen, rest])).astype(np.int32)


# ----------------------------------------------------------------------------- the draft


def _flat_name(key: tuple) -> str:
  return "_".join(map(str, key))


def own_params(draft: Model) -> dict:
  """name -> array for the draft's own (trainable, stored) tensors; shared ones excluded."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(draft.params):
    key = path_key(path)
    if key not in draft.shared:
      out[_flat_name(key)] = leaf
  return out


def with_params(draft: Model, own: dict):
  """The draft's param State with its own tensors replaced by `own` (works under jit)."""
  def pick(path, leaf):
    name = _flat_name(path_key(path))
    return own[name] if name in own else leaf
  return jax.tree_util.tree_map_with_path(pick, draft.params)


def draft_from_target(target: Model, num_layers: int = 2, vocab: np.ndarray | None = None,
                      own: dict | None = None, name: str = "draft") -> Model:
  """A `num_layers`-layer draft sharing the target's embeddings / LM head (and tokenizer).

  Its own tensors start as copies of the target's first layers and final norm, or come from `own`.
  """
  cfg = target.config
  if not 1 <= num_layers <= cfg.num_layers:
    raise InputError(f"num_layers={num_layers} must be in [1, {cfg.num_layers}]")
  from flax import nnx
  from specjax.model import Decoder

  dcfg = dataclasses.replace(cfg, num_layers=num_layers)
  abstract = nnx.eval_shape(lambda: Decoder(dcfg, dtype=target.dtype, rngs=nnx.Rngs(0)))
  graphdef, abs_state = nnx.split(abstract)
  src = {path_key(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(target.params)}
  shared = tuple(k for k in (("embed",), ("lm_head",), ("pos_embed",)) if k in src)

  def fill(path, leaf):
    key = path_key(path)
    if own is not None and key not in shared:
      arr = own[_flat_name(key)]
      if tuple(arr.shape) != tuple(leaf.shape):
        raise InputError(f"draft tensor {_flat_name(key)} has shape {arr.shape}, expected {leaf.shape}")
      return jnp.asarray(arr, target.dtype)
    return src[key] if key in shared else jnp.array(src[key])  # copies: training must not alias
  params = jax.tree_util.tree_map_with_path(fill, abs_state)
  m = Model(dcfg, graphdef, params, target.tokenizer, name=name, dtype=target.dtype, shared=shared)
  m.vocab_subset = None if vocab is None else np.asarray(vocab, np.int32)
  return m


def _subset_head(draft: Model, params, vocab) -> jax.Array:
  head = params["embed"][...] if draft.config.tie_word_embeddings else params["lm_head"][...].T
  return head[vocab]  # [Vs,E]


def draft_loss(draft: Model, own: dict, vocab, tokens, labels):
  """Mean cross-entropy of the draft's subset logits against the target's labels.

  tokens [B,T] int32; labels [B,T] int32: the target's token after position t (-1 = none).
  Labels outside the subset are skipped.
  """
  b, t = tokens.shape
  params = with_params(draft, own)
  cfg = draft.config
  cache = kv.init(cfg.num_layers, b, t, cfg.num_kv_heads, cfg.head_dim, draft.dtype)
  mask = kv.causal_mask(cache.lengths, t, t, cfg.sliding_window)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  _, hidden, _ = draft.apply(params, tokens, pos, cache, mask, logits_at=jnp.zeros((b, 1), jnp.int32))
  logits = (hidden @ _subset_head(draft, params, vocab).T).astype(jnp.float32)  # [B,T,Vs]
  # Position of each label in the subset (vocab is sorted).
  idx = jnp.clip(jnp.searchsorted(vocab, labels), 0, vocab.shape[0] - 1)
  has = labels >= 0
  m = has & (vocab[idx] == labels)
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, idx[..., None], axis=-1)[..., 0]
  hit = jnp.argmax(logits, axis=-1) == idx
  denom = jnp.maximum(jnp.sum(m), 1)
  return jnp.sum(nll * m) / denom, {"top1": jnp.sum(hit & m) / denom,
                                    "coverage": jnp.sum(m) / jnp.maximum(jnp.sum(has), 1)}


def _batches(data: dict, batch_size: int, seq_len: int, seed: int):
  """An endless stream of (tokens [B,T], labels [B,T]) windows, each ending at a row's last label."""
  rng = np.random.default_rng(seed)
  toks, labels = data["tokens"], data["labels"]
  has = labels >= 0
  ends = np.where(has.any(1), toks.shape[1] - np.argmax(has[:, ::-1], axis=1), 0)
  rows_ok = np.flatnonzero(ends > 0)
  while True:
    rows = rng.choice(rows_ok, batch_size)
    out = np.zeros((batch_size, seq_len), np.int32)
    lab = np.full((batch_size, seq_len), -1, np.int32)
    for j, r in enumerate(rows):
      end = int(ends[r])
      start = max(0, end - seq_len)
      out[j, :end - start] = toks[r, start:end]
      lab[j, :end - start] = labels[r, start:end]
    yield out, lab


def _concat(parts: list[dict]) -> dict:
  t = max(p["tokens"].shape[1] for p in parts)
  pad = lambda a, v: np.pad(a, ((0, 0), (0, t - a.shape[1])), constant_values=v)
  return {"tokens": np.concatenate([pad(p["tokens"], 0) for p in parts]),
          "labels": np.concatenate([pad(p["labels"], -1) for p in parts])}


# ----------------------------------------------------------------------------- asset I/O


def export_draft(draft: Model, path: str, *, target_name: str, meta: dict | None = None) -> str:
  """Writes the draft's own tensors (float16), its subset ids and a header to one .npz."""
  own = {k: np.asarray(v, np.float16) for k, v in own_params(draft).items()}
  header = {"target": target_name, "num_layers": draft.config.num_layers, "format": 1,
            "shared": ["_".join(k) for k in draft.shared], **(meta or {})}
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  vocab = draft.vocab_subset if draft.vocab_subset is not None else np.zeros((0,), np.int32)
  np.savez(path, __header__=np.frombuffer(json.dumps(header).encode(), np.uint8),
           __vocab__=np.asarray(vocab, np.int32), **own)
  return path


def read_draft_header(path: str) -> dict:
  with np.load(path) as z:
    return json.loads(bytes(z["__header__"]).decode())


def load_draft_asset(path: str, target: Model, name: str = "") -> Model:
  """Rebuilds a draft exported by `export_draft` around `target`'s shared tensors."""
  from specjax.errors import WeightsError

  if not os.path.isfile(path):
    raise WeightsError(f"{path}: draft asset missing")
  with np.load(path) as z:
    header = json.loads(bytes(z["__header__"]).decode())
    vocab = z["__vocab__"]
    own = {k: z[k].astype(np.float32) for k in z.files if not k.startswith("__")}
  try:
    draft = draft_from_target(target, header["num_layers"], vocab if vocab.size else None, own=own,
                              name=name or os.path.basename(path))
  except (KeyError, InputError) as e:
    raise WeightsError(f"{path}: draft asset does not fit target {target.name!r} ({e})") from e
  draft.asset_header = header
  return draft


# ----------------------------------------------------------------------------- training


def train_draft(target: str | Model = "smollm2-135m", *, out_dir: str = "runs/draft",
                export: str | None = None, num_layers: int = 2, vocab_size: int = 8192,
                prompts_dir: str = PROMPTS_DIR, num_prompts: int = 400, max_new_tokens: int = 128,
                gen_batch_size: int = 16, gen_minutes: float = 12.0, teacher_minutes: float = 5.0,
                steps: int = 2000,
                batch_size: int = 8, seq_len: int = 256, lr: float = 1e-3,
                max_minutes: float = 20.0, ckpt_every: int = 50, seed: int = 0,
                log=print) -> Model:
  """Distils a `num_layers`-layer draft from `target`; resumable (rerun the same command).

  out_dir holds data.npz (the target's generations) and orbax checkpoints; training stops at
  `steps` or after `max_minutes` of training (saving a checkpoint either way, and on Ctrl-C).
  export: path of the .npz asset to write at the end (default: none). Returns the draft Model.
  """
  import optax
  import orbax.checkpoint as ocp

  from specjax.weights import load_model

  for arg, v, lo in (("num_layers", num_layers, 1), ("vocab_size", vocab_size, 2), ("steps", steps, 1),
                     ("batch_size", batch_size, 1), ("seq_len", seq_len, 2),
                     ("ckpt_every", ckpt_every, 1), ("max_new_tokens", max_new_tokens, 1)):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
      raise InputError(f"{arg}={v!r} is invalid: must be an integer >= {lo}")
  target_name = target if isinstance(target, str) else target.name
  target = load_model(target) if isinstance(target, str) else target
  if vocab_size > target.config.vocab_size:
    raise InputError(f"vocab_size={vocab_size} exceeds the target's vocabulary "
                     f"({target.config.vocab_size})")
  out_dir = os.path.abspath(out_dir)
  os.makedirs(out_dir, exist_ok=True)

  data_path = os.path.join(out_dir, "data.npz")
  if os.path.isfile(data_path):
    data = dict(np.load(data_path))
    log(f"data: reusing {data_path} ({len(data['tokens'])} sequences)")
  else:
    parts = []
    if gen_minutes > 0:
      prompts = training_prompts(prompts_dir, limit=num_prompts, seed=seed)
      parts.append(generate_data(target, prompts, max_new_tokens=max_new_tokens,
                                 batch_size=gen_batch_size, max_minutes=gen_minutes, log=log))
    if teacher_minutes > 0:
      parts.append(teacher_data(target, training_texts(prompts_dir), seq_len=seq_len,
                                batch_size=batch_size, max_minutes=teacher_minutes, seed=seed, log=log))
    data = _concat(parts)
    np.savez(data_path + ".tmp.npz", **data)
    os.replace(data_path + ".tmp.npz", data_path)
  log(f"data: {int(np.sum(data['labels'] >= 0))} labelled positions")
  vocab = vocab_subset(data, target.config.vocab_size, vocab_size)
  draft = draft_from_target(target, num_layers, vocab, name=f"{target_name}-draft")
  own = own_params(draft)
  vocab_j = jnp.asarray(vocab)

  warmup = min(100, max(1, steps // 10))
  sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), lr * 0.05)
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.0))
  opt_state = opt.init(own)

  mgr = ocp.CheckpointManager(os.path.join(out_dir, "ckpt"),
                              options=ocp.CheckpointManagerOptions(max_to_keep=2))
  step = 0
  if mgr.latest_step() is not None:
    step = int(mgr.latest_step())
    abstract = {"own": own, "opt": opt_state, "step": np.zeros((), np.int32)}
    restored = mgr.restore(step, args=ocp.args.StandardRestore(abstract))
    own, opt_state = restored["own"], restored["opt"]
    log(f"train: resumed from checkpoint at step {step}")

  @jax.jit
  def update(own, opt_state, tokens, labels):
    (loss, aux), grads = jax.value_and_grad(
        lambda o: draft_loss(draft, o, vocab_j, tokens, labels), has_aux=True)(own)
    updates, opt_state = opt.update(grads, opt_state, own)
    return optax.apply_updates(own, updates), opt_state, loss, aux

  def save(s):
    mgr.save(s, args=ocp.args.StandardSave({"own": own, "opt": opt_state, "step": np.asarray(s, np.int32)}),
             force=True)
    mgr.wait_until_finished()

  stream = _batches(data, batch_size, seq_len, seed + step)  # a resumed run sees fresh windows
  t0 = time.time()
  last_saved = step
  try:
    while step < steps and time.time() - t0 < 60 * max_minutes:
      tokens, labels = next(stream)
      own, opt_state, loss, aux = update(own, opt_state, jnp.asarray(tokens), jnp.asarray(labels))
      step += 1
      if step % 10 == 0 or step == 1:
        log(f"train: step {step} loss {float(loss):.3f} top1 {float(aux['top1']):.3f} "
            f"coverage {float(aux['coverage']):.3f} ({time.time() - t0:.0f}s)")
      if step % ckpt_every == 0:
        save(step)
        last_saved = step
  finally:
    if step != last_saved:
      save(step)  # also on KeyboardInterrupt: rerunning resumes here
  log(f"train: stopped at step {step}")
  draft = draft_from_target(target, num_layers, vocab, own={k: np.asarray(v) for k, v in own.items()},
                            name=f"{target_name}-draft")
  draft.train_step = step
  if export:
    export_draft(draft, export, target_name=target_name,
                 meta={"steps": step, "vocab_size": int(len(vocab)), "max_new_tokens": max_new_tokens,
                       "labels": int(np.sum(data["labels"] >= 0)), "lr": lr, "batch_size": batch_size,
                       "seq_len": seq_len})
    log(f"export: wrote {export} ({os.path.getsize(export) / 2**20:.1f} MiB)")
  return draft
