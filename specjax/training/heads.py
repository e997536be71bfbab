"""One corpus trainer for every kind of heads (Medusa, EAGLE, MTP) on a frozen target.

    specjax train medusa | eagle | mtp --corpus DIR   ->   train_heads(kind, target, corpus, ...)

Each kind supplies only its loss (training/medusa.py, eagle.py, mtp.py); the data (response
windows of the self-distillation corpus), the vocabulary subset, the frozen target and the loop
(training/trainer.py: AdamW, warmup + cosine, clipping, orbax checkpoints, resume, held-out
evaluation, log and plot) are shared.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import InputError, check_int
from specjax.training.medusa import _hidden, accuracy_table, lm_head_matrix, medusa_loss


def response_valid(mask: np.ndarray) -> np.ndarray:
  """Corpus windows' mask [N,T] (True where the NEXT token is a response token) -> valid [N,T]:
  response tokens and the last prompt token (whose hidden state predicts the response's start).
  Heads learn only from, and only to predict, the target's own text."""
  prev = np.zeros_like(mask)
  prev[:, 1:] = mask[:, :-1]  # position j holds a response token
  return mask | prev


def train_heads(kind: str, target="smollm2-135m", corpus=None, *, out_dir: str | None = None,
                 export: str | None = None, num_heads: int | None = None, num_layers: int = 1,
                 vocab_size: int = 8192, steps: int = 400, batch_size: int = 4, seq_len: int = 256,
                 lr: float = 1e-3, warmup: int = 40, weight_decay: float = 0.0,
                 grad_clip: float = 1.0, held_out: float = 0.02, max_held_out_windows: int = 32,
                 ckpt_every: int = 50, eval_every: int = 50, max_minutes: float = 0.0,
                 seed: int = 0, progress: bool = True, log=print):
  """Trains `kind` heads ("medusa", "eagle", "mtp") on a frozen target over a self-distillation
  corpus with the shared trainer; resumable (rerun the same call).

  Losses: training/medusa.py (CE per head, 0.8^k), training/eagle.py (smooth-L1 on the next
  feature + 0.1 soft CE, feature noise), training/mtp.py (CE per depth, 0.8^k). The target's
  features are computed inside each update step (one frozen forward per batch, its params a jit
  argument), never stored. num_heads: None = the kind's default (4 / 1 / 2). Only response
  positions are learned (corpus windows' mask). vocab_size > 0: the heads score only the corpus's
  `vocab_size` most frequent next tokens (rows of the target's LM head; labels outside it are
  skipped), which makes both training and proposing several times cheaper on a CPU; 0: the full
  vocabulary. Held-out metrics per head: loss, top-1 and top-5 accuracy (`accuracy_table`).
  Returns the trained Heads (held-out metrics in `heads.meta`); export: write them (save_heads).
  """
  from specjax.heads import KINDS

  if kind not in KINDS:
    raise InputError(f"kind={kind!r} is invalid: one of {', '.join(KINDS)}")
  out_dir = out_dir or f"runs/{kind}"
  if num_heads is None:
    num_heads = {"medusa": 4, "eagle": 1, "mtp": 2}[kind]
  from specjax.heads import init_heads, save_heads
  from specjax.training import trainer
  from specjax.training.draft import setup_run, vocab_subset

  for arg, v, lo in (("num_heads", num_heads, 1), ("num_layers", num_layers, 1),
                     ("vocab_size", vocab_size, 0), ("batch_size", batch_size, 1),
                     ("seq_len", seq_len, num_heads + 3), ("max_held_out_windows", max_held_out_windows, 1)):
    check_int(arg, v, lo)
  config, corpus, target, target_name = setup_run(
      target, corpus, held_out=held_out, vocab_size=vocab_size, out_dir=out_dir, steps=steps, lr=lr,
      warmup=warmup, weight_decay=weight_decay, grad_clip=grad_clip, ckpt_every=ckpt_every,
      eval_every=eval_every, seed=seed, max_minutes=max_minutes, progress=progress)
  cfg = target.config
  tok, mask = corpus.windows(seq_len, "train", held_out, seed)
  if not mask.any():
    raise InputError(f"corpus {getattr(corpus, 'path', '')}: no training windows with response "
                     f"tokens (held_out={held_out}, seq_len={seq_len})")
  valid = response_valid(mask)
  vtok, vmask = corpus.windows(seq_len, "heldout", held_out, seed)
  vtok, vmask = vtok[:max_held_out_windows], vmask[:max_held_out_windows]
  vvalid = response_valid(vmask)
  log(f"data: {len(tok)} training windows ({int(mask.sum())} response positions), "
      f"{len(vtok)} held-out windows")
  vocab = None
  if vocab_size:
    nxt = tok[:, 1:][mask[:, :-1]]
    vocab = vocab_subset(np.bincount(nxt, minlength=cfg.vocab_size), vocab_size)
  heads = init_heads(target, kind, num_heads=num_heads, num_layers=num_layers, seed=seed,
                     vocab=vocab)
  vocab_j = None if vocab is None else jnp.asarray(heads.vocab)
  hcfg = heads.config
  if kind == "medusa":
    frozen = {"target": target.params, "head": lm_head_matrix(target, vocab_j)}

    def loss_fn(params, batch, rng, frozen):
      del rng
      tokens, ok, _ = batch
      hidden = _hidden(target.graphdef, frozen["target"], tokens)
      return medusa_loss(params, hcfg, hidden, tokens, frozen["head"], vocab_j, ok)
  else:
    from specjax.training import eagle as eagle_train
    from specjax.training import mtp as mtp_train

    frozen = eagle_train.frozen_arrays(target, heads)
    inner = (eagle_train if kind == "eagle" else mtp_train).make_loss(target, heads)

    def loss_fn(params, batch, rng, frozen):
      tokens, _, mask = batch
      return inner(params, {"tokens": tokens, "mask": mask}, rng, frozen)

  held = []
  if len(vtok):
    pad = -len(vtok) % batch_size
    vtok = np.concatenate([vtok, np.zeros((pad, seq_len), np.int32)])
    vvalid = np.concatenate([vvalid, np.zeros((pad, seq_len), bool)])
    vmask = np.concatenate([vmask, np.zeros((pad, seq_len), bool)])
    held = [tuple(jnp.asarray(a[i:i + batch_size]) for a in (vtok, vvalid, vmask))
            for i in range(0, len(vtok), batch_size)]

  def batches(step):
    rows = trainer.batch_rows(len(tok), batch_size, seed, step)
    return jnp.asarray(tok[rows]), jnp.asarray(valid[rows]), jnp.asarray(mask[rows])

  params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), heads.params)
  res = trainer.train(params, loss_fn, batches, config, held_out=held, frozen=frozen, log=log,
                      title=f"{kind}: {num_heads} heads, Vs={'all' if vocab is None else len(vocab)}")
  import dataclasses

  held_metrics = {k: float(v) for k, v in (res.held_out or {}).items()}
  heads = dataclasses.replace(heads, params=jax.tree_util.tree_map(
      lambda x, y: jnp.asarray(x, y.dtype), res.params, heads.params),
      meta={"held_out": held_metrics, "steps": res.step})
  if res.held_out and kind == "medusa":
    table = accuracy_table(res.held_out, num_heads)
    log("held-out top-1 / top-5 per head: " + ", ".join(
        f"{a:.3f} / {b:.3f}" for a, b in table))
  if export:
    save_heads(heads, export, meta={"target": target_name, "kind": kind, "steps": res.step, "lr": lr,
                                    "batch_size": batch_size, "seq_len": seq_len,
                                    "corpus": {k: corpus.meta[k] for k in ("model", "vocab_size",
                                               "weights_sha256") if k in corpus.meta}})
    log(f"export: wrote {export}")
  return heads
