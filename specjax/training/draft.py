"""Distilling a small draft model from its target (optax, orbax checkpoints, resumable).

    specjax train draft   ->   train_draft(...)

1. Data, labelled by the target by teacher forcing (one forward per batch of windows, far cheaper
   per label than generating, which matters on a 2-core CPU), from three sources:
   - the target's own continuations of training prompts (greedy and temperature 0.7, batched
     through `sj.generate`; saved to `generated.npz`), the in-distribution part;
   - prompt / answer / code text from ../shared/data/prompts (disjoint from the benchmark's
     held-out first prompts);
   - Python standard-library source (`code_texts`), code text that exists on every machine.
   All of it is packed into windows; each position gets the target's argmax and its top-k
   log-probabilities (soft labels). Labelling checkpoints to `teacher.partial.npz` and resumes;
   the result is `data.npz`. A few % of the windows are held out to report top-1 agreement.
2. Vocabulary subset (FR-Spec): the Vs tokens the target emits most often in that data, topped up
   with the lowest token ids (BPE merge order ~ frequency). The draft proposes only over these, so
   its LM head costs Vs/V of the target's; lossless, since verification uses the full p.
3. Draft: the target's first `num_layers` layers and final norm as the starting point, sharing the
   target's embeddings and LM head rows (frozen, not stored). Only the layers and final norm train.
4. Training: soft cross-entropy of the draft's subset logits against the target's top-k
   distribution restricted to the subset (positions whose argmax is outside it are skipped),
   AdamW with warmup + cosine decay, orbax checkpoints every `ckpt_every` steps and on
   interruption; rerunning the same command resumes from the latest.
5. Export: only the draft's own tensors (float16) + the subset ids + a small JSON header, to
   `specjax/assets/<name>.npz`; `load_draft_asset` rebuilds the Model with the target's tensors.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import cache as kv
from specjax import prompts
from specjax.errors import InputError
from specjax.model import Model, head_rows
from specjax.registry import (draft_from_target, export_draft, load_draft_asset,  # noqa: F401
                              own_params, read_draft_header, with_params)

_FILES = {"mt_bench": "mt_bench.jsonl", "spec_bench": "spec_bench.jsonl",
          "gsm8k": "gsm8k_test.jsonl", "humaneval": "humaneval.jsonl.gz"}


# ----------------------------------------------------------------------------- prompts


def _records(prompts_dir: str | None) -> dict[str, list[dict]]:
  """The prompt files' rows by set (empty where a file is absent). prompts_dir None: the shared
  folder `specjax.prompts.prompts_dir()` finds ($SPECJAX_PROMPTS or ../shared/data/prompts)."""
  d = prompts_dir if prompts_dir is not None else prompts.prompts_dir()
  paths = {k: os.path.join(d, f) for k, f in _FILES.items()} if d else {}
  return {k: prompts.read_jsonl(paths[k]) if k in paths and os.path.isfile(paths[k]) else []
          for k in _FILES}


def _shuffled_prompts(rec: dict, held_out: int, max_chars: int, limit: int,
                      seed: int) -> list[tuple[str, bool]]:
  out = [(r["turns"][0], True) for r in rec["mt_bench"][held_out:]]
  out += [(r["turns"][0], True) for r in rec["spec_bench"][80:]]  # the first 80 rows are MT-Bench
  out += [(r["question"], True) for r in rec["gsm8k"][:150]]
  out += [(r["prompt"], False) for r in rec["humaneval"][held_out:]]
  out = [(p, c) for p, c in out if len(p) <= max_chars]
  if not out:
    out = [(p, True) for p in prompts.FALLBACK[:8]]
  rng = np.random.default_rng(seed)
  rng.shuffle(out)
  return out[:limit]


def training_prompts(prompts_dir: str | None = None, *, held_out: int = 20, max_chars: int = 800,
                     limit: int = 400, seed: int = 0) -> list[tuple[str, bool]]:
  """(prompt, chat) pairs for distillation, disjoint from the benchmark's first `held_out`
  MT-Bench and HumanEval prompts. Falls back to a built-in list when the files are absent."""
  return _shuffled_prompts(_records(prompts_dir), held_out, max_chars, limit, seed)


# ----------------------------------------------------------------------------- data


def generate_data(target: Model, prompts: list[tuple[str, bool]], *, max_new_tokens: int = 128,
                  batch_size: int = 16, max_minutes: float = 10.0, log=print) -> list[list[int]]:
  """The target's own continuations of `prompts`, as token-id lists (prompt + continuation).

  Alternate batches are greedy and temperature 0.7; stops early after max_minutes. The sequences
  are then labelled by teacher forcing like any other text (`teacher_data`).
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
  return seqs


