"""Distilling a small draft model from its target's own responses, on the shared trainer.

    specjax train draft --corpus DIR   ->   train_draft(target, corpus, ...)

1. Data: the self-distillation corpus (training/corpus.py): the target's own chat responses. Its
   windows are split per sequence into training and held-out windows. The response tokens ARE the
   target's outputs, so hard next-token labels come straight from the corpus (greedy responses:
   the target's argmax; sampled ones: samples of its distribution, whose cross-entropy has the
   same minimiser); prompt positions carry no label. Optional soft labels (`soft_top_k`): the
   target's top-k next-token distribution, computed per batch inside the update step (one target
   forward per step, never stored).
2. Vocabulary subset (FR-Spec): the Vs tokens that follow most often in the training windows,
   topped up with the lowest token ids (BPE merge order ~ frequency). The draft proposes only over
   these, so its LM head costs Vs/V of the target's; lossless, since verification uses the full p.
3. Draft: the target's first `num_layers` layers and final norm as the starting point, sharing the
   target's embeddings and LM head rows (frozen, not stored). Only the layers and final norm train.
4. Training: `trainer.train` (AdamW, warmup + cosine, clipping, orbax checkpoints, exact resume).
   Held-out metrics: top1 = agreement of the draft's argmax with the target's greedy next token
   (the quantity greedy acceptance depends on; the target's argmax over the held-out windows is
   computed once at the start), top1_corpus = agreement with the corpus token.
5. Export: `shipped.export_draft`, the format `sj.load_model("<name>-draft")` reads.

`teacher_features` gives other drafter trainers (Medusa, EAGLE) the target's final hidden states
and logits / top-k for corpus windows, a batch at a time.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from specjax import validate
from specjax.errors import InputError, check_int
from specjax.model import Model, forward_sequence, head_rows, subset_index
from specjax.shipped import (draft_from_target, export_draft, load_draft_asset,  # noqa: F401
                             own_params, read_draft_header, with_params)
from specjax.training import folders, trainer

# ----------------------------------------------------------------------------- teacher


def teacher_outputs(target: Model, params, tokens):
  """The target's full-sequence forward (traceable): tokens [B,T] int32 -> (logits [B,T,V]
  float32, hidden [B,T,E]: final-normed, the features the LM head reads)."""
  logits, hidden, _ = forward_sequence(target.config, target.module(params), tokens,
                                       dtype=target.dtype)
  return logits.astype(jnp.float32), hidden


def top_k(logits, k: int, *, passes: bool = False):
  """logits [...,V] -> (ids [...,k] int32, log-probabilities [...,k] float32), most likely first
  (the lower index first on ties).

  lax.top_k by default: alone, XLA's CPU runtime selects without sorting the row, which is fast.
  passes=True: k rounds of a max and a min reduction (sampling.argmax), for use inside a training
  step, where lax.top_k over [8,256,49152] made a soft-label draft step very slow on this CPU
  (measured: docs/performance.md)."""
  if not passes:
    vals, ids = jax.lax.top_k(logits, k)
    return ids.astype(jnp.int32), vals - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
  from specjax.sampling import argmax

  lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
  n = logits.shape[-1]
  ids, vals = [], []
  x = logits
  for _ in range(k):
    i = argmax(x)
    ids.append(i)
    vals.append(jnp.take_along_axis(x, i[..., None], axis=-1)[..., 0])
    x = jnp.where(jnp.arange(n, dtype=jnp.int32) == i[..., None], -jnp.inf, x)
  return jnp.stack(ids, -1), jnp.stack(vals, -1) - lse


@functools.partial(jax.jit, static_argnums=(0, 3))
def _features(target, params, tokens, k):
  logits, hidden = teacher_outputs(target, params, tokens)
  return hidden.astype(jnp.float32), (logits if k is None else top_k(logits, k))


def teacher_features(target: Model, tokens, *, top_k: int | None = None, batch_size: int = 8):
  """The target's features for windows, computed `batch_size` rows at a time (one compile).

  tokens [B,T] int32 (e.g. corpus windows). Returns (hidden [B,T,E] float32: the final-normed
  hidden states, the features EAGLE heads read; and logits [B,T,V] float32, or with top_k=k the
  pair (ids [B,T,k] int32, log-probabilities [B,T,k] float32)). A short last batch is padded to
  batch_size, so every call with the same T reuses one compiled forward.
  """
  tokens = np.asarray(tokens)
  if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer) or 0 in tokens.shape:
    raise InputError(f"tokens must be a non-empty integer array [B,T], got {tokens.dtype} {tokens.shape}")
  if (tokens.min() < 0 or tokens.max() >= target.config.vocab_size):
    raise InputError(f"tokens must be ids in [0, {target.config.vocab_size}), got "
                     f"[{tokens.min()}, {tokens.max()}]")
  check_int("batch_size", batch_size, 1)
  if top_k is not None:
    check_int("top_k", top_k, 1, target.config.vocab_size)
  hs, outs = [], []
  for i in range(0, len(tokens), batch_size):
    x = tokens[i:i + batch_size]
    n = len(x)
    x = np.concatenate([x, np.zeros((batch_size - n,) + x.shape[1:], x.dtype)]) if n < batch_size else x
    h, o = _features(target, target.params, jnp.asarray(x, jnp.int32), top_k)
    hs.append(np.asarray(h)[:n])
    outs.append(jax.tree_util.tree_map(lambda a: np.asarray(a)[:n], o))
  return np.concatenate(hs), jax.tree_util.tree_map(lambda *a: np.concatenate(a), *outs)


# ----------------------------------------------------------------------------- data


def next_token_labels(tok: np.ndarray, mask: np.ndarray) -> np.ndarray:
  """[Nw,T] int32: the next token tok[:, t+1] where mask[:, t] says it is a response token, else
  -1. The last position has no next token inside its window (the corpus's next window, which
  starts one token earlier, covers that transition)."""
  labels = np.full(tok.shape, -1, np.int32)
  labels[:, :-1] = np.where(mask[:, :-1], tok[:, 1:], -1)
  return labels


def vocab_subset(counts: np.ndarray, size: int) -> np.ndarray:
  """[Vs] int32, sorted: the `size` most frequent ids of counts [V], topped up with the lowest ids."""
  counts = np.asarray(counts)
  seen = np.flatnonzero(counts)
  seen = seen[np.argsort(-counts[seen], kind="stable")][:size]
  rest = np.setdiff1d(np.arange(len(counts)), seen)[:size - len(seen)]
  return np.sort(np.concatenate([seen, rest])).astype(np.int32)


# ----------------------------------------------------------------------------- loss


def draft_loss(draft: Model, own: dict, vocab, tokens, labels, topk_ids=None, topk_logp=None,
               params=None):
  """Cross-entropy of the draft's subset logits against the target's next tokens.

  tokens [B,T] int32; labels [B,T] int32: the next token to predict after position t (-1: none).
  topk_ids / topk_logp [B,T,k]: the target's k most likely next tokens and log-probabilities; when
  given, the loss is the soft cross-entropy against the target's distribution restricted to those
  k tokens inside the subset (renormalised), else the hard cross-entropy against `labels`.
  Positions whose label falls outside the subset are skipped. params: the draft's full param
  State to put `own` into (default draft.params; pass it as a jit argument to avoid baking the
  shared embeddings into the program as constants).
  Returns (loss, {"top1": argmax == label, "coverage": labels inside the subset, "count"}).
  """
  params = with_params(draft, own, params)
  cfg = draft.config
  _, hidden, _ = forward_sequence(cfg, draft.module(params), tokens, dtype=draft.dtype,
                                  logits_at=jnp.zeros((tokens.shape[0], 1), jnp.int32))
  logits = (hidden @ head_rows(cfg, params, vocab).T).astype(jnp.float32)  # [B,T,Vs]
  logp = jax.nn.log_softmax(logits, axis=-1)

  idx, m = subset_index(vocab, labels)
  has = labels >= 0
  if topk_ids is None:
    nll = -jnp.take_along_axis(logp, idx[..., None], axis=-1)[..., 0]
  else:
    kidx, km = subset_index(vocab, topk_ids)
    w = jnp.where(km & has[..., None], jnp.exp(topk_logp.astype(jnp.float32)), 0.0)
    w = w / jnp.maximum(jnp.sum(w, -1, keepdims=True), 1e-9)
    nll = -jnp.sum(w * jnp.take_along_axis(logp, kidx, axis=-1), axis=-1)
  hit = jnp.argmax(logits, axis=-1) == idx
  denom = jnp.maximum(jnp.sum(m), 1)
  return jnp.sum(nll * m) / denom, {"top1": jnp.sum(hit & m) / denom,
                                    "coverage": jnp.sum(m) / jnp.maximum(jnp.sum(has), 1),
                                    "count": jnp.sum(m).astype(jnp.float32)}


# ----------------------------------------------------------------------------- training


def _load_corpus(corpus):
  if isinstance(corpus, (str, os.PathLike)):
    from specjax.training import corpus as corpus_lib

    return corpus_lib.load(os.fspath(corpus))
  if not all(hasattr(corpus, a) for a in ("windows", "check_compatible", "meta")):
    raise InputError(f"corpus={corpus!r} is invalid: give a corpus directory or a loaded Corpus")
  return corpus


def setup_run(target, corpus, *, held_out: float, vocab_size: int, **train_kw):
  """The checks and loading every corpus trainer starts with (draft and heads alike), all before
  any compile: held_out a fraction, a corpus given, the TrainConfig (train_kw: its fields) valid
  and its out_dir usable, the corpus loaded and written by this target, vocab_size within the
  target's vocabulary. Returns (config, corpus, target Model, target name)."""
  from specjax.training import trainer
  from specjax.weights import load_model

  if not (isinstance(held_out, (int, float)) and 0.0 <= held_out < 1.0):
    raise InputError(f"held_out={held_out!r} is invalid: a fraction in [0, 1)")
  if corpus is None:
    raise InputError("corpus=None: give a corpus directory (`specjax data generate`)")
  config = trainer.TrainConfig(**train_kw)
  config.validate()
  trainer.prepare_out_dir(config.out_dir)
  corpus = _load_corpus(corpus)
  target_name = target if isinstance(target, str) else target.name
  target = load_model(target) if isinstance(target, str) else target
  if vocab_size > target.config.vocab_size:
    raise InputError(f"vocab_size={vocab_size} exceeds the target's vocabulary "
                     f"({target.config.vocab_size})")
  corpus.check_compatible(target)
  return config, corpus, target, target_name


