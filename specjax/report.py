"""README.md's results table, generated from the experiments' results files, never edited by hand.

    python -m specjax.report           # rewrite the block between the markers in README.md
    python -m specjax.report --check   # exit 1 (and say so) when README.md's block is stale

The block between `<!-- results:begin -->` and `<!-- results:end -->` is rebuilt from the files in
`SOURCES`: per file, a table of speedup over autoregressive decoding and tau (new tokens per
target call) for each method on each prompt set, then where the numbers come from, read from the
file's own metadata: date, machine, load average, how long the run took and the command that
wrote it (a file made before runs recorded their command says so instead). Every figure the
README quotes about speed therefore comes from a file this script reads, and a test runs
`--check` on the real README, so a hand edit fails CI.

Today's sources, each a run of experiments/spec_bench that times every method on the same prompts
in one process, so a table's rows compare with each other: the chat and code run on the fastest
autoregressive decoding of the embedded model on a CPU with AVX-512 VNNI, its GGUF's blocks with
int8 activations (`--weights blocks --activations int8`, W4A8); the same on the blocks with float32
activations (`--weights blocks`, the fastest on an AVX2 CPU), both with llama.cpp's rows on the
same file (`--llama-cpp`); the same run on the float32 path (MT-Bench and
HumanEval, 10 prompts each, 128 new tokens: the prompts and lengths speed goals are judged on);
the quick run over all six Spec-Bench sets and HumanEval (2 prompts each, 64 tokens); and the
quick run on the Medusa-2 model (the target with the shipped adapters merged in: a different
model, so its Medusa row is against that model's own autoregressive decoding, in its own process).
Each table's title and first row name the arithmetic its baseline decodes with (`--weights`,
`--activations`; a file from before runs recorded them ran the float32 path). Rows a file lists
as `external` (llama.cpp, `--llama-cpp`) show the speedup alone and are marked "(not exact)":
they compute with other arithmetic, so they are neither exact nor counted as specjax's tau.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap

BEGIN = "<!-- results:begin -->"
END = "<!-- results:end -->"
# Relative to the repository root.
SOURCES = ("experiments/spec_bench/chat_code_w4a8/results.json",
           "experiments/spec_bench/chat_code_blocks/results.json",
           "experiments/spec_bench/chat_code/results.json",
           "experiments/spec_bench/results_quick.json",
           "experiments/spec_bench/medusa2/results_quick.json")
# The one-GPU check (experiments/accelerator): the tables' accelerator column, after them.
ACCELERATOR = "experiments/accelerator/results.json"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SET_TITLES = {"mt_bench": "MT-Bench", "translation": "Translation", "summarization": "Summarization",
              "qa": "QA", "math_reasoning": "Math", "rag": "RAG", "humaneval": "HumanEval",
              "overall": "all sets"}
NO_COMMAND = "not recorded in the file (written before runs recorded their command)"


ARITHMETIC = {("float32", "float32"): ("float32", "the float32 path (the GGUF's weights "
                                      "dequantized to float32)"),
              ("blocks", "float32"): ("GGUF blocks", "the GGUF's own quantized blocks "
                                      "(weights=\"blocks\"), float32 activations"),
              ("blocks", "int8"): ("GGUF blocks, int8 activations", "the GGUF's own quantized "
                                   "blocks with int8 activations (W4A8)")}


def arithmetic(info: dict, short: bool = False) -> str:
  """What a run's target computed with, from its info's weights / activations (absent: the
  float32 default, as every run made before they were recorded)."""
  key = (info.get("weights") or "float32", info.get("activations") or "float32")
  if key not in ARITHMETIC:
    raise ReportError(f"weights={key[0]!r}, activations={key[1]!r}: not one of {list(ARITHMETIC)}")
  return ARITHMETIC[key][0 if short else 1]


class ReportError(ValueError):
  """A results file or README that the report cannot read: names the file and what is wrong."""


def load_source(path: str, name: str | None = None) -> dict:
  """A Spec-Bench-layout results file -> {name, sets, methods, cells, notes, meta}.

  cells[method][set] = (speedup, tau, identical, tok/s); sets are the file's prompt sets in its own
  order plus "overall" (every prompt pooled) when the file has it. `name` is how the report
  cites the file (default: `path`)."""
  with open(path) as f:
    data = json.load(f)
  missing = [k for k in ("summary", "categories", "info") if k not in data]
  if missing:
    raise ReportError(f"{path}: no {', '.join(missing)}; expected the layout that "
                      f"experiments/spec_bench/run.py writes (summary, categories, info)")
  summary = data["summary"]
  sets = [s for s in data["categories"] if any(s in cell for cell in summary.values())]
  if any("overall" in cell for cell in summary.values()):
    sets.append("overall")
  cells = {m: {s: (c["speedup"], c["tau"], c.get("identical"), c.get("tok_s"),
                   c.get("same_as_ar")) for s, c in by_set.items() if s in sets}
           for m, by_set in summary.items()}
  return {"name": name or path, "sets": sets, "methods": list(summary), "cells": cells,
          "notes": data.get("methods", {}), "external": data.get("external", []),
          "meta": _meta(data)}


def _meta(data: dict) -> dict:
  info = data["info"]
  return {"date": info.get("date"), "cpu": info.get("processor") or info.get("machine"),
          "cores": info.get("cores"), "device": info.get("device"),
          "load": info.get("load_average"), "load_end": info.get("load_average_end"),
          "run_s": info.get("run_s"), "command": info.get("command"), "jax": info.get("jax"),
          "model": data.get("model"), "prompts": data.get("num_prompts"),
          "new_tokens": data.get("max_new_tokens"), "repeats": data.get("repeats"),
          "arithmetic": arithmetic(info), "short": arithmetic(info, short=True)}


def render_source(src: dict, baseline: str = "autoregressive") -> str:
  """One source's title, its table (a cell per method x prompt set: "speedup x (tau)", the
  baseline's row its tokens/s, an external row its speedup alone) and the notes that say where
  it comes from."""
  sets, m = src["sets"], src["meta"]
  title = (f"**{m['model']} on {m['arithmetic']}: "
           f"{', '.join(SET_TITLES.get(s, s) for s in sets if s != 'overall')}, "
           f"{m['prompts']} prompt(s) per set x {m['new_tokens']} tokens**")
  head = "| method | " + " | ".join(SET_TITLES.get(s, s) for s in sets) + " |"
  lines = [_wrap(title), "", head, "|---" * (len(sets) + 1) + "|"]
  if baseline in src["cells"]:
    base = src["cells"][baseline]
    lines.append(f"| {baseline} ({m['short']}), tokens/s | " + " | ".join(
        "-" if base.get(s) is None or base[s][3] is None else f"{base[s][3]:.1f}"
        for s in sets) + " |")
  for name in src["methods"]:
    if name != baseline:
      ext = name in src["external"]
      lines.append(f"| {name}{' (not exact)' if ext else ''} | " + " | ".join(
          _cell(src["cells"][name].get(s), tau=not ext) for s in sets) + " |")
  notes = [_source_line(src), _settings_line(src, baseline), _external_line(src, baseline),
           _identity_line(src)]
  return "\n".join(lines + [""] + [_wrap(n) + "\n" for n in notes if n]).rstrip("\n")


def _cell(c, tau: bool = True) -> str:
  if c is None:
    return "-"
  text = f"{c[0]:.2f}x ({c[1]:.2f})" if tau else f"{c[0]:.2f}x"
  speedup = c[0]
  return f"**{text}**" if round(speedup, 2) > 1.0 else text  # bold: faster than the baseline


def _wrap(text: str) -> str:
  return textwrap.fill(text, width=100, break_long_words=False, break_on_hyphens=False)


def _source_line(src: dict) -> str:
  m = src["meta"]
  load = _load(m["load"])
  load += f" at start, {_load(m['load_end'])} at end" if m["load_end"] is not None else " at start"
  run = f"; run {m['run_s']:.0f} s" if m["run_s"] is not None else ""
  cmd = f"`{m['command']}`" if m["command"] else NO_COMMAND
  return (f"Source: `{src['name']}`, {m['date'] or 'date not recorded'}; {m['cpu']}, "
          f"{m['cores']} cores ({m['device']}, jax {m['jax']}); load average {load}{run}. "
          f"Command: {cmd}.")


def _load(x) -> str:
  return "not recorded" if x is None else f"{x[0]:.1f}" if isinstance(x, list) else str(x)


def _settings_line(src: dict, baseline: str) -> str:
  m = src["meta"]
  notes = "; ".join(f"{name}: {note}" for name, note in src["notes"].items()
                    if name != baseline and name not in src["external"])
  return (f"Cells: speedup over {baseline} decoding (median over prompts of the per-prompt time "
          f"ratio; bold where above 1.00x) and, in brackets, tau (new tokens per target forward, "
          f"prefill included); the first row, {baseline} decoding's own speed (median over "
          f"prompts), on {m['arithmetic']}. "
          f"{m['model']}, greedy, batch 1, {m['prompts']} prompt(s) per set, {m['new_tokens']} new "
          f"tokens, {m['repeats']} timed run(s) per prompt. Methods: {notes}.")


def _external_line(src: dict, baseline: str) -> str:
  """What the external rows (llama.cpp) are and how far their greedy tokens follow the
  baseline's; empty when the source has none."""
  if not src["external"]:
    return ""
  rows = []
  for name in src["external"]:
    shares = [c[4] for c in src["cells"].get(name, {}).values() if c[4] is not None]
    lo, hi = (f"{min(shares):.2f}", f"{max(shares):.2f}") if shares else ("", "")
    same = f"; {lo if lo == hi else f'{lo}-{hi}'} of the {baseline} tokens before the first " \
           f"difference, per set" if shares else ""
    rows.append(f"{name}: {src['notes'].get(name, 'not described')}{same}")
  return (f"Rows marked (not exact) run outside specjax, timed among the methods against the same "
          f"{baseline} runs on the same token ids; their arithmetic differs, so their greedy "
          f"tokens may differ from {baseline} decoding's, and the cell is the speedup alone. "
          + "; ".join(rows) + ".")


