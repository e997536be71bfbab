"""Default settings chosen from the device's cost curve and the drafter's recorded acceptance.

Each registry factory with a size knob asks one function here for its defaults; explicit options
always win (a factory given any of a method's knobs skips the choice: the class fills the rest).
Every choice maximises the predicted speedup over autoregressive decoding at batch 1,

    speedup = tau / (c(tokens verified) + drafting cost),

c being the cost curve of the target on this device (specjax.calibrate: a T-token forward over a
one-token one) and tau the expected tokens per step from the drafter's held-out numbers, the ones
its training wrote into its file:

    draft        asset_header held_out_top1: the draft's argmax agrees with the target's, per token
    medusa       heads.meta held_out top1_k / top5_k per head (tree.per_rank_accuracy)
    eagle        heads.meta held_out top1, top1_2 .. top1_D: the head's top-1 at each unrolled depth
    mtp          heads.meta held_out top1_k: module k's top-1
    dflash       heads.meta held_out top1_k, top5_k: block offset k + 1 given offsets <= k agreed
    pard         asset_header held_out top1_k: the parallel draft's offset k + 1, alike
    layer-skip   nothing is recorded: LAYER_SKIP_PRIOR (measured at exit L/4 on SmolLM2-135M)
    quantized    nothing is recorded: QUANTIZED_PRIOR by bit width (measured on SmolLM2-135M)

Drafting costs are the bytes a drafter reads per forward over those the target reads (`reads`):
at batch 1 a forward streams its weights once, so that ratio is its cost in target forwards. The
bytes follow the arithmetic (`packing.dense_bytes`): a target on a GGUF's 4-bit blocks reads about
a sixth of float32's bytes per weight, and its drafters round their own weights to Q8_0 blocks
(`packing.drafter_qtype`).

Each function returns a Choice; `recorded` says whether tau rests on the drafter's recorded
acceptance rather than a prior (method="auto" reports which, see specjax/auto.py). Prompt lookup and lookahead record no acceptance (their
acceptance is the text's, not a drafter's): both are sized by the curve alone, to verify for
nearly the price of one token (`lookup_tokens`, `lookahead_shape`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specjax import tree as trees

MAX_GAMMA = 16  # the longest chain a default may draft (each gamma is its own compiled program)
MAX_NODES = 64  # the largest tree a default may verify
LAYER_SKIP_PRIOR = 0.1  # per-token acceptance of an untrained exit at L/4 (measured 0.01-0.09)
# Quantized self-drafting (methods/quantized.py): per-position acceptance by bit width, and one
# draft forward's cost in target steps, by (integer-dot kernel present, target arithmetic, bits).
# Rounded from measurements on SmolLM2-135M (the figures and how they were taken:
# experiments/quantized/README.md and draft_cost.md, experiments/blocks/README.md).
QUANTIZED_PRIOR = {4: 0.9, 8: 0.97}
# Prompt lookup copies at most LOOKUP_MAX_TOKENS (its class default), and only as many as verify
# for at most LOOKUP_FREE one-token forwards (lookup_tokens).
LOOKUP_MAX_TOKENS = 10
LOOKUP_FREE = 1.15
# Lookahead's (window, ngram, guess) shapes, smallest forward first (1 + (W + G)(N - 1) tokens); the
# last is the class's default (Fu et al.'s small setting), the first the least a step can verify.
LOOKAHEAD_SHAPES = ((1, 2, 1), (2, 2, 1), (2, 2, 2), (2, 3, 1), (3, 3, 2), (4, 3, 4))
QUANTIZED_COST = {("kernel", "float", 4): 0.4, ("kernel", "float", 8): 0.4,
                  ("kernel", "blocks", 4): 0.6, ("kernel", "blocks", 8): 0.75,
                  ("kernel", "w4a8", 4): 0.9, ("kernel", "w4a8", 8): 1.05,
                  # Without the kernel both widths run XLA's integer dot (measured at 4 bits); a
                  # W4A8 target's own products do too, so a draft costs about a target step.
                  ("jax", "float", 4): 1.5, ("jax", "float", 8): 1.5,
                  ("jax", "blocks", 4): 3.3, ("jax", "blocks", 8): 3.3,
                  ("jax", "w4a8", 4): 1.0, ("jax", "w4a8", 8): 1.0,
                  # On an accelerator the int8 draft is XLA's, its weights dequantized in every
                  # call: one 8-bit draft forward took 1.3 bf16 target steps on an H200
                  # (SmolLM2's shape; experiments/accelerator, 2026-11-28). 4 bits: not measured.
                  **{("accelerator", kind, bits): 1.3 for kind in ("float", "blocks", "w4a8")
                     for bits in (4, 8)}}
RANK_SHARE = 0.45  # rank r+1's accuracy over rank r's where only top-1 is recorded (as the prior)


@dataclasses.dataclass(frozen=True)
class Choice:
  """settings: the factory's chosen options ({} = the class's own defaults); speedup / tau: the
  prediction (None without one); table: [(size, tau, cost, speedup), ...]; basis: where tau came
  from; recorded: tau rests on the drafter's held-out numbers."""
  settings: dict
  speedup: float | None = None
  tau: float | None = None
  table: tuple = ()
  basis: str = "none"
  recorded: bool = False