def grown_params(target: Model, own: dict, have: int, num_layers: int) -> dict:
  """A `have`-layer draft's own tensors (flat name -> array) extended to `num_layers` layers: layer
  i >= have is the target's layer i with the tensors that write into the residual stream (the
  attention output and MLP output projections, and their biases) zeroed, so each new layer passes
  its input through unchanged and the grown draft computes what the `have`-layer one did."""
  if num_layers == have:
    return own
  out = dict(own)
  for k, v in own_params(draft_from_target(target, num_layers)).items():
    if k not in out:  # a tensor of a new layer (the asset's own were checked when it loaded)
      zero = k.endswith(("_attn_wo", "_attn_bo", "_mlp_w_out", "_mlp_b_out"))
      out[k] = np.zeros(v.shape, np.float32) if zero else np.asarray(v, np.float32)
  return out


def train_draft(target: str | Model = "smollm2-135m", corpus=None, *, out_dir: str = "runs/draft",
                export: str | None = None, num_layers: int | None = None, vocab_size: int = 8192,
                steps: int = 2000, batch_size: int = 8, seq_len: int = 256, lr: float = 1e-3,
                warmup: int = 100, weight_decay: float = 0.0, grad_clip: float = 1.0,
                soft_top_k: int = 0, held_out: float = 0.02, max_held_out_windows: int = 64,
                ckpt_every: int = 100, eval_every: int = 100, max_minutes: float = 0.0,
                seed: int = 0, init: str | None = None, parallel: dict | None = None,
                progress: bool = True, log=print) -> Model:
  """Distils a `num_layers`-layer draft from `target` on `corpus`; resumable (rerun the same call).

  target: a loaded Model or a name for load_model. corpus: a corpus directory or a loaded Corpus
  of that target's responses. out_dir: the run's checkpoints, log.jsonl and train.png
  (trainer.py). soft_top_k > 0: train against the target's top-k distribution, computed per batch
  (one target forward per step) instead of the corpus's next token. held_out: the fraction of
  corpus sequences held out; at most max_held_out_windows of their windows are evaluated.
  export: the .npz asset to write at the end (specjax.shipped's format). init: a draft asset (.npz path or
  registered name) to start from instead of the target's first layers; its vocabulary subset is
  kept, and its layer count unless num_layers asks for more: the draft then grows, each new layer
  on top starting as the target's layer of that index with its attention output and MLP output
  projections zeroed, an identity on the residual stream, so the grown draft starts out computing
  exactly what the asset does (fine-tuning a shipped draft on a new corpus, or deepening it).
  num_layers: the draft's layers (default 2 without init; with init, the asset's count).
  parallel: a parallel draft (PARD, training/pard.py) instead of a plain one: {"block_size": k
  tokens drafted per forward, "mask_token": the id its masks carry, "anchors": blocks scored per
  window (0: one per k positions)}; its asset records the first two, and the held-out top1_k per
  offset that sizes its chain. Returns the draft Model, with `train_step` and `held_out_top1`
  (agreement with the target's greedy next token) set.
  """
  if num_layers is not None:
    check_int("num_layers", num_layers, 1)
  for arg, v, lo in (("vocab_size", vocab_size, 2),
                     ("batch_size", batch_size, 1), ("seq_len", seq_len, 2),
                     ("soft_top_k", soft_top_k, 0), ("max_held_out_windows", max_held_out_windows, 1)):
    check_int(arg, v, lo)
  if export is not None:  # checked now: an unwritable export would fail only after training
    validate.writable_file("export", export, ".npz")
  if init is not None:  # a missing, damaged or non-draft asset fails before anything loads
    read_draft_header(init)
  if parallel is not None:
    parallel = _check_parallel(parallel, soft_top_k, seq_len)
  with folders.removed_on_failure(out_dir, trainer.has_checkpoint):
    config, corpus, target, target_name = setup_run(
        target, corpus, held_out=held_out, vocab_size=vocab_size, out_dir=out_dir, steps=steps,
        lr=lr, warmup=warmup, weight_decay=weight_decay, grad_clip=grad_clip, ckpt_every=ckpt_every,
        eval_every=eval_every, seed=seed, max_minutes=max_minutes, progress=progress)
    _check_on_target(target.config, num_layers, soft_top_k, parallel)
    tok, labels, vtok, vlabels = _draft_windows(corpus, seq_len, held_out, seed,
                                                max_held_out_windows, log)
    name = f"{target_name}-{'draft' if parallel is None else 'pard'}"
    draft, vocab, num_layers = _initial_draft(target, name, init, num_layers, labels, vocab_size,
                                              log)
    # Large frozen tensors go in as jit arguments, not closed-over constants.
    frozen = {"draft": draft.params, "target": target.params if soft_top_k else None}
    loss_fn, eval_fn = _draft_losses(draft, target, jnp.asarray(vocab), soft_top_k, parallel)
    held = _held_out_batches(target, vtok, vlabels, batch_size, seq_len)

    batches = trainer.row_batches((tok, labels), batch_size, seed)
    res = trainer.train(own_params(draft), loss_fn, batches, config, held_out=held, eval_fn=eval_fn,
                        frozen=frozen, log=log,
                        title=f"{name}: {num_layers} layers, Vs={len(vocab)}"
                        + (f", soft top-{soft_top_k}" if soft_top_k else "")
                        + (f", blocks of {parallel['block_size']}" if parallel else ""))
    val = None if res.held_out is None else res.held_out["top1"]
    log(f"train: stopped at step {res.step}"
        + (f", held-out top1 {val:.4f}" if val is not None else ""))
    draft = draft_from_target(target, num_layers, vocab, name=name,
                              own={k: np.asarray(v) for k, v in res.params.items()})
    draft.train_step, draft.held_out_top1 = res.step, val
    if export:
      _export(draft, export, target_name, corpus.meta, res, {
          "vocab_size": int(len(vocab)), "lr": lr, "batch_size": batch_size, "seq_len": seq_len,
          "soft_top_k": soft_top_k, "labels": int(np.sum(labels >= 0)), "init": init}, parallel,
              log)
    return draft