def _identity_line(src: dict) -> str:
  differ = [f"{m} on {SET_TITLES.get(s, s)}" for m, by_set in src["cells"].items()
            for s, c in by_set.items() if c[2] is False]
  if differ:
    return "Greedy output NOT token-identical to autoregressive: " + ", ".join(differ) + "."
  every = "Every specjax method's" if src["external"] else "Every"
  return f"{every} greedy output was token-identical to autoregressive decoding."


def load_accelerator(path: str, name: str | None = None) -> dict:
  """experiments/accelerator's results.json -> {name, res}; checks the sections the column reads."""
  with open(path) as f:
    res = json.load(f)
  missing = [k for k in ("device", "lossless", "methods") if not isinstance(res.get(k), dict)]
  if missing:
    raise ReportError(f"{path}: no {', '.join(missing)}; expected the layout that "
                      f"experiments/accelerator/run.py writes")
  return {"name": name or path, "res": res}


def _lossless_cell(row) -> str:
  if row is None:
    return "-"
  if row.get("status") != "ok" or row.get("failures"):
    return f"**FAILED** ({row.get('status')}, {row.get('failures')} failure(s))"
  return "identical" if row.get("identical") else f"lossless ({row.get('ties')} tie(s))"


def render_accelerator(acc: dict) -> str:
  """The accelerator column: per method, lossless on the GPU in float32 and bf16, a round's cost
  in autoregressive steps and the speedup that cost predicts at the CPU's tau; then
  autoregressive decoding against the memory roofline and transformers, and c(T)."""
  res, dev = acc["res"], acc["res"]["device"]
  lossless = {(r["method"], r["dtype"]): r for r in res["lossless"].get("rows", [])}
  lines = [_wrap(f"**On one GPU ({dev.get('device_kind')}, jax {dev.get('jax')}): every method on "
                 f"{res['lossless'].get('target')}, and its round's cost on "
                 f"{res['methods'].get('target')}**"), "",
           "| method | lossless, float32 | lossless, bf16 | round / AR step | tau (CPU) | "
           "speedup at CPU tau (predicted) |", "|---|---|---|---|---|---|"]
  for r in res["methods"].get("rows", []):
    num = [r.get(k) for k in ("round_in_ar_steps", "tau_cpu", "speedup_if_tau_cpu")]
    lines.append(f"| {r['method']} | {_lossless_cell(lossless.get((r['method'], 'float32')))} | "
                 f"{_lossless_cell(lossless.get((r['method'], 'bfloat16')))} | " + " | ".join(
                     "-" if v is None else f"{v:.2f}" for v in num) + " |")
  notes = [_accelerator_ar_line(res), _accelerator_source_line(acc)]
  return "\n".join(lines + [""] + [_wrap(n) + "\n" for n in notes if n]).rstrip("\n")


