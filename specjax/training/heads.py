"""One corpus trainer for every kind of heads (Medusa, EAGLE, MTP) on a frozen target.

    specjax train medusa | eagle | mtp --corpus DIR   ->   train_heads(kind, target, corpus, ...)

Each kind supplies only its loss (training/medusa.py, eagle.py, mtp.py); the data (response
windows of the self-distillation corpus), the vocabulary subset, the frozen target and the loop
(training/trainer.py: AdamW, warmup + cosine, clipping, orbax checkpoints, resume, held-out
evaluation, log and plot) are shared.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import InputError, check_int
from specjax.training.medusa import accuracy_table, medusa_loss


def response_valid(mask: np.ndarray) -> np.ndarray:
  """Corpus windows' mask [N,T] (True where the NEXT token is a response token) -> valid [N,T]:
  response tokens and the last prompt token (whose hidden state predicts the response's start).
  Heads learn only from, and only to predict, the target's own text."""
  prev = np.zeros_like(mask)
  prev[:, 1:] = mask[:, :-1]  # position j holds a response token
  return mask | prev


def parse_kinds(kind) -> tuple[str, ...]:
  """"eagle" | "eagle,medusa,mtp" | ("eagle", "mtp") -> a tuple of distinct heads kinds."""
  from specjax.heads import KINDS

  kinds = tuple(k.strip() for k in kind.split(",")) if isinstance(kind, str) else tuple(kind)
  bad = [k for k in kinds if k not in KINDS]
  if not kinds or bad or len(set(kinds)) != len(kinds):
    raise InputError(f"kind={kind!r} is invalid: one or more distinct kinds of "
                     f"{', '.join(KINDS)} (e.g. 'eagle' or 'eagle,medusa,mtp')")
  return kinds


DEFAULT_NUM_HEADS = {"medusa": 4, "eagle": 1, "mtp": 2}


def train_heads(kind, target="smollm2-135m", corpus=None, *, out_dir: str | None = None,
                export: str | None = None, num_heads=None, num_layers: int = 1,
                vocab_size: int = 8192, steps: int = 400, batch_size: int = 4, seq_len: int = 256,
                lr: float = 1e-3, warmup: int = 40, weight_decay: float = 0.0,
                grad_clip: float = 1.0, held_out: float = 0.02, max_held_out_windows: int = 32,
                ckpt_every: int = 50, eval_every: int = 50, max_minutes: float = 0.0,
                seed: int = 0, unroll: int = 1, init: str | None = None, taps=(),
                progress: bool = True, log=print):
  """Trains `kind` heads ("medusa", "eagle", "mtp") on a frozen target over a self-distillation
  corpus with the shared trainer; resumable (rerun the same call).

  Several kinds at once ("eagle,medusa,mtp" or a tuple): every kind reads the same target
  forward per batch, which is most of a step's cost (on SmolLM2 the forward over 4 x 256 tokens
  is about 280 GFLOP, each kind's loss 20-120), so three kinds train for a little more than the
  price of one. Each kind's gradients are clipped on their own (trainer `clip_groups`), so one
  kind's large early gradients never slow another's; their losses add, and the log has every
  kind's metrics as "<kind>/<name>". export must then name each file with "{kind}", e.g.
  "heads-{kind}.npz"; a dict kind -> Heads is returned.

  Losses: training/medusa.py (CE per head, 0.8^k), training/eagle.py (smooth-L1 on the next
  feature + 0.1 soft CE, feature noise), training/mtp.py (CE per depth, 0.8^k). The target's
  features are computed inside each update step (one frozen forward per batch, its params a jit
  argument), never stored. num_heads: None = each kind's default (4 / 1 / 2), an int (one kind),
  or a dict kind -> int. Only response positions are learned (corpus windows' mask).
  vocab_size > 0: the heads score only the corpus's `vocab_size` most frequent next tokens (rows
  of the target's LM head; labels outside it are skipped), which makes both training and
  proposing several times cheaper on a CPU; 0: the full vocabulary. Held-out metrics per head:
  loss, top-1 and top-5 accuracy (`accuracy_table`). Returns the trained Heads (held-out metrics
  in `heads.meta`); export: write them (save_heads).

  unroll > 1 (EAGLE only): training-time test, the head also learns to draft unroll - 1 further
  steps on its own predicted features (training/eagle.py make_loss; held-out top1_d per depth).
  init: start from trained heads instead of fresh ones (fine-tuning, e.g. with unroll): a file or
  shipped name, with "{kind}" standing for each kind (e.g. "smollm2-135m-{kind}"); their head
  count and vocabulary subset are kept (vocab_size is then ignored).

  taps (EAGLE only): fused features from these target layers (heads.py; "auto" = a low and a
  middle layer); with init from an unfused EAGLE head, the head is grown (`add_taps`: it starts
  out drafting exactly as before and learns to use the taps).
  """
  from specjax.heads import add_taps, check_taps, init_heads, save_heads

  kinds = parse_kinds(kind)
  joint = len(kinds) > 1
  out_dir = out_dir or f"runs/{'+'.join(kinds)}"
  if isinstance(num_heads, dict):
    unknown = sorted(set(num_heads) - set(kinds))
    if unknown:
      raise InputError(f"num_heads names kinds that are not trained here: {', '.join(unknown)}")
    per_kind = {k: num_heads.get(k, DEFAULT_NUM_HEADS[k]) for k in kinds}
  elif num_heads is None:
    per_kind = {k: DEFAULT_NUM_HEADS[k] for k in kinds}
  elif joint:
    raise InputError(f"num_heads={num_heads!r} is ambiguous for several kinds: give a dict, e.g. "
                     f"{{'medusa': 4, 'mtp': 2}}")
  else:
    per_kind = {kinds[0]: num_heads}
  if export is not None and joint and "{kind}" not in export:
    raise InputError(f"export={export!r} must contain '{{kind}}' when training several kinds "
                     f"(one file per kind, e.g. 'heads-{{kind}}.npz')")
  from specjax.training import eagle as eagle_train
  from specjax.training import mtp as mtp_train
  from specjax.training import trainer
  from specjax.training.draft import setup_run, vocab_subset

  for k, v in per_kind.items():
    check_int("num_heads" if not joint else f"num_heads[{k!r}]", v, 1)
  for arg, v, lo in (("num_layers", num_layers, 1),
                     ("vocab_size", vocab_size, 0), ("batch_size", batch_size, 1),
                     ("seq_len", seq_len, max(per_kind.values()) + 3),
                     ("max_held_out_windows", max_held_out_windows, 1)):
    check_int(arg, v, lo)
  check_int("unroll", unroll, 1)
  if unroll > 1 and "eagle" not in kinds:
    raise InputError(f"unroll={unroll} applies to EAGLE heads only (kinds: {', '.join(kinds)})")
  if taps and "eagle" not in kinds:
    raise InputError(f"taps={taps!r} applies to EAGLE heads only (kinds: {', '.join(kinds)})")
  if taps and taps != "auto":
    check_taps(taps)  # the format now; the range once the target is loaded
  if unroll + 2 > seq_len:
    raise InputError(f"unroll={unroll} needs seq_len >= unroll + 2 (got {seq_len})")
  inits = {}
  if init is not None:
    from specjax.heads import load_heads

    if joint and "{kind}" not in str(init):
      raise InputError(f"init={init!r} must contain '{{kind}}' when training several kinds")
    for k in kinds:
      path = str(init).replace("{kind}", k)
      h = load_heads(path)  # fit to the target is checked below
      if h.config.kind != k:
        raise InputError(f"init {path!r} holds {h.config.kind} heads, not {k}")
      asked = num_heads.get(k) if isinstance(num_heads, dict) else num_heads
      if asked is not None and h.config.num_heads != asked:
        raise InputError(f"init {k} heads have {h.config.num_heads} heads, num_heads asks {asked}")
      per_kind[k] = h.config.num_heads
      inits[k] = h
    vocabs = {None if h.vocab is None else tuple(np.asarray(h.vocab).tolist())
              for h in inits.values()}
    if len(vocabs) > 1:
      raise InputError("init heads score different vocabularies; joint training needs one")
  config, corpus, target, target_name = setup_run(
      target, corpus, held_out=held_out, vocab_size=0 if inits else vocab_size, out_dir=out_dir,
      steps=steps, lr=lr, warmup=warmup, weight_decay=weight_decay, grad_clip=grad_clip,
      ckpt_every=ckpt_every, eval_every=eval_every, seed=seed, max_minutes=max_minutes, progress=progress,
      clip_groups=joint)
  cfg = target.config
  taps = check_taps(taps, cfg.num_layers) if taps else ()
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
  if inits:
    from specjax.heads import check_fits

    for k, h in inits.items():
      check_fits(h, target)
    vocab = inits[kinds[0]].vocab
    heads_by = {k: dataclasses.replace(h, params=jax.tree_util.tree_map(
        lambda x: jnp.asarray(x, target.dtype), h.params)) for k, h in inits.items()}
    if taps:
      heads_by["eagle"] = add_taps(heads_by["eagle"], taps, target)
    log(f"init: {init} ({', '.join(f'{k}: {h.config.num_heads}' for k, h in inits.items())} "
        f"heads, Vs={'all' if vocab is None else len(vocab)})")
  else:
    if vocab_size:
      nxt = tok[:, 1:][mask[:, :-1]]
      vocab = vocab_subset(np.bincount(nxt, minlength=cfg.vocab_size), vocab_size)
    heads_by = {k: init_heads(target, k, num_heads=per_kind[k], num_layers=num_layers, seed=seed,
                              vocab=vocab, taps=taps if k == "eagle" else ())
                for k in kinds}
  if "eagle" in heads_by and heads_by["eagle"].config.taps:
    log(f"eagle: fused features from the outputs of layers {list(heads_by['eagle'].config.taps)} "
        f"and the last")
  vocab_j = None if vocab is None else jnp.asarray(vocab)
  # One frozen set for every kind: the target's params and the LM-head rows the heads score.
  frozen = eagle_train.frozen_arrays(target, heads_by[kinds[0]])

  def kind_loss(k):
    if k == "medusa":
      hcfg = heads_by[k].config
      return lambda p, b, rng, frozen: medusa_loss(p, hcfg, b["feats"], b["tokens"],
                                                   frozen["head"], vocab_j, b["valid"])
    if k == "eagle":
      return eagle_train.make_loss(target, heads_by[k], unroll=unroll)
    return mtp_train.make_loss(target, heads_by[k])

  losses = {k: kind_loss(k) for k in kinds}
  eagle_taps = heads_by["eagle"].config.taps if "eagle" in heads_by else ()

  def loss_fn(params, batch, rng, frozen):
    tokens, ok, m = batch
    full = eagle_train.target_features(target.graphdef, frozen["target"], tokens, eagle_taps)
    b = {"tokens": tokens, "valid": ok, "mask": m, "feats": full[..., -cfg.hidden_size:],
         "full": full}
    if not joint:
      return losses[kinds[0]](params, b, rng, frozen)
    total, metrics = 0.0, {}
    for k in kinds:
      loss, mk = losses[k](params[k], b, rng, frozen)
      total = total + loss
      metrics.update({f"{k}/{name}": v for name, v in mk.items() if name != "count"})
      metrics.setdefault("count", mk.get("count", jnp.sum(m)))
    metrics["loss"] = total
    return total, metrics

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

  def f32(h):
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), h.params)

  params = {k: f32(h) for k, h in heads_by.items()} if joint else f32(heads_by[kinds[0]])
  res = trainer.train(params, loss_fn, batches, config, held_out=held, frozen=frozen, log=log,
                      title=", ".join(f"{k}: {per_kind[k]} heads" for k in kinds)
                      + f", Vs={'all' if vocab is None else len(vocab)}")
  held_all = {k: float(v) for k, v in (res.held_out or {}).items()}
  out = {}
  for k in kinds:
    h = heads_by[k]
    trained = res.params[k] if joint else res.params
    held_k = ({name[len(k) + 1:]: v for name, v in held_all.items() if name.startswith(k + "/")}
              if joint else held_all)
    h = dataclasses.replace(h, params=jax.tree_util.tree_map(
        lambda x, y: jnp.asarray(x, y.dtype), trained, h.params),
        meta={"held_out": held_k, "steps": res.step})
    if held_k and k == "medusa":
      table = accuracy_table(held_k, per_kind[k])
      log("medusa held-out top-1 / top-5 per head: " + ", ".join(
          f"{a:.3f} / {b:.3f}" for a, b in table))
    if export:
      path = export.replace("{kind}", k)
      save_heads(h, path, meta={"target": target_name, "kind": k, "steps": res.step, "lr": lr,
                                "batch_size": batch_size, "seq_len": seq_len,
                                "trained_with": list(kinds), "unroll": unroll,
                                "init": None if init is None else str(init),
                                "corpus": {c: corpus.meta[c] for c in ("model", "vocab_size",
                                           "weights_sha256") if c in corpus.meta}})
      log(f"export: wrote {path}")
    out[k] = h
  return out if joint else out[kinds[0]]
