"""Greedy exactness where arithmetic is not batch-invariant: a tie-aware comparison with
autoregressive decoding.

On the CPU kernels every method is token-identical to autoregressive greedy decoding, and the
lossless suite asserts identity. In bfloat16, and on accelerators in any dtype, a T-row product
can round differently from a one-row product (XLA tiles them differently), so where two logits
are nearly tied a method that verifies T tokens at once may pick the other one without anything
being wrong. What remains checkable is that every divergence is such a tie:

    check_greedy(model, prompts, reference, tokens) -> Report

finds each row's first divergence between the autoregressive tokens (`reference`) and a method's
(`tokens`), recomputes the autoregressive run's logits at that position by teacher forcing in
float32 (the model's parameters cast to float32, XLA's products at matmul precision "highest", no
kernel), and calls the divergence a tie when the two tokens' float32 logits there differ by at
most `bound`, a failure otherwise. Only the first divergence of a row is judged: after it the
two runs condition on different text. Rows identical to their reference are not listed.

The bound (`margin_bound`) is `ulps` units in the last place of the dtype the run computed in, at
the magnitude of the position's largest |logit|: ulp(m) = 2 ** (floor(log2 m) - (p - 1)), p the
significand's bits (bfloat16 8, float16 11, float32 24). Why that scale: model.py rounds the
logits themselves to the model's dtype (Decoder.head casts to float32 after the product), so two
logits a bf16 run compares are each off by up to half an ulp at their magnitude, one ulp between
them, from that last rounding alone; the hidden state they are products of is itself rounded in
bf16 at every layer, and a different tiling of any product upstream moves it by about an ulp of
its elements, which moves a logit by a few ulps of its magnitude (the error of a sum of E terms
grows about as sqrt(E) relative ulps, but the final norm keeps the hidden state at unit scale
and the logit inherits the relative error). ULPS (4 for bfloat16 and float16) covers those
with a margin while staying far below the margins that separate a real mistake (a wrong token
is typically many ulps from the top; the tests plant one at the row's lowest logit).
float32 runs use the same count of float32 ulps: at precision "highest" a divergence there is
almost surely a bug, and TF32 (an accelerator's default float32 precision) would need a bf16-like
bound, which is why the accelerator check sets "highest" for its float32 runs.

The criterion compares the two tokens that were actually picked, not the top two: where they
are the top two (the usual case) it is the top-2 margin against the bound; a token far below
the one autoregressive decoding picked fails even when the first two logits are tied. Both runs
compute in the same dtype, so a third token the float32 recomputation ranks above both does not
matter (that is the dtype's error against float32, the same for both runs). `top2_margin` is
reported beside `gap`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

SIGNIFICAND_BITS = {"bfloat16": 8, "float16": 11, "float32": 24}
ULPS = {"bfloat16": 4, "float16": 4, "float32": 4}


def ulp(dtype, magnitude: float) -> float:
  """The spacing of `dtype`'s numbers at |magnitude| (its normal range): 2 ** (e - (p - 1)) for
  2 ** e <= |magnitude| < 2 ** (e + 1), p the significand's bits."""
  p = SIGNIFICAND_BITS[jnp.dtype(dtype).name]
  m = max(abs(float(magnitude)), np.finfo(np.float32).tiny)
  return 2.0 ** (math.floor(math.log2(m)) - (p - 1))


def margin_bound(dtype, magnitude: float, ulps: float | None = None) -> float:
  """The largest logit gap a `dtype` run's rounding can explain at logits of |magnitude|: `ulps`
  (default ULPS[dtype]) ulps of dtype at that magnitude (see the module docstring)."""
  name = jnp.dtype(dtype).name
  if name not in SIGNIFICAND_BITS:
    raise ValueError(f"dtype={name!r} has no bound; supported: {', '.join(SIGNIFICAND_BITS)}")
  return (ULPS[name] if ulps is None else ulps) * ulp(dtype, magnitude)


@dataclasses.dataclass(frozen=True)
class Divergence:
  """Row `row`'s first difference: at new-token index `index`, autoregressive decoding emitted
  `expected` and the method `got`. Logit numbers are float32, teacher-forced on the
  autoregressive text: `top2_margin` (first minus second logit), `gap` (|logit[expected] -
  logit[got]|), `scale` (the position's largest |logit|), `bound` (margin_bound at that
  scale). verdict: "tie" (gap <= bound) or "failure"; "length" when one row is a prefix of the
  other (no logit explains it)."""
  row: int
  index: int
  expected: int | None
  got: int | None
  top2_margin: float | None
  gap: float | None
  scale: float | None
  bound: float | None
  verdict: str

  @property
  def ok(self) -> bool:
    return self.verdict == "tie"