def _accelerator_ar_line(res: dict) -> str:
  roof, tf, cc = (res.get(k) or {} for k in ("ar_vs_roofline", "ar_vs_transformers",
                                             "cost_curve"))
  parts = []
  for shape, r in roof.items():
    if isinstance(r, dict) and r.get("status") == "ok":
      t = tf.get(shape) or {}
      c = (cc.get(shape) or {}).get("c", {})
      vs = f", {t['speedup']:.2f}x transformers' `generate`" if t.get("status") == "ok" else ""
      cost = ", ".join(f"c({k}) {c[k]:.2f}" for k in ("16", "64") if k in c)
      parts.append(f"{shape}-shaped (random weights) {r['tokens_per_s']:.1f} tok/s, "
                   f"{r['fraction_of_roofline']:.2f} of the memory roofline{vs}"
                   + (f"; {cost}" if cost else ""))
  if not parts:
    return ""
  return (f"Autoregressive bf16, batch 1, against the memory roofline at the measured copy "
          f"bandwidth ({roof.get('copy_bandwidth_gbs')} GB/s) and transformers' static-cache "
          f"`generate` on the same GPU and weights: " + "; ".join(parts) + ". c(T): a T-token "
          f"forward over a one-token forward. The predicted speedup is the CPU's tau over the "
          f"round's cost; tau is not measured on the GPU, whose models have random weights.")