def _export(draft, path: str, target_name: str, corpus_meta: dict, res, run: dict,
            parallel: dict | None, log) -> None:
  """Writes the trained draft's asset: the run's settings, a parallel draft's block and mask
  token, the held-out metrics and the corpus it learned from in its header."""
  meta = dict(corpus_meta)
  export_draft(draft, path, target_name=target_name, meta={
      "steps": res.step, **run, **({} if parallel is None else {"parallel": {
          "block_size": parallel["block_size"], "mask_token_id": parallel["mask_token"],
          "anchors": parallel["anchors"]}}),
      "held_out_top1": draft.held_out_top1, "held_out": res.held_out,
      "corpus": {k: meta[k] for k in ("model", "vocab_size", "weights_sha256") if k in meta}})
  log(f"export: wrote {path} ({os.path.getsize(path) / 2**20:.1f} MiB)")


def _draft_windows(corpus, seq_len: int, held_out: float, seed: int, max_held_out_windows: int,
                   log):
  """The corpus's training windows and labels [N,T] (`next_token_labels`) and at most
  max_held_out_windows held-out ones. Returns (tok, labels, vtok, vlabels)."""
  tok, mask = corpus.windows(seq_len, "train", held_out, seed)
  labels = next_token_labels(tok, mask)
  if not np.any(labels >= 0):
    raise InputError(f"corpus {getattr(corpus, 'path', '')}: no training windows with response "
                     f"tokens (held_out={held_out}, seq_len={seq_len})")
  vtok, vmask = corpus.windows(seq_len, "heldout", held_out, seed)
  vtok, vmask = vtok[:max_held_out_windows], vmask[:max_held_out_windows]
  vlabels = next_token_labels(vtok, vmask)
  log(f"data: {len(tok)} training windows ({int(np.sum(labels >= 0))} labelled positions), "
      f"{len(vtok)} held-out windows")
  return tok, labels, vtok, vlabels


