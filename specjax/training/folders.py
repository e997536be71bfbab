"""The output folder of a long run (`train_draft`, `train_heads`, `generate_corpus`): a run that
fails removes the folder it created, so a typo in a flag leaves no empty `runs/...` behind. It
removes only that: never a folder that was there before the run, and never one holding work a
rerun resumes from (a checkpoint, a complete corpus shard)."""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Callable


def _first_missing(path: str) -> str | None:
  """The outermost folder of `path` that does not exist yet (what creating path creates), or
  None when path exists."""
  top = None
  while not os.path.exists(path):
    top, parent = path, os.path.dirname(path)
    if parent == path:
      break
    path = parent
  return top


@contextlib.contextmanager
def removed_on_failure(out_dir, keep: Callable[[str], bool]):
  """Runs the block; if it raises (Ctrl-C included) and `out_dir` did not exist before it, removes
  what the block created of out_dir's path unless keep(out_dir) says it holds work to resume
  from. An out_dir that is not a path is left to the run's own checks."""
  if not isinstance(out_dir, (str, os.PathLike)) or not os.fspath(out_dir):
    yield
    return
  out_dir = os.path.abspath(os.fspath(out_dir))
  top = _first_missing(out_dir)
  try:
    yield
  except BaseException:
    if top is not None and os.path.isdir(top) and not (os.path.isdir(out_dir) and keep(out_dir)):
      shutil.rmtree(top, ignore_errors=True)
    raise