def _accelerator_source_line(acc: dict) -> str:
  res = acc["res"]
  runs = res.get("runs") or [{"command": res.get("command"), "run_s": res.get("run_s")}]
  date = ((res["device"].get("machine") or {}).get("date")) or "date not recorded"
  note = f" {res['note']}" if res.get("note") else ""
  return (f"Source: `{acc['name']}`, {date}; " + "; ".join(
      f"`{r.get('command')}` ({r.get('run_s')} s)" for r in runs) + "." + note)


def render(sources: list[dict], accelerator: dict | None = None) -> str:
  """The whole block, markers included."""
  body = "\n\n".join([render_source(s) for s in sources]
                      + ([render_accelerator(accelerator)] if accelerator else []))
  note = "<!-- generated by `python -m specjax.report` from the files named below; do not edit -->"
  return f"{BEGIN}\n{note}\n\n{body}\n\n{END}"


def splice(readme: str, block: str, path: str = "README.md") -> str:
  """`readme` with the text from BEGIN to END (inclusive) replaced by `block`."""
  start, end = readme.find(BEGIN), readme.find(END)
  if start < 0 or end < start:
    raise ReportError(f"{path}: needs the markers {BEGIN} and {END}, in that order, around the "
                      f"results block")
  return readme[:start] + block + readme[end + len(END):]


def build(root: str = ROOT, sources=SOURCES, accelerator: str | None = ACCELERATOR) -> str:
  """The block from `sources` and `accelerator` (paths relative to `root`; the accelerator's
  column only where its file exists)."""
  acc = os.path.join(root, accelerator) if accelerator else None
  return render([load_source(os.path.join(root, p), name=p) for p in sources],
                load_accelerator(acc, name=accelerator) if acc and os.path.exists(acc) else None)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--check", action="store_true",
                  help="write nothing; exit 1 when the README's block differs from the sources'")
  ap.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
  ap.add_argument("--root", default=ROOT, help="where the source paths start (the repository)")
  args = ap.parse_args(argv)
  with open(args.readme) as f:
    old = f.read()
  new = splice(old, build(args.root), args.readme)
  if args.check:
    if new != old:
      print(f"{args.readme}: the results block is stale or was edited by hand; "
            f"run `python -m specjax.report` to regenerate it", file=sys.stderr)
      return 1
    print(f"{args.readme}: the results block matches its sources")
    return 0
  if new != old:
    tmp = args.readme + ".tmp"
    with open(tmp, "w") as f:
      f.write(new)
    os.replace(tmp, args.readme)
  print(f"{args.readme}: results block {'rewritten' if new != old else 'already current'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
