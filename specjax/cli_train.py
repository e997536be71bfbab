"""`specjax data | train | export`: building the self-distillation corpus, training drafters, and
writing heads in published layouts (the parsers and the commands)."""

from __future__ import annotations

import argparse

from specjax.cli_flags import DATA_FLAGS, DEFAULT_MODEL, TRAIN_FLAGS, _add_distributed, check_flags
from specjax.errors import InputError

def cmd_data_generate(args) -> None:
  from specjax.training import corpus

  check_flags(args, DATA_FLAGS)  # generate_corpus checks the out folder before the model loads
  c = corpus.generate_corpus(args.model, args.out, tokens=args.tokens, batch_size=args.batch_size,
                             micro_batch=args.micro_batch, max_new_tokens=args.max_new_tokens,
                             temperatures=args.temperatures,
                             seed=args.seed, max_minutes=args.max_minutes or None)
  print(c)


def cmd_data_throughput(args) -> None:
  import specjax as sj
  from specjax import bench, weights
  from specjax.training import corpus

  check_flags(args, DATA_FLAGS)
  weights.check_model(args.model)
  rows = corpus.measure_throughput(sj.load_model(args.model), args.batch_sizes,
                                   new_tokens=args.new_tokens)
  print(bench.format_table(rows, [("batch", "batch", "d"), ("tokens_per_second", "tok/s", ".1f"),
                                  ("step_ms", "ms/step", ".1f"), ("vs_batch1", "vs batch 1", ".2f")]))


def cmd_train_draft(args) -> None:
  from specjax.training import draft

  check_flags(args, TRAIN_FLAGS)  # train_draft checks --export and --out-dir before loading

  draft.train_draft(args.model, args.corpus, out_dir=args.out_dir, export=args.export,
                    num_layers=args.num_layers, vocab_size=args.vocab_size, steps=args.steps,
                    batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, warmup=args.warmup,
                    weight_decay=args.weight_decay, grad_clip=args.grad_clip,
                    soft_top_k=args.soft_top_k, held_out=args.held_out,
                    ckpt_every=args.ckpt_every, eval_every=args.eval_every,
                    max_minutes=args.max_minutes, seed=args.seed, init=args.init,
                    parallel=None if args.what != "pard" else {
                        "block_size": args.block_size, "mask_token": args.mask_token,
                        "anchors": args.anchors})


def _num_heads_arg(text):
  """--num-heads: "4" (one kind) or "medusa=4,mtp=2" (several kinds)."""
  if text is None or "=" not in text:
    try:
      return None if text is None else int(text)
    except ValueError:
      raise InputError(f"--num-heads={text!r} is invalid: an integer, or kind=count pairs like "
                       f"medusa=4,mtp=2") from None
  out = {}
  for part in text.split(","):
    k, _, v = part.partition("=")
    try:
      out[k.strip()] = int(v)
    except ValueError:
      raise InputError(f"--num-heads={text!r} is invalid: kind=count pairs like medusa=4,mtp=2") from None
  return out


def cmd_train_heads(args) -> None:
  from specjax.training import heads

  check_flags(args, TRAIN_FLAGS)  # train_heads checks --export and --out-dir before loading

  what = args.kinds if args.what == "heads" else args.what
  heads.train_heads(what, args.model, args.corpus, out_dir=args.out_dir, export=args.export,
                      num_heads=_num_heads_arg(args.num_heads), num_layers=args.num_layers,
                      vocab_size=args.vocab_size, steps=args.steps, batch_size=args.batch_size,
                      seq_len=args.seq_len, lr=args.lr, warmup=args.warmup,
                      weight_decay=args.weight_decay, grad_clip=args.grad_clip,
                      held_out=args.held_out, ckpt_every=args.ckpt_every,
                      eval_every=args.eval_every, max_minutes=args.max_minutes, seed=args.seed,
                      unroll=args.unroll, init=args.init, taps=args.taps or (),
                      dflash=_dflash_args(args))


