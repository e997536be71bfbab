"""Hugging Face Hub names: what a model or heads name is, and the few files it needs.

    sj.load_model("meta-llama/Llama-3.2-1B-Instruct")            # config, tokenizer, safetensors
    sj.load_model("org/name-GGUF/name.Q4_K_M.gguf")               # one named file of a repository
    sj.load_heads("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", target)  # the heads' config and weights
    sj.load_model("org/name", revision="v1.0")                   # a branch, tag or commit

`what_is` is the one place that says what a name is; a shipped name or an existing local path wins
over a Hub repository of the same name. Files come through huggingface_hub's own cache
(HF_HOME / HF_HUB_CACHE, default ~/.cache/huggingface/hub), only those a load reads: never a
second copy of the weights in another format or the repository's subfolders. With HF_HUB_OFFLINE
set nothing is asked of the network and the cache alone answers. Whatever keeps a repository from
being had is a ModelNotFoundError naming it, its revision and why.
"""

from __future__ import annotations

import os

from specjax.errors import InputError, ModelNotFoundError

SHIPPED, LOCAL, HUB = "shipped", "local", "hub"

# What a model directory on the Hub contributes: its config and tokenizer, and its safetensors
# weights (one file, or shards with their index), top level only.
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "tokenizer.model", "special_tokens_map.json", "added_tokens.json", "vocab.json",
               "merges.txt", "chat_template.jinja", "chat_template.json", "*.safetensors",
               "*.safetensors.index.json")
# Mistral's repositories carry the weights twice: the HF layout and its own consolidated file.
MODEL_SKIP = ("*/*", "consolidated*.safetensors")
# Heads: config.json and safetensors; torch files only where there are no safetensors (as the
# reader prefers them), never a training run's other pickles.
HEADS_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json")
HEADS_TORCH = ("*.bin", "*.pt", "*.pth")
HEADS_SKIP = ("*/*", "training_args.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth")
HEADS_SUFFIXES = (".npz", ".safetensors", ".bin", ".pt", ".pth")  # "org/name/FILE" for heads


def split(name: str, files: tuple = ()) -> tuple[str, str | None] | None:
  """"org/name" -> ("org/name", None); "org/name/path/FILE" with FILE ending in one of `files`
  -> ("org/name", "path/FILE"); None if `name` cannot be a Hub name (an absolute or dotted path,
  a bare name, characters the Hub refuses)."""
  from huggingface_hub.utils import HFValidationError, validate_repo_id

  if not isinstance(name, str) or "\\" in name or name.startswith(("/", "~", ".")):
    return None
  parts = name.split("/")
  if len(parts) < 2 or any(not p for p in parts):
    return None
  repo, file = "/".join(parts[:2]), "/".join(parts[2:]) or None
  if file is not None and not file.endswith(tuple(files)):
    return None
  try:
    validate_repo_id(repo)
  except HFValidationError:
    return None
  return repo, file


def what_is(name: str, shipped=(), files: tuple = ()) -> str | None:
  """What `name` is, in this order: SHIPPED (one of `shipped`), LOCAL (an existing file or
  directory), HUB (a Hub repository "org/name", or one file of it "org/name/FILE" with FILE ending
  in one of `files`), else None."""
  if name in shipped:
    return SHIPPED
  if os.path.exists(name):
    return LOCAL
  if split(name, files) is not None:
    return HUB
  return None


def check_revision(name: str, revision, what: str | None) -> None:
  """InputError for a revision= given with a name that is not a Hub name (`what`: its kind)."""
  if revision is None:
    return
  if not isinstance(revision, str) or not revision:
    raise InputError(f"revision={revision!r} is invalid: must be a branch, tag or commit name")
  if what != HUB:
    raise InputError(f"revision={revision!r} applies to Hugging Face Hub names (org/name); "
                     f"{name!r} is {'a shipped name' if what == SHIPPED else 'a local path'}")


def offline() -> bool:
  """Whether HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set, as huggingface_hub read it."""
  from huggingface_hub import constants

  return bool(constants.HF_HUB_OFFLINE)


def cache_dir() -> str:
  """The Hub cache huggingface_hub uses: $HF_HUB_CACHE, else $HF_HOME/hub."""
  from huggingface_hub import constants

  return constants.HF_HUB_CACHE