def training_texts(prompts_dir: str | None = None, *, held_out: int = 20) -> list[tuple[str, bool]]:
  """(text, chat) pairs for teacher forcing: questions (chat template) and answers / code (raw),
  disjoint from the benchmark's first `held_out` MT-Bench and HumanEval prompts."""
  rec = _records(prompts_dir)
  out = _shuffled_prompts(rec, held_out, max_chars=20000, limit=10 ** 6, seed=0)
  out += [(r["question"] + "\n" + r["answer"], False) for r in rec["gsm8k"][150:]]
  out += [(r["prompt"] + r["canonical_solution"], False) for r in rec["humaneval"][held_out:]]
  return out


def code_texts(budget_chars: int = 2_000_000, *, seed: int = 0) -> list[tuple[str, bool]]:
  """Python source from this interpreter's standard library (tests and vendored code excluded),
  as raw text up to `budget_chars`: code-domain text that exists on every machine."""
  import glob
  import sysconfig

  root = sysconfig.get_paths()["stdlib"]
  files = sorted(f for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                 if not any(part in f for part in ("/test", "/idle_test", "site-packages", "/_vendor")))
  np.random.default_rng(seed).shuffle(files)
  out, used = [], 0
  for f in files:
    if used >= budget_chars:
      break
    try:
      with open(f, encoding="utf-8") as fh:
        text = fh.read(min(40_000, budget_chars - used))
    except (OSError, UnicodeDecodeError):
      continue
    if text.strip():
      out.append((text, False))
      used += len(text)
  return out


def teacher_data(target: Model, texts: list, *, seq_len: int = 256, batch_size: int = 8,
                 max_minutes: float = 5.0, seed: int = 0, top_k: int = 8, partial: str | None = None,
                 log=print) -> dict:
  """Texts packed into [N, seq_len] windows, labelled by the target at every position.

  texts: (text, chat) pairs, or token-id lists (e.g. the target's own generations).
  Returns tokens [N,T], labels [N,T] (the target's argmax next token), topk_ids [N,T,k] and
  topk_logp [N,T,k] (float16: the target's k most likely next tokens and their log-probabilities,
  the soft labels). `partial`: an .npz path the labelled batches are saved to every ~minute; a
  rerun with the same texts and seed continues from it.
  """
  stream: list[int] = []
  eos = target.config.eos_token_ids[0] if target.config.eos_token_ids else None
  for item in texts:
    if not (item[0].strip() if isinstance(item, tuple) else len(item)):
      continue  # nothing to label (e.g. an empty __init__.py)
    ids = _encode(target, *item) if isinstance(item, tuple) else list(item)
    stream += ids + ([int(eos)] if eos is not None else [])
  n = len(stream) // seq_len
  windows = np.asarray(stream[:n * seq_len], np.int32).reshape(n, seq_len)
  np.random.default_rng(seed).shuffle(windows)
  cfg = target.config

  @jax.jit
  def label(params, toks):  # [B,T] -> argmax [B,T], top-k ids and log-probs [B,T,k]
    b, t = toks.shape
    cache = kv.init(cfg.num_layers, b, t, cfg.num_kv_heads, cfg.head_dim, target.dtype)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, _, _ = target.apply(params, toks, pos, cache, kv.causal_mask(cache.lengths, t, t))
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    # Top-k by k rounds of argmax: XLA's CPU top_k sorts each 49k-wide row on one thread, which
    # cost ~8x the whole forward here; k argmax passes are parallel and cheap.
    ids, vals = [], []
    for _ in range(top_k):
      i = jnp.argmax(logits, axis=-1)
      vals.append(jnp.take_along_axis(logits, i[..., None], axis=-1)[..., 0])
      ids.append(i)
      logits = jnp.where(jnp.arange(logits.shape[-1]) == i[..., None], -jnp.inf, logits)
    ids = jnp.stack(ids, -1).astype(jnp.int32)
    top = jnp.stack(vals, -1) - lse
    return ids[..., 0], ids, top.astype(jnp.float16)

  parts = {"tokens": [], "labels": [], "topk_ids": [], "topk_logp": []}
  done = 0
  if partial and os.path.isfile(partial):
    with np.load(partial) as z:
      if z["tokens"].shape[1:] == (seq_len,) and z["topk_ids"].shape[-1] == top_k:
        for k in parts:
          parts[k].append(z[k])
        done = len(z["tokens"])
        log(f"teacher: resuming after {done} labelled windows from {partial}")

  def save():
    if partial and parts["tokens"]:
      tmp = partial + ".tmp.npz"
      np.savez(tmp, **{k: np.concatenate(v) for k, v in parts.items()})
      os.replace(tmp, partial)

  t0 = last = time.time()
  for i in range(done, n - batch_size + 1, batch_size):
    if time.time() - t0 > 60 * max_minutes:
      log(f"teacher: time limit ({max_minutes} min)")
      break
    x = windows[i:i + batch_size]
    lab, ids, logp = label(target.params, jnp.asarray(x))
    for k, v in zip(parts, (x, lab, ids, logp)):
      parts[k].append(np.asarray(v))
    if time.time() - last > 60:
      save()
      last = time.time()
    log(f"teacher: {i + batch_size}/{n} windows ({time.time() - t0:.0f}s)")
  save()
  if not parts["tokens"]:
    raise InputError(f"teacher_data: no windows labelled ({len(stream)} tokens of text for "
                     f"windows of {seq_len} x batches of {batch_size})")
  return {k: np.concatenate(v) for k, v in parts.items()}


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