def _dflash_args(args) -> dict | None:
  """`specjax train dflash`'s drafter shape (--block-size, --mask-token, --target-layers) and its
  loss's --loss-decay."""
  if args.what != "dflash":
    return None
  out = {"block_size": args.block_size, "mask_token_id": args.mask_token,
         "loss_decay": args.loss_decay, "anchors": args.anchors, "warm": args.warm}
  if args.target_layers:
    out["target_layer_ids"] = tuple(int(i) for i in args.target_layers.split(","))
  return out


def cmd_train_medusa2(args) -> None:
  from specjax.training import heads

  check_flags(args, TRAIN_FLAGS)
  heads.train_medusa2(args.model, args.corpus, out_dir=args.out_dir, export=args.export,
                      num_heads=args.num_heads, num_layers=args.num_layers,
                      vocab_size=args.vocab_size, rank=args.rank, alpha=args.alpha,
                      sites=args.lora_sites, kl_weight=args.kl_weight,
                      backbone_lr=args.backbone_lr, warmup_heads=args.warmup_heads,
                      steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                      lr=args.lr, warmup=args.warmup, grad_clip=args.grad_clip,
                      held_out=args.held_out, ckpt_every=args.ckpt_every,
                      eval_every=args.eval_every, max_minutes=args.max_minutes, seed=args.seed,
                      init=args.init)


def _add_data_commands(sub) -> None:
  """`specjax data generate | throughput`."""
  da = sub.add_parser("data", help="build the self-distillation corpus drafters train on")
  dsub = da.add_subparsers(dest="what", required=True)
  dg = dsub.add_parser("generate", help="the target's own responses to an evaluation-free prompt "
                       "pool, in resumable shards (rerun the same command to continue)")
  dg.add_argument("--model", default=DEFAULT_MODEL)
  dg.add_argument("--out", required=True, help="corpus directory")
  dg.add_argument("--tokens", default="2M", help="response tokens to produce, e.g. 2M or 500k")
  dg.add_argument("--batch-size", type=int, default=64, help="rows per shard")
  dg.add_argument("--micro-batch", type=int, default=16,
                  help="rows per generate call (a shard's rows, sorted by prompt length)")
  dg.add_argument("--max-new-tokens", type=int, default=256)
  dg.add_argument("--temperatures", default="0,0.7,1.0,0.8",
                  help="comma-separated; shard i samples at the (i mod n)-th (0 = greedy)")
  dg.add_argument("--max-minutes", type=float, default=0.0, help="stop after this long (0 = no limit)")
  dg.add_argument("--seed", type=int, default=0)
  dg.set_defaults(fn=cmd_data_generate)
  dt = dsub.add_parser("throughput", help="generation tokens/s by batch size")
  dt.add_argument("--model", default=DEFAULT_MODEL)
  dt.add_argument("--batch-sizes", default="1,16,32,64,128")
  dt.add_argument("--new-tokens", type=int, default=64)
  dt.set_defaults(fn=cmd_data_throughput)


# The flags every `specjax train` subcommand has, declared once (`_add_train_run`); the settings
# that differ between a draft model and heads (a draft trains longer, on larger batches) are
# given per subcommand as add_argument keywords by flag.
_TRAIN_RUN_FLAGS = (
    ("--model", dict(default=DEFAULT_MODEL)),
    ("--corpus", dict(required=True, help="a corpus directory (`specjax data generate`)")),
    ("--out-dir", {}),
    ("--export", dict(default=None)),
    ("--vocab-size", dict(type=int, default=8192)),
    ("--steps", dict(type=int)),
    ("--batch-size", dict(type=int)),
    ("--seq-len", dict(type=int, default=256)),
    ("--lr", dict(type=float, default=1e-3)),
    ("--warmup", dict(type=int)),
    ("--weight-decay", dict(type=float, default=0.0)),
    ("--grad-clip", dict(type=float, default=1.0)),
    ("--held-out", dict(type=float, default=0.02)),
    ("--ckpt-every", dict(type=int)),
    ("--eval-every", dict(type=int)),
    ("--max-minutes", dict(type=float, default=0.0)),
    ("--seed", dict(type=int, default=0)),
)