def _layer(c) -> int:
  """Weights of one decoder layer of config c."""
  e, f = c.hidden_size, c.intermediate_size
  return (e * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * e
          + e * f * (3 if c.gated_mlp else 2))


def reads(target, layers: float = 0, extra: int = 0, rows: int | None = None, *,
          own: bool = True) -> float:
  """The bytes a drafter forward reads (`layers` decoder layers of the target's type, `extra`
  other weights, an LM head over `rows` tokens; None: no head) over those of a target forward.
  own: the layers, `extra` and a subset's head rows are the drafter's own, read at
  `packing.drafter_bytes` per weight (float32, or blocks beside a target on blocks); a head over
  the whole vocabulary is the target's own. own=False: all the target's (layer-skip's exit)."""
  from specjax.packing import dense_bytes, drafter_bytes

  c = target.config
  lb, hb = dense_bytes(target)
  db = drafter_bytes(target) if own else lb
  head = 0 if not rows else rows * c.hidden_size * (hb if rows == c.vocab_size or not own else db)
  full = c.num_layers * _layer(c) * lb + c.hidden_size * c.vocab_size * hb
  return ((layers * _layer(c) + extra) * db + head) / full


def _held(meta) -> dict:
  return (meta or {}).get("held_out") or {}


def _chain(cost, acceptance, draft_cost, max_gamma, basis, recorded=True,
           step_overhead: float = 0.0) -> Choice:
  r = trees.choose_chain(cost, acceptance, draft_cost=draft_cost, max_gamma=max_gamma,
                         step_overhead=step_overhead)
  return Choice({"gamma": r["gamma"]}, r["speedup"], r["tau"], tuple(r["table"]), basis, recorded)


def draft_gamma(target, draft, cost) -> Choice:
  """draft: gamma = argmax tau(g) / (c(g + 1) + g d), tau(g) = sum_{i<=g} a^i with a the draft's
  held-out top-1 agreement and d = reads(draft's layers + its head's rows) (Leviathan et al.)."""
  header = getattr(draft, "asset_header", None) or {}
  a = header.get("held_out_top1", _held(header).get("top1"))
  if a is None:
    return Choice({})
  return _chain(cost, [a], draft_reads(target, draft), MAX_GAMMA, f"draft held-out top-1 {a:.3f}")


def draft_reads(target, draft) -> float:
  """A draft model's forward in target forwards: the bytes its layers and head (a subset's rows
  where it has one) read over the target's."""
  from specjax.packing import dense_bytes, drafter_bytes

  vocab = getattr(draft, "vocab_subset", None)
  dc, tc = draft.config, target.config
  dl, dh = dense_bytes(draft)  # a subset's rows: as a drafter beside the draft reads them
  rows, dh = (dc.vocab_size, dh) if vocab is None else (len(vocab), drafter_bytes(draft))
  tl, th = dense_bytes(target)
  return (dc.num_layers * _layer(dc) * dl + dc.hidden_size * rows * dh) / (
      tc.num_layers * _layer(tc) * tl + tc.hidden_size * tc.vocab_size * th)