def draft_loss(draft: Model, own: dict, vocab, tokens, labels, topk_ids=None, topk_logp=None):
  """Cross-entropy of the draft's subset logits against the target's labels.

  tokens [B,T] int32; labels [B,T] int32: the target's argmax after position t (-1 = none).
  topk_ids / topk_logp [B,T,k]: the target's k most likely next tokens and log-probabilities; when
  given, the loss is the soft cross-entropy against the target's distribution restricted to those
  k tokens inside the subset (renormalised), else the hard cross-entropy against `labels`.
  Positions whose labels fall outside the subset are skipped.
  """
  b, t = tokens.shape
  params = with_params(draft, own)
  cfg = draft.config
  cache = kv.init(cfg.num_layers, b, t, cfg.num_kv_heads, cfg.head_dim, draft.dtype)
  mask = kv.causal_mask(cache.lengths, t, t, cfg.sliding_window)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  _, hidden, _ = draft.apply(params, tokens, pos, cache, mask, logits_at=jnp.zeros((b, 1), jnp.int32))
  logits = (hidden @ head_rows(cfg, params, vocab).T).astype(jnp.float32)  # [B,T,Vs]
  logp = jax.nn.log_softmax(logits, axis=-1)

  def in_subset(ids):  # position of each id in the (sorted) subset, and whether it is there
    idx = jnp.clip(jnp.searchsorted(vocab, ids), 0, vocab.shape[0] - 1)
    return idx, (ids >= 0) & (vocab[idx] == ids)

  idx, m = in_subset(labels)
  has = labels >= 0
  if topk_ids is None:
    nll = -jnp.take_along_axis(logp, idx[..., None], axis=-1)[..., 0]
  else:
    kidx, km = in_subset(topk_ids)
    w = jnp.where(km & has[..., None], jnp.exp(topk_logp.astype(jnp.float32)), 0.0)
    w = w / jnp.maximum(jnp.sum(w, -1, keepdims=True), 1e-9)
    nll = -jnp.sum(w * jnp.take_along_axis(logp, kidx, axis=-1), axis=-1)
  hit = jnp.argmax(logits, axis=-1) == idx
  denom = jnp.maximum(jnp.sum(m), 1)
  return jnp.sum(nll * m) / denom, {"top1": jnp.sum(hit & m) / denom,
                                    "coverage": jnp.sum(m) / jnp.maximum(jnp.sum(has), 1)}


def _with_topk(data: dict) -> dict:
  """Hard-label data (tokens, labels only) as one-hot soft labels, so both kinds train alike."""
  if "topk_ids" in data:
    return data
  return dict(data, topk_ids=data["labels"][..., None].astype(np.int32),
              topk_logp=np.zeros(data["labels"].shape + (1,), np.float16))


