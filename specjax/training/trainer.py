"""One training loop for every drafter kind (draft models, Medusa / EAGLE / MTP heads).

A drafter trainer supplies three things and gets the rest from `train`:

    params                      the trainable pytree (frozen tensors: closed over, or `frozen=`)
    loss_fn(params, batch, rng) -> (loss scalar, metrics dict of scalars)
    batches(step) -> batch      a pure function of the step (and the seed it closes over), so a
                                resumed run sees exactly the batches the killed one would have

`train` runs optax AdamW (linear warmup, cosine decay to `final_lr` x lr, global-norm gradient
clipping) with one jitted update step, evaluates on fixed held-out batches every `eval_every`
steps, saves orbax checkpoints (params, optimizer state, step, seed) every `ckpt_every` steps, at
the end and when interrupted (Ctrl-C, or SIGTERM: `kill PID`, a job scheduler's stop; also SIGINT
in a background job, where the shell ignores it), and resumes from the latest one when called
again with the same out_dir. Per run, out_dir holds:

    ckpt/         orbax checkpoints (the latest `keep`)
    log.jsonl     one line per logged step: {"step", "split": "train" | "heldout", "loss", "lr",
                  "seconds", <metrics>}; a resumed run drops the lines after its checkpoint
    train.png     loss and metric curves (train and held-out), rewritten at every checkpoint
    config.json   the TrainConfig of the latest call

The random key handed to loss_fn at step s is fold_in(key(seed), s), also a pure function of
(seed, step): an interrupted and resumed run reaches the same parameters as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import signal
import threading
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import compile_options, distributed
from specjax.errors import InputError, check_int

LOG_FILE, PLOT_FILE, CONFIG_FILE, CKPT_DIR = "log.jsonl", "train.png", "config.json", "ckpt"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Optimisation and bookkeeping settings of one run (see the module docstring).

  warmup: linear warmup steps from 0 to lr (capped at steps - 1); then cosine decay to
  final_lr * lr at `steps`. weight_decay applies to tensors with >= 2 dims only (not to norms or
  biases). grad_clip: global-norm clipping threshold (0: off). max_minutes: stop early (with a
  checkpoint) after this much training time in this call (0: no limit). log_every: steps between
  train lines in log.jsonl (the first and last step are always logged). clip_groups: params is a
  dict of independent groups (several drafters trained at once) and grad_clip applies to each
  group's gradients on its own; each group's norm is logged as "<group>/grad_norm".
  group_lr: ((group, factor, start), ...): params is a dict of groups and group `group` learns
  at factor x the schedule's rate from step `start` on, not at all before (Medusa-2: the
  backbone's adapters at a lower rate, after the heads' warm-up); other groups at the schedule's.
  """
  out_dir: str
  steps: int = 1000
  lr: float = 1e-3
  warmup: int = 100
  weight_decay: float = 0.0
  grad_clip: float = 1.0
  final_lr: float = 0.05
  ckpt_every: int = 100
  eval_every: int = 100
  log_every: int = 10
  seed: int = 0
  max_minutes: float = 0.0
  keep: int = 2
  progress: bool = True
  clip_groups: bool = False
  group_lr: tuple = ()

  def validate(self) -> None:
    """Raises InputError naming the first bad field."""
    for entry in self.group_lr:
      ok = (isinstance(entry, (tuple, list)) and len(entry) == 3 and isinstance(entry[0], str)
            and isinstance(entry[1], (int, float)) and not isinstance(entry[1], bool)
            and math.isfinite(entry[1]) and entry[1] >= 0 and isinstance(entry[2], int)
            and not isinstance(entry[2], bool) and entry[2] >= 0)
      if not ok:
        raise InputError(f"group_lr entry {entry!r} is invalid: (group name, factor >= 0, "
                         f"start step >= 0)")
    if not isinstance(self.out_dir, (str, os.PathLike)) or not os.fspath(self.out_dir):
      raise InputError(f"out_dir={self.out_dir!r} is invalid: must be a directory path")
    for name, lo in (("steps", 1), ("warmup", 0), ("ckpt_every", 1), ("eval_every", 1),
                     ("log_every", 1), ("seed", 0), ("keep", 1)):
      check_int(name, getattr(self, name), lo)
    for name, lo, hi, open_lo in (("lr", 0.0, math.inf, True), ("weight_decay", 0.0, math.inf, False),
                                  ("grad_clip", 0.0, math.inf, False), ("final_lr", 0.0, 1.0, False),
                                  ("max_minutes", 0.0, math.inf, False)):
      v = getattr(self, name)
      ok = (isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
            and math.isfinite(v) and (v > lo if open_lo else v >= lo) and v <= hi)
      if not ok:
        bound = f"> {lo}" if open_lo else f">= {lo}"
        raise InputError(f"{name}={v!r} is invalid: must be a finite number {bound}"
                         + (f" and <= {hi}" if hi != math.inf else ""))