def model_path(name: str, revision: str | None = None) -> str:
  """A Hub model name -> the local snapshot directory holding its config, tokenizer and
  safetensors, or the named file ("org/name/FILE.gguf"), downloaded first where needed."""
  repo, file = split(name, (".gguf",))
  if file is not None:
    return _file(name, repo, file, revision)
  folder = _snapshot(name, repo, revision, MODEL_FILES, MODEL_SKIP)
  if not os.path.isfile(os.path.join(folder, "config.json")):
    ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    hint = (f"; it holds GGUF files: name one, e.g. {repo}/{ggufs[0]}" if ggufs else
            "; for a GGUF repository name its file: org/name/FILE.gguf")
    raise ModelNotFoundError(f"{_where(repo, revision)}: no config.json in the repository "
                             f"(snapshot {folder}){hint}")
  if not any(f.endswith(".safetensors") for f in os.listdir(folder)):
    cached = " (offline: as far as the cache holds it)" if offline() else ""
    raise ModelNotFoundError(f"{_where(repo, revision)}: no safetensors weights in the repository"
                             f"{cached} (snapshot {folder}): specjax reads safetensors and GGUF "
                             f"files, not PyTorch .bin checkpoints")
  return folder


def heads_path(name: str, revision: str | None = None) -> str:
  """A Hub heads name -> the local snapshot directory holding their config.json and weights
  (safetensors, else torch files), or the named file with the config.json beside it."""
  repo, file = split(name, HEADS_SUFFIXES)
  if file is not None:
    return _file(name, repo, file, revision, beside=("config.json",))
  folder = _snapshot(name, repo, revision, HEADS_FILES, HEADS_SKIP, need=False)
  if not os.path.isdir(folder) or not any(f.endswith(".safetensors") for f in os.listdir(folder)):
    folder = _snapshot(name, repo, revision, HEADS_TORCH, HEADS_SKIP)
  return folder


def _file(name: str, repo: str, file: str, revision, beside=()) -> str:
  """One file of a repository (and those of `beside` in its folder, where there are any)."""
  d = os.path.dirname(file)
  wanted = (file,) + tuple(f"{d}/{b}" if d else b for b in beside)
  folder = _snapshot(name, repo, revision, wanted, ())
  path = os.path.join(folder, file)
  if not os.path.isfile(path):
    why = "not in the cache" if offline() else "no such file in the repository"
    raise ModelNotFoundError(f"{_where(repo, revision)}: {file!r}: {why}")
  return path


def _where(repo: str, revision) -> str:
  return f"Hugging Face repository {repo!r} (revision {revision or 'main'!r})"


def _snapshot(name: str, repo: str, revision, allow, ignore, need: bool = True) -> str:
  """huggingface_hub.snapshot_download of the files matching `allow` (and not `ignore`): the
  cache alone when offline; every failure a ModelNotFoundError saying why. need=False: a
  repository holding none of them is no error (the folder returned then does not exist)."""
  from huggingface_hub import snapshot_download
  from huggingface_hub.utils import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                     RepositoryNotFoundError, RevisionNotFoundError)

  where = _where(repo, revision)
  nor = f" (nor is {name!r} a local file or directory)"
  try:
    folder = snapshot_download(repo, revision=revision, allow_patterns=list(allow),
                               ignore_patterns=list(ignore) or None, local_files_only=offline())
  except LocalEntryNotFoundError as e:
    if offline():
      why = (f"not in the Hugging Face cache {cache_dir()} and HF_HUB_OFFLINE is set: download "
             f"it once with network access (or unset HF_HUB_OFFLINE)")
    else:
      cause = e.__cause__ or e
      why = (f"the Hub could not be reached ({type(cause).__name__}: {cause}) and it is not in "
             f"the cache {cache_dir()}")
    raise ModelNotFoundError(f"{where}: {why}{nor}") from e
  except GatedRepoError as e:
    raise ModelNotFoundError(f"{where}: the repository is gated: accept its terms on "
                             f"https://huggingface.co/{repo} and log in (`hf auth login`, or set "
                             f"HF_TOKEN)") from e
  except RepositoryNotFoundError as e:
    raise ModelNotFoundError(f"{where}: no such repository on the Hub (or a private one: log in "
                             f"with `hf auth login`, or set HF_TOKEN){nor}") from e
  except RevisionNotFoundError as e:
    raise ModelNotFoundError(f"{where}: the repository has no revision {revision!r}") from e
  except (HfHubHTTPError, OSError) as e:
    raise ModelNotFoundError(f"{where}: cannot download it ({e})") from e
  if need and not os.path.isdir(folder):  # nothing matched, so nothing was written
    raise ModelNotFoundError(f"{where}: holds none of the files needed ({', '.join(allow)})")
  return folder