def _windows(data: dict, rows, seq_len: int):
  """(tokens, labels, topk_ids, topk_logp) windows of `rows`, each ending at the row's last label."""
  toks, labels = data["tokens"], data["labels"]
  k = data["topk_ids"].shape[-1]
  out = np.zeros((len(rows), seq_len), np.int32)
  lab = np.full((len(rows), seq_len), -1, np.int32)
  tid = np.full((len(rows), seq_len, k), -1, np.int32)
  tlp = np.zeros((len(rows), seq_len, k), np.float16)
  for j, r in enumerate(rows):
    has = labels[r] >= 0
    end = toks.shape[1] - int(np.argmax(has[::-1]))
    start = max(0, end - seq_len)
    out[j, :end - start] = toks[r, start:end]
    lab[j, :end - start] = labels[r, start:end]
    tid[j, :end - start] = data["topk_ids"][r, start:end]
    tlp[j, :end - start] = data["topk_logp"][r, start:end]
  return out, lab, tid, tlp


def _batches(data: dict, rows: np.ndarray, batch_size: int, seq_len: int, seed: int):
  """An endless stream of training windows from `rows`, reshuffled every epoch."""
  rng = np.random.default_rng(seed)
  while True:
    order = rng.permutation(rows)
    for i in range(0, len(order) - batch_size + 1, batch_size):
      yield _windows(data, order[i:i + batch_size], seq_len)
    if len(order) < batch_size:
      yield _windows(data, rng.choice(rows, batch_size), seq_len)


def split_rows(data: dict, held_out: float = 0.03) -> tuple[np.ndarray, np.ndarray]:
  """(train rows, held-out rows): the last `held_out` of the (already shuffled) labelled rows."""
  rows = np.flatnonzero((data["labels"] >= 0).any(1))
  n_val = int(len(rows) * held_out) if len(rows) >= 20 else 0
  return rows[:len(rows) - n_val], rows[len(rows) - n_val:]


# ----------------------------------------------------------------------------- training