def pard_gamma(target, draft, cost) -> Choice:
  """pard: gamma = argmax tau(g) / (c(g + 1) + d), tau(g) = 1 + sum_i prod_{j<=i} top1_j (offset
  j's held-out top-1 given the offsets before it right, recorded by `specjax train pard`) and d
  the draft's reads as for `draft_gamma`, once: one draft forward per chain."""
  from specjax.shipped import parallel_settings

  held = _held(getattr(draft, "asset_header", None))
  block = int(parallel_settings(draft).get("block_size", 0))
  acc = [held[f"top1_{i}"] for i in range(block) if f"top1_{i}" in held]
  if not acc:
    return Choice({})
  return _chain(cost, acc, 0.0, min(len(acc), MAX_GAMMA), "pard held-out top-1 per block offset",
                step_overhead=draft_reads(target, draft))


def layer_skip_gamma(target, exit_layer: int, cost) -> Choice:
  """layer-skip: gamma = argmax tau(g) / (c(g + 1) + g d) with the prior a = LAYER_SKIP_PRIOR
  (no acceptance is recorded for an untrained exit) and d = reads(exit_layer layers + the head)."""
  d = reads(target, exit_layer, rows=target.config.vocab_size, own=False)
  return _chain(cost, [LAYER_SKIP_PRIOR], d, MAX_GAMMA, f"prior a={LAYER_SKIP_PRIOR}",
                recorded=False)


def quantized_gamma(target, bits: int, cost) -> Choice:
  """quantized: gamma = argmax tau(g) / (c(g + 1) + g q) with the prior a = QUANTIZED_PRIOR[bits]
  and q = QUANTIZED_COST for this kernel, target and device (no acceptance is recorded: the draft
  is the target itself, so nothing was trained or held out)."""
  from specjax import packing
  from specjax.kernels import qdot

  if bits not in QUANTIZED_PRIOR or isinstance(bits, bool):
    return Choice({})  # (the class names what is allowed)
  path = ("kernel" if qdot.available() else "jax") if packing.on_cpu_devices(target) else \
      "accelerator"
  kind = "float"
  if getattr(target, "weights", "") == "blocks":
    kind = "w4a8" if getattr(target, "activations", "") == "int8" else "blocks"
  a, q = QUANTIZED_PRIOR[bits], QUANTIZED_COST[(path, kind, bits)]
  return _chain(cost, [a], q, MAX_GAMMA, f"prior a={a} at {bits} bits, draft cost {q} ({path})",
                recorded=False)


def lookup_tokens(target, ngram, cost) -> Choice:
  """prompt-lookup: num_tokens = the largest k <= LOOKUP_MAX_TOKENS whose verification,
  c(k + 1), costs at most LOOKUP_FREE times a one-token forward (at least 1). No acceptance is
  recorded (a copy's length is the text's, not a drafter's), and where the output does not copy
  its context most matches are wrong: their whole verification is lost. So a copy is sized to be
  nearly free to verify on this device: all 10 tokens where the curve is flat (an accelerator),
  fewer where a wider forward costs more (a CPU). The measured speedups by k are
  experiments/training_free/pld_sweep.md's."""
  k = 1
  while k < LOOKUP_MAX_TOKENS and trees.interpolate_cost(cost, k + 2) <= LOOKUP_FREE * cost[1]:
    k += 1
  return Choice({"num_tokens": k}, None, None, (), f"c({k + 1}) <= {LOOKUP_FREE} c(1)", False)