def _initial_draft(target: Model, name: str, init, num_layers, labels, vocab_size: int, log):
  """The draft training starts from: the init asset (grown to num_layers), or the target's first
  num_layers (default 2) over the labels' `vocab_size` most frequent tokens. Returns (draft,
  vocabulary subset [Vs], num_layers)."""
  if init is None:
    num_layers = 2 if num_layers is None else num_layers
    vocab = vocab_subset(np.bincount(labels[labels >= 0], minlength=target.config.vocab_size),
                         vocab_size)
    return draft_from_target(target, num_layers, vocab, name=name), vocab, num_layers
  from specjax import shipped

  path = shipped.get(init).path if init in shipped.DRAFTERS else init
  base = shipped.load_draft_asset(path, target)
  have, vocab = base.config.num_layers, np.asarray(base.vocab_subset)
  if num_layers is not None and num_layers < have:
    raise InputError(f"num_layers={num_layers} is fewer than the {have} layers of init {path}: "
                     f"a draft can be grown from an asset, not cut")
  num_layers = have if num_layers is None else num_layers
  own = grown_params(target, {k: np.asarray(v, np.float32) for k, v in own_params(base).items()},
                     have, num_layers)
  draft = draft_from_target(target, num_layers, vocab, name=name, own=own)
  log(f"init: {path} ({have} layers{f', grown to {num_layers}' if num_layers > have else ''}, "
      f"Vs={len(vocab)})")
  return draft, vocab, num_layers