@dataclasses.dataclass
class TrainResult:
  """What `train` returns. held_out: the held-out metrics at the last step (None without
  held-out batches); resumed_from: the checkpoint step this call started from (None: fresh)."""
  params: object
  step: int
  held_out: dict | None
  resumed_from: int | None
  out_dir: str


# ----------------------------------------------------------------------------- data order


@functools.lru_cache(maxsize=4)
def _permutation(n: int, seed: int, epoch: int) -> np.ndarray:
  return np.random.default_rng([seed, epoch]).permutation(n)


def batch_rows(n: int, batch_size: int, seed: int, step: int) -> np.ndarray:
  """[batch_size] int: the rows of an n-row dataset that training step `step` reads.

  Epoch e visits the rows in the order permutation(seed, e); step s reads positions
  [s * batch_size, (s + 1) * batch_size) of the concatenated epochs. A pure function of its
  arguments, so any step's batch can be rebuilt after a resume without replaying the others.
  """
  check_int("n", n, 1)
  check_int("batch_size", batch_size, 1)
  out: list[np.ndarray] = []
  pos, need = step * batch_size, batch_size
  while need:
    epoch, off = divmod(pos, n)
    take = _permutation(n, seed, epoch)[off:off + need]
    out.append(take)
    pos, need = pos + len(take), need - len(take)
  return np.concatenate(out)


def row_batches(arrays: Sequence[np.ndarray], batch_size: int, seed: int) -> Callable:
  """batches(step) -> the tuple of `arrays`' rows (all of one length) that step reads
  (`batch_rows`), as device arrays: what `train` draws its batches from."""
  def batches(step):
    rows = batch_rows(len(arrays[0]), batch_size, seed, step)
    return tuple(jnp.asarray(a[rows]) for a in arrays)
  return batches


# ----------------------------------------------------------------------------- optimiser


def schedule(config: TrainConfig):
  """step -> learning rate: linear warmup from 0, then cosine decay to final_lr * lr."""
  import optax

  warmup = min(config.warmup, config.steps - 1)
  return optax.warmup_cosine_decay_schedule(0.0, config.lr, warmup, max(config.steps, warmup + 1),
                                            config.lr * config.final_lr)


def optimizer(config: TrainConfig):
  """optax AdamW on the schedule, after global-norm clipping; no decay on 0-/1-dim tensors."""
  import optax

  decay_mask = lambda params: jax.tree_util.tree_map(lambda x: jnp.ndim(x) >= 2, params)
  adamw = optax.adamw(schedule(config), weight_decay=config.weight_decay, mask=decay_mask)
  if config.group_lr:
    base = schedule(config)
    rates = {g: (lambda step, f=float(f), s=int(s): jnp.where(step < s, 0.0, f * base(step)))
             for g, f, s in config.group_lr}
    txs = {g: optax.adamw(r, weight_decay=config.weight_decay, mask=decay_mask)
           for g, r in rates.items()}
    txs["__rest__"] = adamw
    labels = lambda params: {g: jax.tree_util.tree_map(  # noqa: E731
        lambda _, g=g: g if g in rates else "__rest__", sub) for g, sub in params.items()}
    adamw = optax.multi_transform(txs, labels)
  if config.grad_clip > 0 and not config.clip_groups:  # groups are clipped in `train`
    return optax.chain(optax.clip_by_global_norm(config.grad_clip), adamw)
  return adamw