def lookahead_shape(target, _, cost) -> Choice:
  """lookahead: (window, ngram, guess) = the largest of LOOKAHEAD_SHAPES whose step, one forward
  over 1 + (W + G)(N - 1) tokens, costs at most LOOKUP_FREE one-token forwards (at least the
  smallest). Lookahead's n-grams come from the text, not a trained drafter: nothing is recorded to
  predict tau from, and most steps accept nothing on chat, so, as prompt lookup's copy, its window
  is sized to be nearly free to verify: the class's (4, 3, 4) on a flat curve; (2, 2, 2) or
  (2, 3, 1) on this project's CPU, as its measured curve falls. The measured speedups by shape are
  experiments/training_free/lookahead_sweep.md's."""
  best = LOOKAHEAD_SHAPES[0]
  for shape in LOOKAHEAD_SHAPES[1:]:
    w, n, g = shape
    if trees.interpolate_cost(cost, 1 + (w + g) * (n - 1)) <= LOOKUP_FREE * cost[1]:
      best = shape
  w, n, g = best
  return Choice({"window": w, "ngram": n, "guess": g}, None, None, (),
                f"c({1 + (w + g) * (n - 1)}) <= {LOOKUP_FREE} c(1)", False)


def mtp_gamma(target, heads, cost) -> Choice:
  """mtp: gamma (modules that draft) = argmax tau(g) / (c(g + 1) + g m), tau(g) = 1 + sum_i
  prod_{j<=i} top1_j (module j's held-out top-1) and m = reads(one layer + fc 2E x E + head)."""
  held, k = _held(heads.meta), heads.config.num_heads
  acc = [held[f"top1_{i}"] for i in range(k) if f"top1_{i}" in held]
  if len(acc) < k:
    return Choice({})
  e = target.config.hidden_size
  m = reads(target, 1, 2 * e * e, heads.config.vocab_subset or heads.config.vocab_size)
  return _chain(cost, acc, m, k, "mtp held-out top-1 per module")


def dflash_block(target, heads, cost) -> Choice:
  """dflash: a chain or a tree, whichever predicts more tokens per second. Chain: block_size =
  gamma + 1, gamma = argmax tau(g) / (c(g + 1) + f), tau(g) = 1 + sum_i prod_{j<=i} top1_j (offset
  j's held-out top-1 given the offsets before it right). Tree (where the heads also record
  top-5 per offset): choose_budget's N on the per-rank accuracies (tree.per_rank_accuracy) with
  the same overhead, and the block its depth needs. f = reads(the drafter's layers + fc nE x E +
  head over the heads' vocabulary subset where they record one): one drafter forward per block,
  whatever its size or tree."""
  c = heads.config
  held = _held(heads.meta)
  acc = [held[f"top1_{i}"] for i in range(c.block_size - 1) if f"top1_{i}" in held]
  if not acc:
    return Choice({})
  e = target.config.hidden_size
  f = reads(target, c.num_layers, len(c.target_layer_ids) * e * e, c.vocab_subset or c.vocab_size)
  r = trees.choose_chain(cost, acc, max_gamma=min(len(acc), MAX_GAMMA), step_overhead=f)
  chain = Choice({"block_size": r["gamma"] + 1, "tree": None}, r["speedup"], r["tau"],
                 tuple(r["table"]), "dflash held-out top-1 per block offset", True)
  if not any(f"top5_{i}" in held for i in range(len(acc))):
    return chain
  ranks = trees.per_rank_accuracy(heads.meta, len(acc))
  t = trees.choose_budget(cost, ranks, max_nodes=MAX_NODES, step_overhead=f)
  if t["speedup"] <= r["speedup"]:
    return chain
  return Choice({"block_size": t["tree"].max_depth + 1, "tree": t["tree"]}, t["speedup"], t["tau"],
                tuple(t["table"]), "dflash held-out top-1 / top-5 per block offset", True)


def medusa_tree(target, heads, cost) -> Choice:
  """medusa: the tree of N nodes (build_tree on per-rank accuracies, tree.per_rank_accuracy) with
  N = argmax (1 + E[accepted](N)) / (c(N + 1) + h), h = reads(the K heads' blocks + one head
  over the subset): tree.choose_budget."""
  k = heads.config.num_heads
  acc = trees.per_rank_accuracy(heads.meta, k)
  if acc is None:
    return Choice({})
  c = heads.config
  h = reads(target, 0, k * c.num_layers * c.hidden_size ** 2, c.vocab_subset or c.vocab_size)
  r = trees.choose_budget(cost, acc, max_nodes=MAX_NODES, step_overhead=h)
  return Choice({"tree": r["tree"]}, r["speedup"], r["tau"], tuple(r["table"]),
                "medusa held-out top-1 / top-5 per head", True)