_DRAFT_RUN = {
    "--model": dict(help="the target"),
    "--out-dir": dict(default="runs/draft",
                      help="checkpoints, log.jsonl and train.png; rerunning resumes from here"),
    "--export": dict(help="write the draft asset (.npz) here when done"),
    "--vocab-size": dict(help="draft vocabulary subset size"),
    "--steps": dict(default=2000), "--batch-size": dict(default=8), "--warmup": dict(default=100),
    "--ckpt-every": dict(default=100), "--eval-every": dict(default=100),
    "--held-out": dict(help="fraction of corpus sequences held out"),
    "--max-minutes": dict(help="stop (with a checkpoint) after this long; 0: no limit"),
}

_HEADS_RUN = {
    "--export": dict(help="write the heads (.npz) here when done; several kinds: a path with "
                     "{kind}, e.g. heads-{kind}.npz"),
    "--vocab-size": dict(help="heads score the corpus's most frequent next tokens (0: the full "
                         "vocabulary)"),
    "--steps": dict(default=400), "--batch-size": dict(default=4), "--warmup": dict(default=40),
    "--ckpt-every": dict(default=50), "--eval-every": dict(default=50),
}

_HEADS_HELPS = {"medusa": "Medusa-1 heads (4 by default)", "eagle": "an EAGLE feature head",
                "mtp": "multi-token-prediction modules (2 by default)",
                "eagle3": "an EAGLE-3 head (SafeAILab's architecture; export it with "
                "`specjax export --format eagle3`)",
                "dflash": "a DFlash block-diffusion drafter (z-lab's architecture; export it "
                "with `specjax export --format dflash`)",
                "heads": "several kinds of heads at once (--kinds), sharing one target forward "
                "per batch"}


def _add_train_run(p: argparse.ArgumentParser, differ: dict) -> None:
  """The shared `specjax train` flags; differ: flag -> the add_argument keywords of this one."""
  for flag, kw in _TRAIN_RUN_FLAGS:
    p.add_argument(flag, **{**kw, **differ.get(flag, {})})
  _add_distributed(p, mesh=False)


