"""One corpus trainer for every kind of heads (Medusa, EAGLE, MTP, EAGLE-3, DFlash), frozen target.

    specjax train medusa | eagle | mtp | eagle3 | dflash | heads --corpus DIR
      ->   train_heads(kind, target, corpus, ...)

Each kind supplies only its loss, `make_loss(target, heads)` in training/medusa.py, eagle.py,
mtp.py, eagle3.py and dflash.py; this module is the one place that composes them (`make_loss`
here: one frozen target forward per batch shared by every kind). The data (response windows of the
self-distillation corpus), the vocabulary subset, the frozen target and the loop
(training/trainer.py: AdamW, warmup + cosine, clipping, orbax checkpoints, resume, held-out
evaluation, log and plot) are shared. Dependencies point down: this module imports the kinds'
modules, never the reverse.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax import lora, validate
from specjax.errors import InputError, check_int
from specjax.heads import (KINDS, add_taps, check_fits, check_taps, init_heads, load_heads,
                           save_heads)
from specjax.training import dflash, eagle, eagle3, folders, medusa, medusa2, mtp, trainer
from specjax.training.dflash import resolved_decay
from specjax.training.draft import setup_run, vocab_subset
from specjax.training.features import frozen_arrays, target_features


def response_valid(mask: np.ndarray) -> np.ndarray:
  """Corpus windows' mask [N,T] (True where the NEXT token is a response token) -> valid [N,T]:
  response tokens and the last prompt token (whose hidden state predicts the response's start).
  Heads learn only from, and only to predict, the target's own text."""
  prev = np.zeros_like(mask)
  prev[:, 1:] = mask[:, :-1]  # position j holds a response token
  return mask | prev


def parse_kinds(kind) -> tuple[str, ...]:
  """"eagle" | "eagle,medusa,mtp" | ("eagle", "mtp") -> a tuple of distinct heads kinds."""
  kinds = tuple(k.strip() for k in kind.split(",")) if isinstance(kind, str) else tuple(kind)
  bad = [k for k in kinds if k not in TRAIN_KINDS]
  if not kinds or bad or len(set(kinds)) != len(kinds):
    raise InputError(f"kind={kind!r} is invalid: one or more distinct kinds of "
                     f"{', '.join(TRAIN_KINDS)} (e.g. 'eagle' or 'eagle,medusa,mtp')")
  return kinds


TRAIN_KINDS = KINDS
DEFAULT_NUM_HEADS = {"medusa": 4, "eagle": 1, "mtp": 2, "eagle3": 1, "dflash": 1}
ALONE = ("eagle3", "dflash")  # kinds that read other target features than the rest: trained alone


def make_loss(target, heads_by: dict, *, unroll: int = 1, dflash_loss: dict | None = None):
  """loss_fn(params, batch, rng, frozen) -> (loss, metrics) for one or several kinds of heads.

  heads_by: kind -> Heads. batch: (tokens [B,T], valid [B,T], mask [B,T]) as `train_heads` builds
  it (valid: `response_valid`; mask: the corpus windows'). The target runs once per batch (with
  the EAGLE head's taps, if any) and every kind's loss reads its features. One kind: params and
  metrics are that kind's own. Several: params is a dict kind -> params, the losses add, and
  metrics are "<kind>/<name>" plus the first kind's count. unroll: EAGLE's (eagle.make_loss);
  dflash_loss: DFlash's loss options, decay and anchors (dflash.make_loss)."""
  kinds = tuple(heads_by)
  joint = len(kinds) > 1
  if kinds[0] in ALONE:  # its own target forward (the raw states at its taps)
    own = (dflash.make_loss(target, heads_by["dflash"], **(dflash_loss or {}))
           if kinds[0] == "dflash" else
           eagle3.make_loss(target, heads_by["eagle3"], unroll=unroll))
    return lambda params, batch, rng, frozen: own(
        params, {"tokens": batch[0], "mask": batch[2]}, rng, frozen)
  makers = {"medusa": medusa.make_loss, "mtp": mtp.make_loss,
            "eagle": lambda t, h: eagle.make_loss(t, h, unroll=unroll)}
  losses = {k: makers[k](target, heads_by[k]) for k in kinds}
  eagle_taps = heads_by["eagle"].config.taps if "eagle" in heads_by else ()
  e = target.config.hidden_size

  def loss_fn(params, batch, rng, frozen):
    tokens, ok, m = batch
    full = target_features(target.graphdef, frozen["target"], tokens, eagle_taps)
    b = {"tokens": tokens, "valid": ok, "mask": m, "feats": full[..., -e:], "full": full}
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

  return loss_fn


def train_heads(kind, target="smollm2-135m", corpus=None, *, out_dir: str | None = None,
                export: str | None = None, num_heads=None, num_layers: int = 1,
                vocab_size: int = 8192, steps: int = 400, batch_size: int = 4, seq_len: int = 256,
                lr: float = 1e-3, warmup: int = 40, weight_decay: float = 0.0,
                grad_clip: float = 1.0, held_out: float = 0.02, max_held_out_windows: int = 32,
                ckpt_every: int = 50, eval_every: int = 50, max_minutes: float = 0.0,
                seed: int = 0, unroll: int = 1, init: str | None = None, taps=(),
                progress: bool = True, dflash: dict | None = None, log=print):
  """Trains `kind` heads ("medusa", "eagle", "mtp", "eagle3", "dflash") on a frozen target over a
  self-distillation corpus with the shared trainer; resumable (rerun the same call). dflash:
  block_size, mask_token_id, target_layer_ids of fresh DFlash heads (num_layers: its layers),
  and loss_decay, the offsets' loss decay gamma (training/dflash.py; None: the paper's).

  Several kinds at once ("eagle,medusa,mtp" or a tuple): every kind reads the same target
  forward per batch, which is most of a step's cost (on SmolLM2 the forward over 4 x 256 tokens
  is about 280 GFLOP, each kind's loss 20-120), so three kinds train for a little more than the
  price of one. Each kind's gradients are clipped on their own (trainer `clip_groups`), so one
  kind's large early gradients never slow another's; their losses add, and the log has every
  kind's metrics as "<kind>/<name>". export must then name each file with "{kind}", e.g.
  "heads-{kind}.npz"; a dict kind -> Heads is returned.

  Losses: training/medusa.py (CE per head, 0.8^k), eagle.py (smooth-L1 on the next feature + 0.1
  soft CE, noise), mtp.py (CE per depth, 0.8^k), eagle3.py (EAGLE-3's soft CE, 0.8^d; alone),
  dflash.py (block CE at random anchors; alone, full vocabulary). Target features are computed
  per batch, never stored. num_heads: None = each kind's default, an int or a dict kind -> int.
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

  taps (EAGLE only): fused features from these target layers (specjax/drafters/eagle.py; "auto" =
  a low and a middle layer); with init from an unfused EAGLE head, the head is grown (`add_taps`:
  it starts out drafting exactly as before and learns to use the taps).
  """
  kinds = parse_kinds(kind)
  joint = len(kinds) > 1
  out_dir = out_dir or f"runs/{'+'.join(kinds)}"
  dflash, dflash_loss = _dflash_options(dflash)
  per_kind = _heads_per_kind(kinds, num_heads)
  _check_args(kinds, per_kind, export=export, num_layers=num_layers, vocab_size=vocab_size,
              batch_size=batch_size, seq_len=seq_len, max_held_out_windows=max_held_out_windows,
              unroll=unroll, taps=taps)
  with folders.removed_on_failure(out_dir, trainer.has_checkpoint):
    inits = {} if init is None else _load_inits(init, kinds, num_heads, per_kind)
    config, corpus, target, target_name = setup_run(
        target, corpus, held_out=held_out, vocab_size=0 if inits or kinds == ("dflash",) else
        vocab_size, out_dir=out_dir, steps=steps, lr=lr, warmup=warmup, weight_decay=weight_decay,
        grad_clip=grad_clip, ckpt_every=ckpt_every, eval_every=eval_every, seed=seed,
        max_minutes=max_minutes, progress=progress, clip_groups=joint)
    taps = check_taps(taps, target.config.num_layers) if taps else ()
    tok, mask, held = _windows(corpus, seq_len, held_out, seed, max_held_out_windows, batch_size,
                               log)
    valid = response_valid(mask)
    heads_by, vocab = _starting_heads(inits, init, target, kinds, per_kind, tok, mask,
                                      vocab_size=vocab_size, num_layers=num_layers, seed=seed,
                                      taps=taps, dflash=dflash, log=log)
    trained_as, vocab = _as_trained(heads_by, vocab, log)
    # One frozen set for every kind: the target's params and the LM-head rows the heads score.
    frozen = frozen_arrays(target, trained_as[kinds[0]])
    batches = trainer.row_batches((tok, valid, mask), batch_size, seed)
    params = {k: _f32(h.params) for k, h in heads_by.items()}  # trained in float32
    res = trainer.train(params if joint else params[kinds[0]],
                        make_loss(target, trained_as, unroll=unroll, dflash_loss=dflash_loss),
                        batches, config, held_out=held, frozen=frozen, log=log,
                        title=", ".join(f"{k}: {per_kind[k]} heads" for k in kinds)
                        + f", Vs={'all' if vocab is None else len(vocab)}")
    meta = dict(target=target_name, steps=res.step, lr=lr, batch_size=batch_size, seq_len=seq_len,
                trained_with=list(kinds), unroll=unroll, init=None if init is None else str(init),
                **(_dflash_meta(heads_by, dflash, dflash_loss) if kinds == ("dflash",) else {}),
                corpus={c: corpus.meta[c] for c in ("model", "vocab_size", "weights_sha256")
                        if c in corpus.meta})
    out = {k: _finish(k, heads_by[k], res, joint, per_kind[k], export, meta, log) for k in kinds}
    return out if joint else out[kinds[0]]


def _as_trained(heads_by: dict, vocab, log) -> tuple[dict, object]:
  """(the heads as the loss sees them, the vocabulary subset it scores): a DFlash drafter with a
  subset (an init asset whose file records one for decoding) over the whole vocabulary instead.
  Its parameters do not depend on the subset (it scores through the target's own LM-head rows),
  and its loss labels are token ids of the whole vocabulary. (heads_by, vocab) otherwise."""
  h = heads_by.get("dflash")
  if h is None or h.vocab is None:
    return heads_by, vocab
  log(f"dflash: trained over the whole vocabulary; the init's subset of {len(h.vocab)} ids is "
      "kept for decoding")
  return {**heads_by, "dflash": dataclasses.replace(
      h, vocab=None, config=dataclasses.replace(h.config, vocab_subset=0))}, None


def _dflash_meta(heads_by: dict, dflash: dict, loss: dict) -> dict:
  """What a DFlash run records beside every run's meta: its loss decay, anchors and start."""
  return {"loss_decay": resolved_decay(heads_by["dflash"].config.block_size, loss["decay"]),
          "anchors": loss["anchors"], "warm": bool(dflash.get("warm"))}


def _dflash_options(dflash: dict | None) -> tuple[dict, dict]:
  """train_heads' dflash options -> (the drafter's shape and start, for init_heads; the loss's
  options: decay, the offsets' loss decay gamma, None for the paper's for the block size or a
  number >= 0, and anchors, blocks per window, 0 for one per block length), without changing the
  caller's dict."""
  dflash = dict(dflash or {})
  decay = dflash.pop("loss_decay", None)
  if decay is not None and (isinstance(decay, bool) or not isinstance(decay, (int, float))
                            or not decay >= 0):
    raise InputError(f"loss_decay={decay!r} is invalid: a number >= 0 (0: every block offset "
                     "weighs alike; omit it for the paper's gamma)")
  anchors = dflash.pop("anchors", 0) or 0
  check_int("anchors", anchors, 0, 4096, " (blocks per training window; 0: one per block length)")
  return dflash, {"decay": decay, "anchors": anchors}


def train_medusa(target="smollm2-135m", corpus=None, **kw):
  """Medusa-1 heads on a corpus: `train_heads("medusa", target, corpus, **kw)`."""
  return train_heads("medusa", target, corpus, **kw)


def train_medusa2(target="smollm2-135m", corpus=None, *, out_dir: str = "runs/medusa2",
                  export: str | None = None, num_heads: int | None = None, num_layers: int = 1,
                  vocab_size: int = 8192, rank: int = 8, alpha: float = 16.0,
                  sites=lora.SITES, kl_weight: float = 1.0, backbone_lr: float = 0.1,
                  warmup_heads: int = 50, steps: int = 400, batch_size: int = 4,
                  seq_len: int = 256, lr: float = 1e-3, warmup: int = 40,
                  grad_clip: float = 1.0, held_out: float = 0.02, max_held_out_windows: int = 32,
                  ckpt_every: int = 50, eval_every: int = 50, max_minutes: float = 0.0,
                  seed: int = 0, init: str | None = None, progress: bool = True, log=print):
  """Medusa-2 (training/medusa2.py): Medusa heads and LoRA adapters on the target's layer
  matrices trained together over a self-distillation corpus, loss = the heads' losses +
  kl_weight * KL(original || adapted); the heads alone for the first `warmup_heads` steps, the
  adapters then at backbone_lr x the heads' rate. Resumable like every trainer (rerun the same
  call). Returns (Heads, adapters); export writes both as one asset (`medusa2.load_medusa2`).
  Held-out metrics: the heads' top-1 / top-5 per head, "kl" and "heads_loss".
  init: start from trained Medusa-1 heads (a file or shipped name, e.g. "smollm2-135m-medusa";
  their head count and vocabulary subset are kept, vocab_size is then ignored) instead of fresh
  ones: the heads are then already warm, so warmup_heads can be 0."""
  sites = lora.check_sites(sites)
  medusa2.check_args(kl_weight=kl_weight, rank=rank, backbone_lr=backbone_lr,
                     warmup_heads=warmup_heads, steps=steps)
  if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
    raise InputError(f"alpha={alpha!r} is invalid: must be a number > 0")
  per_kind = _heads_per_kind(("medusa",), num_heads)  # None: 4, or the init's count
  _check_args(("medusa",), per_kind, export=export, num_layers=num_layers,
              vocab_size=vocab_size, batch_size=batch_size, seq_len=seq_len,
              max_held_out_windows=max_held_out_windows, unroll=1, taps=())
  with folders.removed_on_failure(out_dir, trainer.has_checkpoint):
    inits = {} if init is None else _load_inits(init, ("medusa",), num_heads, per_kind)
    config, corpus, target, target_name = setup_run(
        target, corpus, held_out=held_out, vocab_size=0 if inits else vocab_size, out_dir=out_dir,
        steps=steps, lr=lr, warmup=warmup, weight_decay=0.0, grad_clip=grad_clip,
        ckpt_every=ckpt_every, eval_every=eval_every, seed=seed, max_minutes=max_minutes,
        progress=progress, clip_groups=True, group_lr=(("lora", float(backbone_lr), int(warmup_heads)),))
    adapters = lora.init(target, rank, sites, seed)  # the rank against the target's widths
    tok, mask, held = _windows(corpus, seq_len, held_out, seed, max_held_out_windows, batch_size,
                               log)
    valid = response_valid(mask)
    heads_by, _ = _starting_heads(inits, init, target, ("medusa",), per_kind, tok, mask,
                                  vocab_size=vocab_size, num_layers=num_layers, seed=seed,
                                  taps=(), log=log)
    heads = heads_by["medusa"]
    num_heads = heads.config.num_heads
    frozen = frozen_arrays(target, heads)
    batches = trainer.row_batches((tok, valid, mask), batch_size, seed)
    loss_fn = medusa2.make_loss(target, heads, kl_weight=kl_weight, scale=alpha / rank)
    res = trainer.train({"heads": _f32(heads.params), "lora": adapters}, loss_fn, batches, config,
                        held_out=held, frozen=frozen, log=log,
                        title=f"medusa2: {num_heads} heads, LoRA r={rank} on "
                              f"{','.join(sites)}, kl {kl_weight}")
    held_k = {k: float(v) for k, v in (res.held_out or {}).items()}
    h = dataclasses.replace(heads, params=jax.tree_util.tree_map(
        lambda x, y: jnp.asarray(x, y.dtype), res.params["heads"], heads.params),
        meta={"held_out": held_k, "steps": res.step})
    if held_k:
      log("medusa2 held-out top-1 / top-5 per head: " + ", ".join(
          f"{a:.3f} / {b:.3f}" for a, b in medusa.accuracy_table(held_k, num_heads))
          + f"; KL(original || adapted) {held_k.get('kl', float('nan')):.4f}")
    if export:
      meta = dict(target=target_name, steps=res.step, lr=lr, batch_size=batch_size,
                  seq_len=seq_len, kl_weight=kl_weight, backbone_lr=backbone_lr,
                  warmup_heads=warmup_heads, held_out=held_k,
                  init=None if init is None else str(init),
                  corpus={c: corpus.meta[c] for c in ("model", "vocab_size", "weights_sha256")
                          if c in corpus.meta})
      medusa2.save(h, res.params["lora"], export, rank=rank, alpha=alpha, sites=sites, meta=meta)
      log(f"export: wrote {export}")
    return h, res.params["lora"]


# ----------------------------------------------------------------------------- phases


def _heads_per_kind(kinds: tuple, num_heads) -> dict:
  """num_heads (None, an int for one kind, or a dict kind -> int) -> kind -> head count."""
  if isinstance(num_heads, dict):
    unknown = sorted(set(num_heads) - set(kinds))
    if unknown:
      raise InputError(f"num_heads names kinds that are not trained here: {', '.join(unknown)}")
    return {k: num_heads.get(k, DEFAULT_NUM_HEADS[k]) for k in kinds}
  if num_heads is None:
    return {k: DEFAULT_NUM_HEADS[k] for k in kinds}
  if len(kinds) > 1:
    raise InputError(f"num_heads={num_heads!r} is ambiguous for several kinds: give a dict, e.g. "
                     f"{{'medusa': 4, 'mtp': 2}}")
  return {kinds[0]: num_heads}


def _check_args(kinds: tuple, per_kind: dict, *, export, num_layers, vocab_size, batch_size,
                seq_len, max_held_out_windows, unroll, taps) -> None:
  """Every check that needs neither the target nor the corpus, before anything loads."""
  joint = len(kinds) > 1
  if export is not None and joint and "{kind}" not in export:
    raise InputError(f"export={export!r} must contain '{{kind}}' when training several kinds "
                     f"(one file per kind, e.g. 'heads-{{kind}}.npz')")
  for k in kinds if export is not None else ():  # now: it would fail only after training
    validate.writable_file("export", str(export).replace("{kind}", k))
  for k, v in per_kind.items():
    check_int("num_heads" if not joint else f"num_heads[{k!r}]", v, 1)
  for arg, v, lo in (("num_layers", num_layers, 1),
                     ("vocab_size", vocab_size, 0), ("batch_size", batch_size, 1),
                     ("seq_len", seq_len, max(per_kind.values()) + 3),
                     ("max_held_out_windows", max_held_out_windows, 1)):
    check_int(arg, v, lo)
  check_int("unroll", unroll, 1)
  if joint and set(kinds) & set(ALONE):
    raise InputError(f"kind={','.join(kinds)!r}: EAGLE-3 and DFlash heads train alone (they "
                     f"read other target features than the rest)")
  if "eagle3" in kinds and (per_kind["eagle3"] != 1 or num_layers != 1):
    raise InputError(f"num_heads={per_kind['eagle3']}, num_layers={num_layers}: an EAGLE-3 head "
                     f"is one module of one layer")
  if unroll > 1 and "eagle" not in kinds and "eagle3" not in kinds:
    raise InputError(f"unroll={unroll} applies to EAGLE heads only (kinds: {', '.join(kinds)})")
  if taps and "eagle" not in kinds:
    raise InputError(f"taps={taps!r} applies to EAGLE heads only (kinds: {', '.join(kinds)})")
  if taps and taps != "auto":
    check_taps(taps)  # the format now; the range once the target is loaded
  if unroll + 2 > seq_len:
    raise InputError(f"unroll={unroll} needs seq_len >= unroll + 2 (got {seq_len})")


def _load_inits(init, kinds: tuple, num_heads, per_kind: dict) -> dict:
  """init ("{kind}" standing for each kind) -> kind -> loaded Heads; per_kind takes their head
  counts. Their fit to the target is checked once it is loaded (`_from_inits`)."""
  if len(kinds) > 1 and "{kind}" not in str(init):
    raise InputError(f"init={init!r} must contain '{{kind}}' when training several kinds")
  inits = {}
  for k in kinds:
    path = str(init).replace("{kind}", k)
    h = load_heads(path)
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
  return inits


def _windows(corpus, seq_len: int, held_out: float, seed: int, max_held_out_windows: int,
             batch_size: int, log):
  """The corpus's training windows tok, mask [N,T] and its held-out batches (tokens, valid,
  mask), each [batch_size,T], the last padded with rows that count nothing."""
  tok, mask = corpus.windows(seq_len, "train", held_out, seed)
  if not mask.any():
    raise InputError(f"corpus {getattr(corpus, 'path', '')}: no training windows with response "
                     f"tokens (held_out={held_out}, seq_len={seq_len})")
  vtok, vmask = corpus.windows(seq_len, "heldout", held_out, seed)
  vtok, vmask = vtok[:max_held_out_windows], vmask[:max_held_out_windows]
  vvalid = response_valid(vmask)
  log(f"data: {len(tok)} training windows ({int(mask.sum())} response positions), "
      f"{len(vtok)} held-out windows")
  held = []
  if len(vtok):
    pad = -len(vtok) % batch_size
    vtok = np.concatenate([vtok, np.zeros((pad, seq_len), np.int32)])
    vvalid = np.concatenate([vvalid, np.zeros((pad, seq_len), bool)])
    vmask = np.concatenate([vmask, np.zeros((pad, seq_len), bool)])
    held = [tuple(jnp.asarray(a[i:i + batch_size]) for a in (vtok, vvalid, vmask))
            for i in range(0, len(vtok), batch_size)]
  return tok, mask, held


def _starting_heads(inits: dict, init, target, kinds: tuple, per_kind: dict, tok, mask, *,
                    vocab_size: int, num_layers: int, seed: int, taps: tuple, dflash=None, log):
  """The heads training starts from: the loaded `inits` (trained heads named by `init`) if any,
  else fresh ones. Returns (kind -> Heads, their vocabulary subset or None)."""
  if inits:
    return _from_inits(inits, target, taps, init, log)
  if kinds == ("dflash",):  # the whole vocabulary (it scores through the target's own head)
    return {"dflash": init_heads(target, "dflash", num_layers=num_layers, seed=seed,
                                 **(dflash or {}))}, None
  return _fresh_heads(target, kinds, per_kind, tok, mask, vocab_size=vocab_size,
                      num_layers=num_layers, seed=seed, taps=taps, log=log)


def _from_inits(inits: dict, target, taps: tuple, init, log):
  """Trained heads to start from, checked against the target and cast to its dtype (an unfused
  EAGLE head grown to `taps`). Returns (kind -> Heads, their vocabulary subset or None)."""
  for h in inits.values():
    check_fits(h, target)
  vocab = next(iter(inits.values())).vocab
  heads_by = {k: dataclasses.replace(h, params=jax.tree_util.tree_map(
      lambda x: jnp.asarray(x, target.dtype), h.params)) for k, h in inits.items()}
  if taps:
    heads_by["eagle"] = add_taps(heads_by["eagle"], taps, target)
  log(f"init: {init} ({', '.join(f'{k}: {h.config.num_heads}' for k, h in inits.items())} "
      f"heads, Vs={'all' if vocab is None else len(vocab)})")
  _log_taps(heads_by, log)
  return heads_by, vocab


def _fresh_heads(target, kinds: tuple, per_kind: dict, tok, mask, *, vocab_size: int,
                 num_layers: int, seed: int, taps: tuple, log):
  """Untrained heads of every kind over one vocabulary subset: the `vocab_size` most frequent
  next tokens of the training windows (0: the full vocabulary). Returns (kind -> Heads, vocab)."""
  vocab = None
  if vocab_size:
    nxt = tok[:, 1:][mask[:, :-1]]
    vocab = vocab_subset(np.bincount(nxt, minlength=target.config.vocab_size), vocab_size)
  heads_by = {k: init_heads(target, k, num_heads=per_kind[k], num_layers=num_layers, seed=seed,
                            vocab=vocab, taps=taps if k == "eagle" else ())
              for k in kinds}
  _log_taps(heads_by, log)
  return heads_by, vocab


def _log_taps(heads_by: dict, log) -> None:
  if "eagle" in heads_by and heads_by["eagle"].config.taps:
    log(f"eagle: fused features from the outputs of layers {list(heads_by['eagle'].config.taps)} "
        f"and the last")


def _f32(tree):
  return jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), tree)


def _finish(kind: str, h, res, joint: bool, num_heads: int, export, meta: dict, log):
  """One kind's trained Heads from the trainer's result (cast back to the heads' dtype, held-out
  metrics and steps in `meta`), logged and, with export, saved ("{kind}" in the path)."""
  held_all = {k: float(v) for k, v in (res.held_out or {}).items()}
  trained = res.params[kind] if joint else res.params
  held_k = ({name[len(kind) + 1:]: v for name, v in held_all.items()
             if name.startswith(kind + "/")} if joint else held_all)
  h = dataclasses.replace(h, params=jax.tree_util.tree_map(
      lambda x, y: jnp.asarray(x, y.dtype), trained, h.params),
      meta={"held_out": held_k, "steps": res.step})
  if held_k and kind == "medusa":
    table = medusa.accuracy_table(held_k, num_heads)
    log("medusa held-out top-1 / top-5 per head: " + ", ".join(
        f"{a:.3f} / {b:.3f}" for a, b in table))
  if export:
    path = export.replace("{kind}", kind)
    save_heads(h, path, meta={"target": meta["target"], "kind": kind,
                              **{k: v for k, v in meta.items() if k != "target"}})
    log(f"export: wrote {path}")
  return h
