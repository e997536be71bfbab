"""Speedup against batch size and against prompt length, every method vs autoregressive (issue 13).

    .venv/bin/python experiments/scaling/run.py [--quick] [--model NAME_OR_DIR] [--out DIR]
        [--batch-sizes 1,2,4,8] [--lengths 128,512,1024,1500] [--num-prompts N]
        [--max-new-tokens N] [--methods a,b] [--repeats N] [--rescore results.json]

Prompts are "summarize this" requests over long documents (Spec-Bench's summarization and RAG
inputs concatenated; the built-in prompt list without the shared folder), cut to an exact token
count with the chat template included, each case from a different offset in the text. Two axes
share their first point: batch sizes B at the shortest length, and lengths L at batch 1. At every
point the methods decode the same batch one after another with an sj.Autoregressive() run before
each and after the last (specjax.bench.run_cases / rescore: compile excluded, a fresh program's
first run discarded, greedy identity checked), so a ratio always compares runs at the same batch
and length. Writes results.json (`--rescore` scores its records again), results.md and
results.png to --out (`results_quick.*` with --quick). Methods as in experiments/spec_bench.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, ROOT)

import specjax as sj  # noqa: E402
from specjax import bench, prompts  # noqa: E402
from specjax import methods as sj_methods  # noqa: E402

from experiments.spec_bench.run import METHODS, build_methods  # noqa: E402

INSTRUCTION = "Summarize the following text in a few sentences.\n\n"


def document(n_chars: int = 200_000) -> str:
  """Long natural text: Spec-Bench's summarization and RAG inputs, one after another."""
  parts = []
  for cat in ("summarization", "rag"):
    parts += prompts.load(f"spec_bench:{cat}")
  text = "\n\n".join(dict.fromkeys(parts))
  return (text * (n_chars // max(1, len(text)) + 1))[:n_chars]


def make_prompt(model, doc_ids: list[int], offset: int, length: int) -> list[int]:
  """Token ids of a chat request of at most `length` tokens (as close to it as the tokenizer
  allows): INSTRUCTION + the document's tokens from `offset`, in the chat template when the
  tokenizer has one. Built from text and re-encoded, so the cut never splits a character."""
  tok = model.tokenizer

  def encode(k):
    text = INSTRUCTION + tok.decode(doc_ids[offset:offset + k])
    if getattr(tok, "chat_template", None):
      ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                    add_generation_prompt=True, tokenize=True)
      return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return tok.encode(text)

  k = max(1, length - (len(encode(1)) - 1))
  ids = encode(k)
  while len(ids) > length and k > 1:  # re-encoding can merge or split tokens at the seams
    k = max(1, k - (len(ids) - length))
    ids = encode(k)
  return ids


def points(batch_sizes, lengths) -> list[tuple[int, int]]:
  """(B, L): the batch axis at the shortest length, then the length axis at batch 1."""
  short = min(lengths)
  out = [(b, short) for b in batch_sizes]
  out += [(1, n) for n in lengths if (1, n) not in out]
  return out


def label(b: int, n: int) -> str:
  return f"B={b} L={n}"


def tables(summary: dict, methods, batch_sizes, lengths) -> str:
  short = min(lengths)
  out = []
  for axis, pts, head in (("batch", [(b, short) for b in batch_sizes], lambda b, n: f"B={b}"),
                          ("length", [(1, n) for n in lengths], lambda b, n: f"L={n}")):
    rows = []
    for name in methods:
      r = {"method": name}
      for b, n in pts:
        c = summary[name].get(label(b, n))
        r[label(b, n)] = None if c is None else f"{c['speedup']:.2f}x ({c['tau']:.2f})"
      rows.append(r)
    ar = {"method": "autoregressive tok/s"}
    for b, n in pts:
      c = summary["autoregressive"].get(label(b, n))
      ar[label(b, n)] = None if c is None else f"{c['tok_s']:.1f}"
    rows.append(ar)
    title = (f"Speedup (tau) by batch size, prompts of {short} tokens:" if axis == "batch"
             else "Speedup (tau) by prompt length, batch 1:")
    out.append(title + "\n\n" + bench.markdown_table(
        rows, [("method", "method", "s")] + [(label(b, n), head(b, n), "s") for b, n in pts]))
  same = {m: summary[m][bench.OVERALL]["identical"] for m in methods}
  out.append("Greedy outputs token-identical to autoregressive at every point: "
             + ", ".join(f"{m} {'yes' if v else 'NO' if v is not None else '-'}"
                         for m, v in same.items() if m != "autoregressive") + ".")
  return "\n\n".join(out)


def plot(summary: dict, methods, batch_sizes, lengths):
  short = min(lengths)
  names = [m for m in methods if m != "autoregressive"]

  def draw(fig):
    fig.set_size_inches(10, 4.2)
    for i, (xs, pts, xl) in enumerate((
        (batch_sizes, [(b, short) for b in batch_sizes], f"batch size (prompts of {short} tokens)"),
        (lengths, [(1, n) for n in lengths], "prompt length, tokens (batch 1)"))):
      ax = fig.add_subplot(1, 2, i + 1)
      for name in names:
        ys = [summary[name].get(label(b, n), {}).get("speedup", float("nan")) for b, n in pts]
        ax.plot(xs, ys, marker="o", label=name)
      ax.axhline(1.0, color="k", lw=0.8, ls="--")
      if i == 0:
        ax.set_xscale("log", base=2)
      ax.set_xticks(list(xs), [str(x) for x in xs])
      ax.set_xlabel(xl)
      ax.set_ylabel("speedup over autoregressive")
      ax.legend(fontsize=7)
  return draw


def _ints(ap, name: str, value: str) -> list[int]:
  try:
    xs = [int(x) for x in value.split(",") if x]
  except ValueError:
    ap.error(f"--{name} {value!r}: expected comma-separated integers")
  if not xs or min(xs) < 1:
    ap.error(f"--{name} {value!r}: expected integers >= 1")
  return sorted(set(xs))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true",
                  help="batch sizes 1,4; lengths 128,1024; 1 prompt per point; 32 new tokens")
  ap.add_argument("--model", default="smollm2-135m")
  ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
  ap.add_argument("--batch-sizes", default=None, help="default 1,2,4,8")
  ap.add_argument("--lengths", default=None, help="prompt tokens; default 128,512,1024,1500")
  ap.add_argument("--num-prompts", type=int, default=None, help="calls per point (default 3; quick 1)")
  ap.add_argument("--max-new-tokens", type=int, default=None, help="default 128; quick 32")
  ap.add_argument("--methods", default=",".join(METHODS))
  ap.add_argument("--repeats", type=int, default=1)
  ap.add_argument("--medusa-nodes", type=int, default=0,
                  help="Medusa tree size (0: choose_budget on the measured cost curve)")
  ap.add_argument("--no-progress", action="store_true")
  ap.add_argument("--rescore", default="", metavar="JSON",
                  help="decode nothing: score the records of an earlier run's JSON again and "
                  "rewrite its report next to it")
  args = ap.parse_args(argv)
  if args.rescore:
    return bench.rescore_saved(args.rescore, report)
  quick = args.quick
  batch_sizes = _ints(ap, "batch-sizes", args.batch_sizes or ("1,4" if quick else "1,2,4,8"))
  lengths = _ints(ap, "lengths", args.lengths or ("128,1024" if quick else "128,512,1024,1500"))
  n = args.num_prompts if args.num_prompts is not None else (1 if quick else 3)
  new = args.max_new_tokens if args.max_new_tokens is not None else (32 if quick else 128)
  names = [sj_methods.canonical(m) or m for m in args.methods.split(",") if m]  # aliases too
  if bad := [m for m in names if m not in METHODS]:
    ap.error(f"--methods: unknown {', '.join(bad)}; choose from {', '.join(METHODS)}")
  if n < 1 or new < 1 or args.repeats < 1:
    ap.error("--num-prompts, --max-new-tokens and --repeats must be >= 1")
  names = ["autoregressive"] + [m for m in names if m != "autoregressive"]

  info, t_start = bench.machine_info(), time.time()
  print(f"{info['date']}, {info['processor']}, {info['cores']} cores, load average "
        f"{info['load_average']}, jax {info['jax']}")
  target = sj.load_model(args.model)
  if max(lengths) + new > target.config.max_position_embeddings:
    ap.error(f"--lengths: {max(lengths)} + {new} new tokens exceed {args.model}'s context of "
             f"{target.config.max_position_embeddings}")
  methods, notes = build_methods(target, names, medusa_nodes=args.medusa_nodes,
                                 cost_sizes=(1, 2, 4, 8, 16) if quick else (1, 2, 4, 8, 16, 32))
  for name, note in notes.items():
    print(f"  {name}: {note}")
  doc_ids = target.tokenizer.encode(document())
  cases = []
  for b, length in points(batch_sizes, lengths):
    for j in range(n):
      rows = []
      for r in range(b):  # every row and case reads its own stretch of the document
        offset = ((j * b + r) * 997 * length) % max(1, len(doc_ids) - length)
        rows.append(make_prompt(target, doc_ids, offset, length))
        if len(rows[-1]) > length:
          ap.error(f"--lengths {length}: too short, the instruction and chat template alone take "
                   f"{len(make_prompt(target, doc_ids, 0, 1)) - 1} tokens")
      cases.append(bench.Case(rows, chat=False, group=label(b, length),
                              meta={"batch_size": b, "length": length,
                                    "prompt_tokens": [len(x) for x in rows]}))
  records = bench.run_cases(target, cases, methods, max_new_tokens=new, repeats=args.repeats,
                            desc="scaling", progress=not args.no_progress)
  bench.finish_machine_info(info, t_start)
  data = {"info": info, "args": vars(args), "model": args.model, "batch_sizes": batch_sizes,
          "lengths": lengths, "num_prompts": n, "max_new_tokens": new, "repeats": args.repeats,
          "methods": notes, "records": records}
  return report(data, args.out, "results_quick" if quick else "results")