@dataclasses.dataclass(frozen=True)
class Report:
  """Every row's first divergence (rows equal to their reference are not listed)."""
  rows: int
  dtype: str
  divergences: tuple[Divergence, ...]

  @property
  def failures(self) -> list[Divergence]:
    return [d for d in self.divergences if not d.ok]

  @property
  def ok(self) -> bool:
    return not self.failures

  @property
  def identical(self) -> bool:
    return not self.divergences

  def summary(self) -> str:
    ties = len(self.divergences) - len(self.failures)
    s = (f"{self.rows} rows ({self.dtype}): {self.rows - len(self.divergences)} identical, "
         f"{ties} tie(s), {len(self.failures)} failure(s)")
    for d in self.divergences:
      s += (f"\n  row {d.row} token {d.index}: expected {d.expected}, got {d.got}; "
            f"{d.verdict}" + ("" if d.gap is None else
                              f" (gap {d.gap:.3g}, top-2 margin {d.top2_margin:.3g}, "
                              f"bound {d.bound:.3g} at |logit| {d.scale:.3g})"))
    return s

  def to_dict(self) -> dict:
    return {"rows": self.rows, "dtype": self.dtype, "ok": self.ok,
            "identical_rows": self.rows - len(self.divergences),
            "ties": len(self.divergences) - len(self.failures), "failures": len(self.failures),
            "divergences": [dataclasses.asdict(d) for d in self.divergences]}


def first_divergence(expected: Sequence[int], got: Sequence[int]) -> int | None:
  """The first index where the two token lists differ (a shorter list differs where it ends);
  None when they are equal."""
  for i, (a, b) in enumerate(zip(expected, got)):
    if a != b:
      return i
  return None if len(expected) == len(got) else min(len(expected), len(got))


def float32_model(model):
  """`model` with float32 parameters on XLA's products: packed kernel copies dropped, every
  floating parameter cast to float32."""
  from specjax import packing
  from specjax.model import Model

  m = packing.unpack(model)
  params = jax.tree_util.tree_map(
      lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, m.params)
  return Model(m.config, m.graphdef, params, m.tokenizer, name=m.name, dtype=jnp.float32)


def teacher_forced_logits(model, sequences: Sequence[Sequence[int]],
                          at: Sequence[int]) -> np.ndarray:
  """float32 logits [B,V] of `model` (cast by float32_model) after the first at[b] tokens of
  sequences[b] (the prediction for position at[b]; at[b] >= 1), one causal forward over the
  right-padded rows at matmul precision "highest"."""
  from specjax.model import forward_sequence

  m = float32_model(model)
  t = max(len(s) for s in sequences)
  toks = np.zeros((len(sequences), t), np.int32)
  for i, s in enumerate(sequences):
    toks[i, :len(s)] = s
  where = np.asarray(at, np.int32)[:, None] - 1  # [B,1]: the position whose logits predict at[b]

  @jax.jit
  def run(params, toks, where):
    return forward_sequence(m.config, m.module(params), toks, logits_at=where)[0][:, 0]

  with jax.default_matmul_precision("highest"):  # traced and lowered under it (a jit cache key)
    return np.asarray(run(m.params, toks, where), np.float32)