def train_draft(target: str | Model = "smollm2-135m", *, out_dir: str = "runs/draft",
                export: str | None = None, num_layers: int = 2, vocab_size: int = 8192,
                prompts_dir: str | None = None, num_prompts: int = 400, max_new_tokens: int = 128,
                gen_batch_size: int = 16, gen_minutes: float = 12.0, teacher_minutes: float = 5.0,
                code_chars: int = 2_000_000, top_k: int = 8, steps: int = 2000,
                batch_size: int = 8, seq_len: int = 256, lr: float = 1e-3,
                max_minutes: float = 20.0, ckpt_every: int = 50, eval_every: int = 100,
                seed: int = 0, log=print) -> Model:
  """Distils a `num_layers`-layer draft from `target`; resumable (rerun the same command).

  out_dir holds generated.npz (the target's continuations), teacher.partial.npz / data.npz (the
  labelled windows) and orbax checkpoints; each stage resumes from what is there. Training stops
  at `steps` or after `max_minutes` (saving a checkpoint either way, and on Ctrl-C), reporting the
  top-1 agreement with the target on held-out windows every `eval_every` steps.
  export: path of the .npz asset to write at the end (default: none). Returns the draft Model.
  """
  import optax
  import orbax.checkpoint as ocp

  from specjax.weights import load_model

  for arg, v, lo in (("num_layers", num_layers, 1), ("vocab_size", vocab_size, 2), ("steps", steps, 1),
                     ("batch_size", batch_size, 1), ("seq_len", seq_len, 2), ("top_k", top_k, 1),
                     ("ckpt_every", ckpt_every, 1), ("eval_every", eval_every, 1),
                     ("max_new_tokens", max_new_tokens, 1), ("code_chars", code_chars, 0)):
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
    gen_path = os.path.join(out_dir, "generated.npz")
    seqs: list = []
    if os.path.isfile(gen_path):
      with np.load(gen_path) as z:
        seqs = np.split(z["tokens"], z["offsets"][1:-1])
      log(f"data: reusing {len(seqs)} generated sequences from {gen_path}")
    elif gen_minutes > 0:
      prompts = training_prompts(prompts_dir, limit=num_prompts, seed=seed)
      seqs = generate_data(target, prompts, max_new_tokens=max_new_tokens,
                           batch_size=gen_batch_size, max_minutes=gen_minutes, log=log)
      if seqs:
        np.savez(gen_path, tokens=np.concatenate(seqs).astype(np.int32),
                 offsets=np.cumsum([0] + [len(s) for s in seqs]))
    texts = [list(map(int, s)) for s in seqs] + training_texts(prompts_dir)
    if code_chars:
      texts += code_texts(code_chars, seed=seed)
    data = teacher_data(target, texts, seq_len=seq_len, batch_size=batch_size, top_k=top_k,
                        max_minutes=teacher_minutes, seed=seed,
                        partial=os.path.join(out_dir, "teacher.partial.npz"), log=log)
    np.savez(data_path + ".tmp.npz", **data)
    os.replace(data_path + ".tmp.npz", data_path)
  data = _with_topk(data)
  log(f"data: {int(np.sum(data['labels'] >= 0))} labelled positions")
  train_rows, val_rows = split_rows(data)
  vocab = vocab_subset({"labels": data["labels"][train_rows]}, target.config.vocab_size, vocab_size)
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

  def loss_fn(o, batch):
    return draft_loss(draft, o, vocab_j, *batch)

  @jax.jit
  def update(own, opt_state, batch):
    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(own, batch)
    updates, opt_state = opt.update(grads, opt_state, own)
    return optax.apply_updates(own, updates), opt_state, loss, aux

  evaluate = jax.jit(loss_fn)

  def held_out_top1():
    """Top-1 agreement with the target's argmax (within the subset) on the held-out windows."""
    hits = total = 0.0
    for i in range(0, len(val_rows), batch_size):
      rows = val_rows[i:i + batch_size]
      real = len(rows)
      rows = np.concatenate([rows, np.repeat(rows[-1:], batch_size - real)])  # one shape
      batch = _windows(data, rows, seq_len)
      batch[1][real:] = -1  # padding rows carry no labels, so they count nowhere
      _, aux = evaluate(own, tuple(map(jnp.asarray, batch)))
      n = float(aux["coverage"]) * int(np.sum(batch[1] >= 0))  # labels inside the subset
      hits += float(aux["top1"]) * n
      total += n
    return hits / max(total, 1)

  def save(s):
    mgr.save(s, args=ocp.args.StandardSave({"own": own, "opt": opt_state, "step": np.asarray(s, np.int32)}),
             force=True)
    mgr.wait_until_finished()

  stream = _batches(data, train_rows, batch_size, seq_len, seed + step)  # a resumed run: fresh order
  t0 = time.time()
  last_saved = step
  val = None
  try:
    while step < steps and time.time() - t0 < 60 * max_minutes:
      batch = tuple(map(jnp.asarray, next(stream)))
      own, opt_state, loss, aux = update(own, opt_state, batch)
      step += 1
      if step % 10 == 0 or step == 1:
        log(f"train: step {step} loss {float(loss):.3f} top1 {float(aux['top1']):.3f} "
            f"coverage {float(aux['coverage']):.3f} ({time.time() - t0:.0f}s)")
      if len(val_rows) and step % eval_every == 0:
        val = held_out_top1()
        log(f"train: step {step} held-out top1 {val:.3f} ({len(val_rows)} windows)")
      if step % ckpt_every == 0:
        save(step)
        last_saved = step
  finally:
    if step != last_saved:
      save(step)  # also on KeyboardInterrupt: rerunning resumes here
  if len(val_rows):
    val = held_out_top1()
    log(f"train: held-out top1 {val:.3f} at step {step}")
  log(f"train: stopped at step {step}")
  draft = draft_from_target(target, num_layers, vocab, own={k: np.asarray(v) for k, v in own.items()},
                            name=f"{target_name}-draft")
  draft.train_step = step
  draft.held_out_top1 = val
  if export:
    export_draft(draft, export, target_name=target_name,
                 meta={"steps": step, "vocab_size": int(len(vocab)), "max_new_tokens": max_new_tokens,
                       "labels": int(np.sum(data["labels"] >= 0)), "lr": lr, "batch_size": batch_size,
                       "seq_len": seq_len, "top_k": int(data["topk_ids"].shape[-1]),
                       "held_out_top1": val})
    log(f"export: wrote {export} ({os.path.getsize(export) / 2**20:.1f} MiB)")
  return draft
