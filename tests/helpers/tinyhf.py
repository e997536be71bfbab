"""A tiny random Llama checkpoint with a real tokenizer, saved as a local HF directory.

Experiment scripts and notebooks take `--model NAME_OR_DIR`; the tests point them at this
directory so that every script runs end to end (tokenise, chat template, generate, detokenise) in
seconds, with no download. The tokenizer is a byte-level BPE trained here on a few sentences.
Also `FakeCorpus`, an in-memory corpus for the trainers' tests.
"""

from __future__ import annotations

import os

import numpy as np

from specjax.errors import InputError

TEXT = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Speculative decoding drafts several tokens and verifies them in one forward pass.",
    "Summarize the following article. Translate this sentence into German. Answer the question.",
]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_tiny_hf(path: str, *, vocab_size: int = 320, hidden: int = 64, layers: int = 2,
                 seed: int = 0) -> str:
  """Write config.json + model.safetensors + tokenizer files for a tiny random Llama to `path`
  (idempotent: an existing complete directory is reused). Returns `path`."""
  if os.path.isfile(os.path.join(path, "tokenizer.json")):
    return path
  import torch
  import transformers
  from tokenizers import ByteLevelBPETokenizer

  os.makedirs(path, exist_ok=True)
  bpe = ByteLevelBPETokenizer()
  bpe.train_from_iterator(TEXT, vocab_size=vocab_size, min_frequency=1,
                          special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
  tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer,
                                             eos_token="<|im_end|>", bos_token="<|im_start|>",
                                             pad_token="<|endoftext|>")
  tok.chat_template = CHAT_TEMPLATE
  tok.save_pretrained(path)
  torch.manual_seed(seed)
  cfg = transformers.LlamaConfig(
      vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
  model = transformers.LlamaForCausalLM(cfg).eval()
  with torch.no_grad():  # wide logits: greedy argmax without near-ties
    for p in model.parameters():
      if p.ndim > 1:
        p.normal_(0.0, 0.3)
  model.save_pretrained(path)
  return path


def put_in_hub_cache(cache: str, repo: str, folder: str, commit: str,
                     refs: tuple = ("main",)) -> str:
  """Lays `folder`'s files out in `cache` as huggingface_hub's cache holds a download of
  `repo` at `commit`: models--org--name/blobs/<sha256> (the contents),
  snapshots/<commit>/<file> (relative symlinks to the blobs) and refs/<ref> (the commit, no
  newline) for each of `refs`. With local_files_only, snapshot_download answers from refs and
  snapshots alone. Returns the snapshot directory."""
  import hashlib
  import shutil

  root = os.path.join(cache, "models--" + repo.replace("/", "--"))
  snap = os.path.join(root, "snapshots", commit)
  for dirpath, _, files in os.walk(folder):
    for f in files:
      src = os.path.join(dirpath, f)
      with open(src, "rb") as fh:
        blob = os.path.join(root, "blobs", hashlib.sha256(fh.read()).hexdigest())
      os.makedirs(os.path.dirname(blob), exist_ok=True)
      if not os.path.exists(blob):
        shutil.copyfile(src, blob)
      dst = os.path.join(snap, os.path.relpath(src, folder))
      os.makedirs(os.path.dirname(dst), exist_ok=True)
      os.symlink(os.path.relpath(blob, os.path.dirname(dst)), dst)
  os.makedirs(os.path.join(root, "refs"), exist_ok=True)
  for ref in refs:
    with open(os.path.join(root, "refs", ref), "w") as fh:
      fh.write(commit)
  return snap


def torch_decoder_layer(x, residual, sd: dict, prefix: str, cfg: dict):
  """One Llama decoder layer in torch from a state dict, the tests' reference for EAGLE's draft
  layers: causal self-attention over the rows of x [n, in] (rotary positions 0..n-1, grouped kv
  heads; q/k/v_proj read x as it is: a layout with an input norm applies it to x first) added to
  residual [n, E], then post_attention_layernorm and the SwiGLU MLP, added. -> [n, E]."""
  import torch
  import torch.nn.functional as F

  n, nh, kv = x.shape[0], cfg["num_attention_heads"], cfg["num_key_value_heads"]
  d = cfg["hidden_size"] // nh
  a, m = prefix + "self_attn.", prefix + "mlp."
  q = F.linear(x, sd[a + "q_proj.weight"]).view(n, nh, d).transpose(0, 1)
  k = F.linear(x, sd[a + "k_proj.weight"]).view(n, kv, d).transpose(0, 1)
  v = F.linear(x, sd[a + "v_proj.weight"]).view(n, kv, d).transpose(0, 1)
  inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, d, 2).float() / d)
  ang = torch.arange(n).float()[:, None] * inv[None]
  cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
  rot = lambda u: torch.cat([-u[..., d // 2:], u[..., :d // 2]], -1)  # noqa: E731
  q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
  k, v = k.repeat_interleave(nh // kv, 0), v.repeat_interleave(nh // kv, 0)
  att = (q @ k.transpose(1, 2)) / d ** 0.5
  att = att.masked_fill(torch.ones(n, n).triu(1).bool(), -float("inf")).softmax(-1)
  h = residual + F.linear((att @ v).transpose(0, 1).reshape(n, nh * d), sd[a + "o_proj.weight"])
  y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"])
  y = y * sd[prefix + "post_attention_layernorm.weight"]
  return h + F.linear(F.silu(F.linear(y, sd[m + "gate_proj.weight"])) * F.linear(y, sd[m + "up_proj.weight"]),
                      sd[m + "down_proj.weight"])


def random_llama(path: str, *, layers: int, vocab_size: int = 61, hidden: int = 32,
                 std: float = 0.2, seed: int = 0):
  """A tiny random transformers LlamaForCausalLM (4 heads, 2 kv heads, every matrix N(0, std^2)),
  saved to path for sj.load_model; returns (path, the torch module, for references)."""
  import torch
  import transformers

  torch.manual_seed(seed)
  cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=48,
                                 num_hidden_layers=layers, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=512,
                                 rope_theta=10000.0, tie_word_embeddings=False)
  model = transformers.LlamaForCausalLM(cfg).eval()
  with torch.no_grad():
    for p in model.parameters():
      if p.ndim > 1:
        p.normal_(0.0, std)
  model.save_pretrained(path)
  return path, model


class FakeCorpus:
  """training/corpus.Corpus's reading interface over in-memory sequences (prompt + response), with
  the same window semantics: consecutive windows overlapping by one token, mask[t] True where
  tok[t+1] is a response token, held-out sequences chosen by a pure function of (seed, index)."""

  def __init__(self, seqs, prompt_lens, vocab_size, model="tiny"):
    self.seqs = [np.asarray(s, np.int32) for s in seqs]
    self.prompt_lens = list(prompt_lens)
    self.path = "<fake>"
    self.meta = {"model": model, "vocab_size": vocab_size, "weights_sha256": ""}

  def __len__(self):
    return len(self.seqs)

  def sequence(self, i):
    return self.seqs[i], self.prompt_lens[i]

  def check_compatible(self, target):
    if self.meta["vocab_size"] != target.config.vocab_size:
      raise InputError(f"corpus vocab_size={self.meta['vocab_size']} != target's "
                          f"{target.config.vocab_size}")

  def windows(self, seq_len, split="train", held_out=0.02, seed=0):
    chosen = (np.random.default_rng([seed, 7919]).random(len(self)) < held_out) == (split == "heldout")
    toks, masks = [], []
    for i in np.flatnonzero(chosen):
      seq, p = self.sequence(i)
      for s in range(0, max(len(seq) - 1, 1), seq_len - 1):
        t = np.zeros(seq_len, np.int32)
        w = seq[s:s + seq_len]
        t[:len(w)] = w
        nxt = s + 1 + np.arange(seq_len)
        m = (nxt < len(seq)) & (nxt >= p)
        if m.any():
          toks.append(t)
          masks.append(m)
    if not toks:
      return np.zeros((0, seq_len), np.int32), np.zeros((0, seq_len), bool)
    return np.stack(toks), np.stack(masks)