def check_greedy(model, prompts: Sequence[Sequence[int]], reference: Sequence[Sequence[int]],
                 tokens: Sequence[Sequence[int]], *, dtype=None,
                 ulps: float | None = None) -> Report:
  """The tie-aware comparison of a method's greedy `tokens` with autoregressive decoding's
  `reference` (both new tokens per row, after prompts[b] as token ids): see the module
  docstring. dtype: what the runs computed in (default: the model's), which sets the bound."""
  if not (len(prompts) == len(reference) == len(tokens)):
    raise ValueError(f"check_greedy needs one prompt, reference and token row per row: "
                     f"{len(prompts)}, {len(reference)}, {len(tokens)}")
  dtype = jnp.dtype(model.dtype if dtype is None else dtype)
  found = [(b, first_divergence(r, t)) for b, (r, t) in enumerate(zip(reference, tokens))]
  found = [(b, i) for b, i in found if i is not None]
  logits = {}
  judged = [(b, i) for b, i in found if i < len(reference[b]) and i < len(tokens[b])]
  if judged:
    seqs = [list(prompts[b]) + list(reference[b][:i + 1]) for b, i in judged]
    rows = teacher_forced_logits(model, seqs, [len(prompts[b]) + i for b, i in judged])
    logits = {b: row for (b, _), row in zip(judged, rows)}
  out = []
  for b, i in found:
    if b not in logits:
      e = reference[b][i] if i < len(reference[b]) else None
      g = tokens[b][i] if i < len(tokens[b]) else None
      out.append(Divergence(b, i, e, g, None, None, None, None, "length"))
      continue
    row = logits[b]
    e, g = int(reference[b][i]), int(tokens[b][i])
    top2 = np.sort(row)[-2:]
    gap = abs(float(row[e]) - float(row[g]))
    scale = float(np.abs(row).max())
    bound = margin_bound(dtype, scale, ulps)
    out.append(Divergence(b, i, e, g, float(top2[1] - top2[0]), gap, scale, bound,
                          "tie" if gap <= bound else "failure"))
  return Report(len(reference), dtype.name, tuple(out))


# ----------------------------------------------------------------------------- methods to check

# Small static settings for every registered method: the lossless checks build each method by
# name on random-weight targets, where no drafter is shipped and no cost curve should be measured
# (a default is chosen from the device's curve; a named knob skips that choice).
MEDUSA_TREE = ((0,), (1,), (2,), (3,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0))


def random_draft(target, seed: int = 7, layers: int = 1):
  """A random draft model for `target`: its config cut to `layers` layers (same vocabulary and
  width), its dtype, weights at the tests' spread (logits wide enough to draft something)."""
  from specjax.model import Model

  cfg = dataclasses.replace(target.config, num_layers=layers)
  return Model.random(cfg, seed=seed, dtype=target.dtype, scale=0.15)


def method_options(name: str, target, seed: int = 4) -> dict:
  """Options that build the registered method `name` on `target` (specjax.methods.build) with
  small fixed settings and random drafters (Medusa heads at a spread that gets some candidates
  accepted, EAGLE / MTP / DFlash heads, a one-layer random draft, as PARD's parallel draft too)."""
  from specjax import methods
  from specjax.heads import init_heads

  medusa = lambda: init_heads(target, "medusa", num_heads=3, seed=seed, scale=3.0)  # noqa: E731
  options = {
      "autoregressive": lambda: {},
      "prompt-lookup": lambda: dict(ngram=2, num_tokens=4),
      "suffix": lambda: dict(num_nodes=6, max_depth=4, occurrences=3, max_match=4),
      "lookahead": lambda: dict(window=3, ngram=3, guess=2),
      "draft": lambda: dict(draft=random_draft(target, seed + 3), gamma=3),
      "pard": lambda: dict(draft=random_draft(target, seed + 3), gamma=3,
                           mask_token_id=target.config.vocab_size - 1),
      "layer-skip": lambda: dict(exit_layer=1, gamma=3),
      "quantized": lambda: dict(bits=8, gamma=3),
      "medusa": lambda: dict(heads=medusa(), tree=[list(p) for p in MEDUSA_TREE]),
      "eagle": lambda: dict(heads=init_heads(target, "eagle", seed=seed, scale=0.3), depth=3,
                            top_k=3, num_nodes=8),
      "hybrid": lambda: dict(drafters=[
          methods.PromptLookup(ngram=2, num_tokens=3),
          methods.SuffixDecoding(num_nodes=4, max_depth=3, occurrences=2, max_match=3),
          methods.Medusa(medusa(), tree=[list(p) for p in MEDUSA_TREE])], num_nodes=10),
      "mtp": lambda: dict(heads=init_heads(target, "mtp", num_heads=2, seed=seed, scale=0.3)),
      "dflash": lambda: dict(heads=init_heads(target, "dflash", block_size=4, seed=seed,
                                              scale=0.3,
                                              mask_token_id=target.config.vocab_size - 1)),
  }
  canonical = methods.get(name).name
  if canonical not in options:
    raise KeyError(f"no check settings for method {canonical!r}: add them to "
                   f"specjax.exactness.method_options")
  return options[canonical]()


def build_method(name: str, target, seed: int = 4):
  """The registered method `name` on `target` with `method_options`' settings."""
  from specjax import methods

  return methods.build(name, target, **method_options(name, target, seed))
