"""Drafters: their nnx modules, one type per kind, and their assets (our heads files and the
published Medusa / EAGLE / EAGLE-3 / MTP / DFlash layouts).

    heads = sj.load_heads("medusa-vicuna-7b/", target)         # recognised from the files' contents
    logits = sj.head_logits(target, heads, tokens)             # teacher-forced, to measure heads
    export_heads(heads, "medusa", "out/", target)              # our heads in a published layout

The package, bottom up:
  files.py, writers.py    the containers published drafters come in (safetensors, torch), writing
  layouts.py              published layouts, recognised from tensor names and config fields
                          (LAYOUTS), read into plain fields and arrays
  heads_file.py           the data: HeadsConfig, Heads, our .npz (save_heads, read_npz) and the
                          published layouts turned into Heads (read_published)
  layer.py                the target Block a one-layer drafter holds, over its arrays
  medusa.py, eagle.py, mtp.py, eagle3.py, dflash.py
                          one nnx module type per kind (MedusaHeads, EagleLayer, MtpModule,
                          Eagle3Head, DFlashDrafter), its params' shapes and its init
  kinds.py                kind -> module type, init and fit check; init_heads, load_heads
  score.py, export.py     head_logits; export_heads (our heads in a published layout)

specjax.heads re-exports the user's API (sj.init_heads, sj.load_heads, save_heads, ...).
"""

from __future__ import annotations

from specjax.drafters.export import FORMATS, export_files, export_heads
from specjax.drafters.files import LAYOUTS
from specjax.drafters.score import SCORED, head_logits

__all__ = ["FORMATS", "LAYOUTS", "SCORED", "export_files", "export_heads", "head_logits"]