# ----------------------------------------------------------------------------- log and plot


def read_log(out_dir: str) -> list[dict]:
  """The run's log.jsonl lines as dicts (empty when there is none)."""
  path = os.path.join(out_dir, LOG_FILE)
  if not os.path.isfile(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _truncate_log(out_dir: str, step: int) -> list[dict]:
  """Keeps the log lines up to `step` (a resumed run redoes the later ones); returns them."""
  rows = [r for r in read_log(out_dir) if r["step"] <= step]
  text = "".join(json.dumps(r) + "\n" for r in rows)
  distributed.write_text_once(os.path.join(out_dir, LOG_FILE), text, "training log")
  return rows


_NOT_PLOTTED = {"step", "split", "loss", "lr", "seconds", "count", "grad_norm"}


def plot(out_dir: str, title: str = "") -> str:
  """Writes out_dir/train.png from log.jsonl: loss (left) and the other metrics (right), train
  as lines and held-out as markers. Uses the Agg canvas directly (no pyplot, no global backend)."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  rows = read_log(out_dir)
  fig = Figure(figsize=(10, 4))
  FigureCanvasAgg(fig)
  ax_loss, ax_metric = fig.subplots(1, 2)
  for split, style in (("train", dict(lw=1, alpha=0.8)), ("heldout", dict(marker="o", ls="--"))):
    rs = [r for r in rows if r.get("split") == split]
    if not rs:
      continue
    ax_loss.plot([r["step"] for r in rs], [r["loss"] for r in rs], label=split, **style)
    names = sorted({k for r in rs for k in r
                    if k not in _NOT_PLOTTED and not k.endswith("/grad_norm")})
    for name in names:
      pts = [(r["step"], r[name]) for r in rs if name in r]
      ax_metric.plot(*zip(*pts), label=f"{name} ({split})", **style)
  ax_loss.set(xlabel="step", ylabel="loss", title="loss")
  ax_metric.set(xlabel="step", title="metrics")
  for ax in (ax_loss, ax_metric):
    n = len(ax.get_legend_handles_labels()[0])
    if n:  # several drafters trained at once log many metrics: a smaller legend in columns
      ax.legend(fontsize=8 if n <= 8 else 6, ncol=1 + n // 16)
    ax.grid(alpha=0.3)
  if title:
    fig.suptitle(title)
  import warnings

  with warnings.catch_warnings():  # a crowded legend may not fit: the plot is still written
    warnings.simplefilter("ignore", UserWarning)
    fig.tight_layout()
  path = os.path.join(out_dir, PLOT_FILE)
  fig.savefig(path, dpi=100)
  return path


# ----------------------------------------------------------------------------- the loop


def prepare_out_dir(out_dir: str) -> str:
  """Creates out_dir if needed; InputError unless it is a writable directory. Returns its
  absolute path."""
  out_dir = os.path.abspath(os.fspath(out_dir))
  try:
    os.makedirs(out_dir, exist_ok=True)
    probe = os.path.join(out_dir, f".write_probe.{os.getpid()}")  # processes probe at once
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise InputError(f"out_dir={out_dir!r} is not a writable directory ({e.strerror or e})") from e
  return out_dir


def has_checkpoint(out_dir: str) -> bool:
  """Whether out_dir holds a saved training step (orbax names each step's folder by its number):
  a run there resumes, so a failed call never removes it."""
  ckpt = os.path.join(os.fspath(out_dir), CKPT_DIR)
  return os.path.isdir(ckpt) and any(n.isdigit() for n in os.listdir(ckpt))


class Terminated(SystemExit):
  """SIGTERM (or an otherwise ignored SIGINT) arrived during `train`: it saved a checkpoint at the
  step it had reached and stopped (exit status 128 + the signal's number)."""


def _catch_stop_signals() -> Callable[[], None]:
  """While training, SIGTERM, and SIGINT where it is ignored (a shell's background job), raise
  Terminated in the loop, which saves a checkpoint on its way out (Ctrl-C already raises
  KeyboardInterrupt). Returns the function that puts the previous handlers back. Handlers can
  only be set from the main thread; elsewhere nothing changes."""
  if threading.current_thread() is not threading.main_thread():
    return lambda: None

  def stop(signum, frame):
    raise Terminated(128 + signum)

  old = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
  signal.signal(signal.SIGTERM, stop)
  if old[signal.SIGINT] == signal.SIG_IGN:
    signal.signal(signal.SIGINT, stop)
  return lambda: [signal.signal(sig, handler) for sig, handler in old.items()]


def _mean_metrics(per_batch: list[tuple[float, dict]]) -> dict:
  """Batch metrics averaged with weights metrics['count'] (default 1): a batch's metrics are
  means over its `count` positions, so padding rows (count 0) weigh nothing."""
  weights = [float(m.get("count", 1.0)) for _, m in per_batch]
  total = sum(weights) or 1.0
  out = {"loss": sum(w * l for w, (l, _) in zip(weights, per_batch)) / total}
  for k in per_batch[0][1]:
    if k != "count":
      out[k] = sum(w * float(m[k]) for w, (_, m) in zip(weights, per_batch)) / total
  out["count"] = sum(weights)
  return out


def train(params, loss_fn: Callable, batches: Callable[[int], object], config: TrainConfig, *,
          held_out: Sequence = (), eval_fn: Callable | None = None, frozen=None,
          callback: Callable | None = None, log: Callable = print,
          title: str = "") -> TrainResult:
  """Trains `params` to minimise loss_fn; resumable (call again with the same config.out_dir).

  params: a pytree of float arrays (the trainable tensors only).
  loss_fn(params, batch, rng) -> (loss, metrics): differentiated w.r.t. params; small frozen
    tensors can be closed over (large ones: see `frozen`). metrics: a dict of scalars; an
    optional "count" is the number of positions they average over (weights held-out batches).
  batches(step) -> batch: the training batch of step `step` (0-based), a pure function of the
    step (see `batch_rows`); every batch must have the same shapes (one compiled update).
  held_out: fixed batches, evaluated at the start of a fresh run (logged as step 0), every
    `eval_every` steps and at the end with eval_fn (default loss_fn; same signature, no
    gradient), averaged by "count".
  frozen: a pytree of tensors the losses read but do not train (e.g. the target's params); when
    given, loss_fn and eval_fn are called as f(params, batch, rng, frozen). Large frozen tensors
    belong here rather than in a closure: jit bakes closed-over arrays into the program as
    constants (slow to compile, a second copy in memory).
  callback(step, params, metrics): called after each step (and its checkpoint); raising from it
    stops training, after saving a checkpoint at that step.
  Returns TrainResult(params, step, held_out metrics at the end, resumed_from, out_dir).
  """
  _check_train_args(params, loss_fn, batches, config)
  held_out = list(held_out)
  run = _Run(config, title, frozen)
  opt = optimizer(config)
  run.params = jax.tree_util.tree_map(jnp.array, params)  # our own copy: the caller's stays intact
  run.opt_state = opt.init(run.params)
  key = jax.random.key(config.seed)
  run.resume(log)
  options = compile_options.options()
  update = jax.jit(_update_step(loss_fn, opt, key, config), compiler_options=options)
  evaluate = jax.jit(eval_fn or loss_fn, compiler_options=options)
  eval_key = jax.random.fold_in(key, 2**32 - 1)  # never a training step

  def held_out_metrics():
    return _mean_metrics([(float(l), {k: float(v) for k, v in m.items()})
                          for l, m in (evaluate(run.params, b, eval_key, *run.extra)
                                       for b in held_out)])

  run.open_log()
  try:
    _loop(run, update, batches, held_out_metrics if held_out else None, callback, log)
  finally:
    run.close(log)
  if held_out and run.val_step != run.step:  # resumed at the end, or stopped early
    run.val = held_out_metrics()
  if run.step == run.resumed_from:
    log(f"train: nothing to do, the checkpoint is at step {run.step} of {config.steps}")
  run.mgr.close()
  if distributed.is_writer():
    plot(run.out_dir, title)
  return TrainResult(params=run.params, step=run.step, held_out=run.val,
                     resumed_from=run.resumed_from, out_dir=run.out_dir)


def _check_train_args(params, loss_fn, batches, config) -> None:
  """`train`'s argument checks, before anything is written or compiled."""
  if not isinstance(config, TrainConfig):
    raise InputError(f"config must be a TrainConfig, got {type(config).__name__}")
  config.validate()
  if not callable(loss_fn):
    raise InputError(f"loss_fn={loss_fn!r} is not callable")
  if not callable(batches):
    raise InputError(f"batches={batches!r} must be a function step -> batch")
  leaves = jax.tree_util.tree_leaves(params)
  if (config.clip_groups or config.group_lr) and not (isinstance(params, dict) and params):
    raise InputError("clip_groups / group_lr need params as a dict of groups {name: pytree}")
  unknown = [g for g, _, _ in config.group_lr if g not in params]
  if unknown:
    raise InputError(f"group_lr names group(s) {unknown} that params does not have "
                     f"({', '.join(map(str, params))})")
  if not leaves or not all(jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating) for x in leaves):
    raise InputError("params must be a non-empty pytree of floating-point arrays")


def _update_step(loss_fn, opt, key, config: TrainConfig):
  """One optimiser step (to jit): (params, opt_state, frozen, batch, step) -> (params, opt_state,
  loss, metrics), the step's key fold_in(key, step). metrics gain grad_norm (and per group,
  "<group>/grad_norm", each group clipped on its own with clip_groups)."""
  import optax

  def update(params, opt_state, frozen, batch, step):
    rng = jax.random.fold_in(key, step)
    args = () if frozen is None else (frozen,)
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, rng, *args)
    metrics = dict(metrics, grad_norm=optax.tree.norm(grads))
    if config.clip_groups:  # optax's clipping (stateless), applied to each group on its own
      grads = dict(grads)
      clip = optax.clip_by_global_norm(config.grad_clip)
      for g, sub in grads.items():
        metrics[f"{g}/grad_norm"] = optax.tree.norm(sub)
        if config.grad_clip > 0:
          grads[g], _ = clip.update(sub, clip.init(sub))
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, metrics

  return update


class _Run:
  """One `train` call's mutable state (params, optimiser state, step, the latest held-out
  metrics) and its files: orbax checkpoints, log.jsonl, config.json and the plot."""

  def __init__(self, config: TrainConfig, title: str, frozen):
    import orbax.checkpoint as ocp

    self.config, self.title, self.frozen = config, title, frozen
    self.extra = () if frozen is None else (frozen,)  # loss_fn / eval_fn's trailing argument
    self.out_dir = prepare_out_dir(config.out_dir)
    self.mgr = ocp.CheckpointManager(
        os.path.join(self.out_dir, CKPT_DIR),
        options=ocp.CheckpointManagerOptions(max_to_keep=config.keep,
                                             enable_async_checkpointing=False))
    self.params = self.opt_state = self.val = self.val_step = self.logf = None
    self.step, self.resumed_from, self.seconds, self.last_saved = 0, None, 0.0, 0
    self.t0 = time.time()

  def resume(self, log) -> None:
    """Restores the latest checkpoint (and cuts the log back to it) or starts a fresh log;
    writes config.json."""
    import orbax.checkpoint as ocp

    out_dir, config = self.out_dir, self.config
    if self.mgr.latest_step() is not None:
      self.resumed_from = self.step = step = int(self.mgr.latest_step())
      abstract = {"params": self.params, "opt": self.opt_state, "step": np.zeros((), np.int64),
                  "seed": np.zeros((), np.int64)}
      try:
        state = self.mgr.restore(step, args=ocp.args.StandardRestore(abstract))
      except (ValueError, KeyError, TypeError) as e:
        raise InputError(f"out_dir={out_dir!r} holds a checkpoint that does not fit these params "
                         f"(another drafter or shape?): {e}") from e
      if int(state["seed"]) != config.seed:
        raise InputError(f"out_dir={out_dir!r} holds a run with seed={int(state['seed'])}, not "
                         f"seed={config.seed}: resume with that seed or use another out_dir")
      self.params, self.opt_state = state["params"], state["opt"]
      rows = _truncate_log(out_dir, step)
      self.seconds = max((r.get("seconds", 0.0) for r in rows), default=0.0)
      log(f"train: resumed from checkpoint at step {step} in {out_dir}")
    else:
      _truncate_log(out_dir, 0)
    self.last_saved = self.step
    text = json.dumps(dataclasses.asdict(config), indent=1, default=str)
    distributed.write_text_once(os.path.join(out_dir, CONFIG_FILE), text, "training config")

  def open_log(self) -> None:
    # process 0 alone logs (orbax saves checkpoints across processes by itself)
    path = os.path.join(self.out_dir, LOG_FILE)
    self.logf = open(path if distributed.is_writer() else os.devnull, "a")
    self.t0 = time.time()

  def elapsed(self) -> float:
    """Training seconds over every call of this run (resumed ones included)."""
    return round(self.seconds + time.time() - self.t0, 3)

  def write(self, row: dict) -> None:
    self.logf.write(json.dumps(row) + "\n")
    self.logf.flush()

  def save(self, step: int) -> None:
    import orbax.checkpoint as ocp

    self.mgr.save(step, args=ocp.args.StandardSave({
        "params": self.params, "opt": self.opt_state, "step": np.asarray(step, np.int64),
        "seed": np.asarray(self.config.seed, np.int64)}), force=True)
    self.mgr.wait_until_finished()
    if distributed.is_writer():
      plot(self.out_dir, self.title)
    self.last_saved = step

  def close(self, log) -> None:
    """Saves the step reached if it is not saved yet (on an exception, Ctrl-C or SIGTERM too:
    rerunning resumes there) and closes the log."""
    if self.step != self.last_saved:
      self.save(self.step)
      log(f"train: stopped at step {self.step}, checkpoint saved; rerun to resume")
    self.logf.close()


def _loop(run: _Run, update, batches, held_out_metrics, callback, log) -> None:
  """The training steps from run.step to config.steps (or the time limit): log lines, held-out
  evaluations (held_out_metrics None: no held-out batches) and checkpoints on schedule."""
  from tqdm.auto import tqdm

  config = run.config
  lr_at = schedule(config)
  bar = tqdm(total=config.steps, initial=run.step, disable=not config.progress, desc="train",
             dynamic_ncols=True)
  restore_signals = _catch_stop_signals()
  try:
    if held_out_metrics and run.resumed_from is None:  # the starting point, for the plot
      run.val, run.val_step = held_out_metrics(), 0
      run.write({"step": 0, "split": "heldout", "seconds": 0.0, **run.val})
      log("train: step 0 held-out " + " ".join(f"{k} {v:.4f}" for k, v in run.val.items()))
    while run.step < config.steps:
      if config.max_minutes and time.time() - run.t0 > 60 * config.max_minutes:
        log(f"train: time limit ({config.max_minutes} min) at step {run.step}")
        break
      batch = batches(run.step)
      run.params, run.opt_state, loss, metrics = update(
          run.params, run.opt_state, run.frozen, batch, jnp.asarray(run.step, jnp.int32))
      run.step = step = run.step + 1
      bar.update(1)
      if step % config.log_every == 0 or step in (1, config.steps):
        m = {k: float(v) for k, v in metrics.items()}
        run.write({"step": step, "split": "train", "loss": float(loss),
                   "lr": float(lr_at(step - 1)), "seconds": run.elapsed(), **m})
        bar.set_postfix(loss=f"{float(loss):.3f}")
      if held_out_metrics and (step % config.eval_every == 0 or step == config.steps):
        run.val, run.val_step = held_out_metrics(), step
        run.write({"step": step, "split": "heldout", "seconds": run.elapsed(), **run.val})
        log(f"train: step {step} held-out " + " ".join(f"{k} {v:.4f}" for k, v in run.val.items()))
      if step % config.ckpt_every == 0 or step == config.steps:
        run.save(step)
      if callback is not None:
        callback(step, run.params, metrics)
  finally:
    bar.close()
    restore_signals()  # a second signal now acts as it would have before