def _add_train_commands(sub) -> None:
  """`specjax train draft | medusa | eagle | mtp | eagle3 | dflash | heads | medusa2`."""
  t = sub.add_parser("train", help="train speculation drafts")
  tsub = t.add_subparsers(dest="what", required=True)
  td = tsub.add_parser("draft", help="distil a small same-tokenizer draft from the target on its "
                       "self-distillation corpus (checkpoints in --out-dir; rerun to resume)")
  _add_train_run(td, _DRAFT_RUN)
  td.add_argument("--num-layers", type=int, default=None, help="the draft's layers (default 2; with "
                  "--init the asset's, and more grows it: new layers start as identities)")
  td.add_argument("--soft-top-k", type=int, default=0,
                  help="train on the target's top-k distribution (one target forward per step; "
                  "0: the corpus tokens)")
  td.add_argument("--init", default=None, help="start from this draft asset (.npz or a registered "
                  "name, e.g. smollm2-135m-draft) instead of the target's first layers")
  td.set_defaults(fn=cmd_train_draft)
  tp = tsub.add_parser("pard", help="teach a draft to fill mask tokens, drafting a block in one "
                       "forward (PARD; checkpoints in --out-dir; rerun to resume)")
  _add_train_run(tp, {**_DRAFT_RUN, "--out-dir": dict(default="runs/pard", help="checkpoints, "
                      "log.jsonl and train.png; rerunning resumes from here")})
  tp.add_argument("--init", default=None, help="start from this draft asset (.npz or a registered "
                  "name, e.g. smollm2-135m-draft) instead of the target's first layers")
  tp.add_argument("--num-layers", type=int, default=None, help="the draft's layers (as for "
                  "`train draft`)")
  tp.add_argument("--block-size", type=int, default=8, help="tokens drafted per forward: the "
                  "real one's next token and one per mask")
  tp.add_argument("--mask-token", type=int, required=True, help="the masks' token id: one the "
                  "corpus never holds (e.g. a special token)")
  tp.add_argument("--anchors", type=int, default=0, help="blocks scored per window (0: one per "
                  "block length)")
  tp.set_defaults(fn=cmd_train_draft, soft_top_k=0)
  for kind, what in _HEADS_HELPS.items():
    tm = tsub.add_parser(kind, help=f"train {what} on a frozen target over a corpus (orbax "
                         f"checkpoints in --out-dir; rerun to resume)")
    if kind == "heads":
      tm.add_argument("--kinds", default="eagle,medusa,mtp", help="comma-separated heads kinds")
    out_dir = dict(default=None if kind == "heads" else f"runs/{kind}",
                   help="default: runs/<kind> (several kinds: runs/<kind>+<kind>...)")
    _add_train_run(tm, {**_HEADS_RUN, "--out-dir": out_dir})
    tm.add_argument("--num-heads", default=None, help="default: 4 medusa, 1 eagle, 2 mtp; several "
                    "kinds: kind=count pairs, e.g. medusa=5,mtp=3")
    tm.add_argument("--num-layers", type=int, default=1, help="Medusa: residual blocks per head")
    tm.add_argument("--unroll", type=int, default=1, help="EAGLE: also learn to draft this many "
                    "steps ahead on its own features (training-time test; 1: next step only)")
    tm.add_argument("--init", default=None, help="start from these heads (.npz or a shipped name; "
                    "several kinds: with {kind}, e.g. smollm2-135m-{kind}) instead of fresh ones")
    tm.add_argument("--taps", default=None, help="EAGLE: fused features, the outputs of these "
                    "target layers beside the last (e.g. 2,15; 'auto': a low and a middle layer); "
                    "with --init from an unfused head, grows it")
    if kind == "dflash":
      tm.add_argument("--block-size", type=int, default=8, help="tokens per drafted block, the "
                      "last verified one included")
      tm.add_argument("--mask-token", type=int, required=True, help="the token id that fills a "
                      "block (one the text never uses)")
      tm.add_argument("--target-layers", default=None, help="0-based target layers read, e.g. "
                      "1,15,27 (default: --num-layers of them spread from layer 1 to L - 3)")
      tm.add_argument("--loss-decay", type=float, default=None, help="block offset j's loss "
                      "weighs exp(-(j - 1) / gamma); default: the paper's gamma for the block "
                      "size (4 at 8, 7 at 16); 0: every offset alike")
      tm.add_argument("--anchors", type=int, default=0, help="blocks per training window; "
                      "default (0): one per block length. More cost LM-head rows, not target "
                      "forwards")
      tm.add_argument("--warm", action="store_true", help="start the drafter as the target's "
                      "last --num-layers layers and final norm, fc passing the deepest tap "
                      "through, rather than from noise")
    tm.set_defaults(fn=cmd_train_heads)
  m2 = tsub.add_parser("medusa2", help="Medusa-2: Medusa heads and LoRA adapters on the target's "
                       "layers trained together, with KL(original || adapted) keeping the adapted "
                       "model close to the original (orbax checkpoints in --out-dir; rerun to "
                       "resume); the asset holds both")
  _add_train_run(m2, {**_HEADS_RUN, "--out-dir": dict(default="runs/medusa2"),
                      "--export": dict(help="write the Medusa-2 asset (heads + adapters, .npz)")})
  m2.add_argument("--num-heads", type=int, default=None, help="default: 4, or --init's count")
  m2.add_argument("--num-layers", type=int, default=1, help="residual blocks per head")
  m2.add_argument("--rank", type=int, default=8, help="LoRA rank")
  m2.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (the update is "
                  "alpha / rank x A B)")
  m2.add_argument("--lora-sites", default="wqkv,wo,w_in,w_out",
                  help="the layer matrices adapted (of wqkv, wo, w_in, w_out)")
  m2.add_argument("--kl-weight", type=float, default=1.0,
                  help="lambda: the weight of KL(original || adapted) in the loss")
  m2.add_argument("--backbone-lr", type=float, default=0.1,
                  help="the adapters' learning rate as a fraction of the heads'")
  m2.add_argument("--warmup-heads", type=int, default=50,
                  help="steps that train the heads alone before the adapters learn")
  m2.add_argument("--init", default=None, help="start from these Medusa-1 heads (.npz or a "
                  "shipped name, e.g. smollm2-135m-medusa) instead of fresh ones")
  m2.set_defaults(fn=cmd_train_medusa2)


def cmd_export(args) -> None:
  from specjax.drafters import export_files

  print(export_files(args.heads, args.format, args.out_dir, args.model))