def eagle_accuracies(meta) -> np.ndarray | None:
  """[D, 5] per-depth, per-rank accuracies from EAGLE's held-out top-1 at each unrolled depth
  (top1, top1_2, ...); ranks below the first take RANK_SHARE of the rank above."""
  held, top1 = _held(meta), []
  for key in ["top1"] + [f"top1_{d}" for d in range(2, 65)]:
    if key not in held:
      break
    top1.append(float(held[key]))
  if not top1:
    return None
  return np.clip(np.array(top1)[:, None] * RANK_SHARE ** np.arange(5)[None, :], 0.0, 1.0)


def eagle_budget(target, heads, cost) -> Choice:
  """eagle: for each depth D up to the recorded ones, choose_budget's N on the accuracies of
  `eagle_accuracies` with overhead D f (f = reads(one layer + fc 2E x E + head over the subset):
  one head forward per depth); the best (N, D) wins, and top_k is the tree's widest rank (raised
  until EAGLE-2's expansion holds N nodes)."""
  acc = eagle_accuracies(heads.meta)
  if acc is None:
    return Choice({})
  c = heads.config
  f = reads(target, 1, 2 * c.hidden_size ** 2, c.vocab_subset or c.vocab_size)
  best = None
  for depth in range(1, len(acc) + 1):
    r = trees.choose_budget(cost, acc[:depth], max_nodes=MAX_NODES, step_overhead=depth * f)
    if best is None or r["speedup"] > best[1]["speedup"]:
      best = (depth, r)
  depth, r = best
  tree = r["tree"]
  n = tree.num_nodes  # (a head with few recorded ranks may grow fewer nodes than asked for)
  top_k = min(tree.ranks_needed(), n)
  while trees.capacity(tree.max_depth, top_k) < n:
    top_k += 1
  settings = {"num_nodes": n, "depth": tree.max_depth, "top_k": top_k}
  return Choice(settings, r["speedup"], r["tau"], tuple(r["table"]),
                "eagle held-out top-1 per depth", True)


# registry name -> (the chooser, the method's knobs: any of them given skips the choice, the
# attribute of a built method that holds what the chooser reads).
CHOOSERS = {
    "draft": (draft_gamma, ("gamma",), "draft"),
    "pard": (pard_gamma, ("gamma",), "draft"),
    "layer-skip": (layer_skip_gamma, ("gamma",), "exit_layer"),
    "medusa": (medusa_tree, ("tree",), "heads"),
    "eagle": (eagle_budget, ("tree", "num_nodes", "depth", "top_k"), "heads"),
    "mtp": (mtp_gamma, ("gamma",), "heads"),
    "dflash": (dflash_block, ("block_size", "tree"), "heads"),
    "prompt-lookup": (lookup_tokens, ("num_tokens",), "ngram"),
    "lookahead": (lookahead_shape, ("window", "ngram", "guess"), None),
    "quantized": (quantized_gamma, ("gamma",), "bits"),
}


def choose(name: str, target, drafter, options: dict) -> dict:
  """The options to build method `name` with: `options` as given, plus the chosen defaults
  (from the target's cost curve) unless one of the method's knobs is among them."""
  if name not in CHOOSERS:
    return dict(options)
  fn, knobs, _ = CHOOSERS[name]
  if any(options.get(k) is not None for k in knobs):
    return dict(options)
  from specjax import calibrate

  given = {k: v for k, v in options.items() if k not in knobs}  # (knobs given as None)
  return {**fn(target, drafter, calibrate.cost_curve(target)).settings, **given}


def predict(name: str, target, method, cost) -> Choice:
  """The Choice behind a built method's settings (for method="auto")."""
  fn, _, attr = CHOOSERS[name]
  return fn(target, getattr(method, attr) if attr else None, cost)