def _check_on_target(cfg, num_layers, soft_top_k: int, parallel) -> None:
  """train_draft's checks that need the target's config (before any compile)."""
  if num_layers is not None and not num_layers <= cfg.num_layers:
    raise InputError(f"num_layers={num_layers} must be in [1, {cfg.num_layers}] (the target's "
                     f"layers)")
  if parallel is not None and not 0 <= parallel["mask_token"] < cfg.vocab_size:
    raise InputError(f"mask_token={parallel['mask_token']} is not a token id of the target "
                     f"(its vocabulary has {cfg.vocab_size})")
  if soft_top_k > cfg.vocab_size:
    raise InputError(f"soft_top_k={soft_top_k} exceeds the target's vocabulary "
                     f"({cfg.vocab_size})")


def _check_parallel(parallel: dict, soft_top_k: int, seq_len: int) -> dict:
  """train_draft's `parallel` settings checked, with their defaults filled (before any load)."""
  if not isinstance(parallel, dict) or set(parallel) - {"block_size", "mask_token", "anchors"}:
    raise InputError(f"parallel={parallel!r} is invalid: a dict of block_size, mask_token and "
                     f"anchors")
  out = {"block_size": 8, "anchors": 0, **parallel}
  check_int("block_size", out["block_size"], 2, 64)
  check_int("anchors", out["anchors"], 0, seq_len - 1, f" (at most seq_len - 1 = {seq_len - 1})")
  if out.get("mask_token") is None:
    raise InputError("a parallel draft needs mask_token: an id the corpus never holds, which the "
                     "draft learns as 'to be predicted' (e.g. a special token)")
  check_int("mask_token", out["mask_token"], 0)
  if soft_top_k:
    raise InputError("soft_top_k is not available for a parallel draft: it trains on the corpus's "
                     "tokens")
  out["anchors"] = out["anchors"] or max(1, seq_len // out["block_size"])
  return out


def _draft_losses(draft: Model, target: Model, vocab_j, soft_top_k: int,
                  parallel: dict | None = None):
  """(loss_fn, eval_fn) for the trainer, both f(own, batch, rng, frozen). Training: hard labels,
  or with soft_top_k the target's top-k computed on the batch. Held-out: agreement with the
  target's greedy token (top1) and with the corpus token (top1_corpus). parallel: PARD's
  losses instead (`_parallel_losses`)."""
  if parallel is not None:
    return _parallel_losses(draft, vocab_j, parallel)

  def loss_fn(own, batch, rng, frozen):
    del rng  # deterministic loss
    tokens, lab = batch
    if not soft_top_k:
      return draft_loss(draft, own, vocab_j, tokens, lab, params=frozen["draft"])
    logits, _ = teacher_outputs(target, frozen["target"], tokens)
    ids, logp = top_k(logits, soft_top_k, passes=True)
    lab = jnp.where(lab >= 0, ids[..., 0], -1)  # the target's argmax, where there is a label
    return draft_loss(draft, own, vocab_j, tokens, lab, ids, logp, params=frozen["draft"])

  def eval_fn(own, batch, rng, frozen):
    tokens, lab, greedy = batch
    loss, m = draft_loss(draft, own, vocab_j, tokens, greedy, params=frozen["draft"])
    _, mc = draft_loss(draft, own, vocab_j, tokens, lab, params=frozen["draft"])
    return loss, {"top1": m["top1"], "coverage": m["coverage"], "count": m["count"],
                  "top1_corpus": mc["top1"]}

  return loss_fn, eval_fn


def _parallel_losses(draft: Model, vocab_j, parallel: dict):
  """A parallel draft's (loss_fn, eval_fn): training/pard.py's loss at `anchors` random labelled
  positions per window (fixed ones held out, the trainer's evaluation key); held-out metrics
  against the target's greedy tokens, per block offset."""
  from specjax.training.dflash import sample_anchors
  from specjax.training.pard import pard_loss

  k, mask_token, num = parallel["block_size"], parallel["mask_token"], parallel["anchors"]

  def loss_fn(own, batch, rng, frozen):
    tokens, lab = batch
    anchors, _ = sample_anchors(rng, lab >= 0, num)
    return pard_loss(draft, own, vocab_j, tokens, lab, anchors, k, mask_token,
                     params=frozen["draft"])

  def eval_fn(own, batch, rng, frozen):
    tokens, lab, greedy = batch
    anchors, _ = sample_anchors(rng, greedy >= 0, num)
    return pard_loss(draft, own, vocab_j, tokens, lab, anchors, k, mask_token,
                     params=frozen["draft"], greedy=greedy)

  return loss_fn, eval_fn


def _held_out_batches(target: Model, vtok, vlabels, batch_size: int, seq_len: int) -> list:
  """Held-out batches (tokens, corpus labels, the target's greedy next tokens), each [batch_size,T];
  the target's argmax is computed once here. Padding rows carry no labels, so count 0."""
  if not len(vtok):
    return []
  _, (greedy, _) = teacher_features(target, vtok, top_k=1, batch_size=batch_size)
  greedy = np.where(vlabels >= 0, greedy[..., 0], -1)
  pad = -len(vtok) % batch_size  # one shape for every batch
  vtok = np.concatenate([vtok, np.zeros((pad, seq_len), np.int32)])
  vlabels, greedy = (np.concatenate([a, np.full((pad, seq_len), -1, np.int32)]) for a in (vlabels, greedy))
  return [tuple(jnp.asarray(a[i:i + batch_size]) for a in (vtok, vlabels, greedy))
          for i in range(0, len(vtok), batch_size)]