def report(data: dict, out: str, stem: str) -> dict:
  """Scores a run's records (bench.rescore, bench.summarize), writes stem.json / .md / .png to
  `out` and returns the data with its summary."""
  info, notes = data["info"], data["methods"]
  batch_sizes, lengths = data["batch_sizes"], data["lengths"]
  summary = bench.summarize(bench.rescore(data["records"]))
  ran = list(summary)
  skipped = [f"{m} ({note})" for m, note in notes.items() if m not in ran]
  head = (f"{data['model']}, greedy, {data['num_prompts']} call(s) per point, "
          f"{data['max_new_tokens']} new tokens (fixed length), {data['repeats']} timed run(s) "
          f"per call; {info['date']}, {info['processor'] or info['machine']}, {info['cores']} "
          f"cores, load average {info['load_average'][0]:.1f} at start / "
          f"{info['load_average_end'][0]:.1f} at end. Cells: median per-call speedup over "
          f"autoregressive at the same batch and length (tau: new tokens per target call, "
          f"prefill included)." + (f" Not run: {'; '.join(skipped)}." if skipped else ""))
  markdown = head + "\n\n" + tables(summary, ran, batch_sizes, lengths)
  data = dict(data, summary=summary)
  paths = bench.save_report(out, stem, data, markdown,
                            plot=plot(summary, ran, batch_sizes, lengths))
  print("\n" + markdown + "\n\nwrote " + ", ".join(paths.values()))
  return data


if __name__ == "__main__":
  main()
