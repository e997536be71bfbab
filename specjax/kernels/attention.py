"""Decode attention over a static KV cache (attention.cc through jax.ffi), beside its XLA form.

    o [B,T,K,G,D] = softmax(scale * q.k over the visible columns) @ v for queries q [B,T,K,G,D]
                    (G per kv head), the columns the cache's S slots [B,K,S,D] then the T new
                    entries [B,T,K,D]; mask [B,T,S+T]. q and o keep the layout of the QKV product
                    and of the output projection's input, so neither side transposes.

Why. For T > 1 new tokens (a verification block, a tree, a lookahead window) XLA's CPU attention
runs its two products as separate dot operations over every cache slot, filled or not, with
transposes, a concatenation and a masked softmax around them: about a third of a T = 8 forward of
SmolLM2-135M with 256 of 512 slots filled (experiments/kernels/README.md, "attention"). The kernel
reads only the slots a row can see (up to its last visible one) and does the softmax and both
products in one pass per row, on the thread pool. A prompt's prefill (no cache, T = the prompt
bucket) runs on it too: XLA's form computes the whole T x T block there, the kernel per chunk of
rows only the new entries up to the chunk's last token.

`attend` is the one definition of the attention arithmetic (the model's Attention calls it): the
kernel where `kernel=True` and the operands are float32, else `_xla`, which is
also what the kernel is tested against (equal up to fp32 summation order and exp's last bit) and
the rule every gradient uses (a custom_vjp). The switch is the model's: a layer whose dense
weights have a packed copy (the matmul or blocks kernel: packed at load on one CPU device; or a
quantized self-draft's copy) runs attention on this one; `kernels=False` at load (nothing packed)
or SPECJAX_KERNELS=0 turns it off. If the library cannot be built or the CPU has neither AVX-512
nor AVX2+FMA, specjax warns once and stays on XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels.library import ISAS, Library, on_cpu, switched_off  # noqa: F401

TARGET = "specjax_attention_f32"


def _detect_isa(lib) -> int:
  """The best path this CPU supports (tests replace this hook to simulate another CPU)."""
  return lib.specjax_attention_detected_isa()


LIBRARY = Library("attention", "specjax_attention", "SpecjaxAttentionF32", TARGET,
                  instead="using XLA's attention",
                  lacking="this CPU has neither AVX-512 nor AVX2+FMA: the portable kernel would "
                  "be slower than XLA", detect=lambda lib: _detect_isa(lib))

# The module's loading and ISA control are its Library's (library.py).
load, available, isa, set_isa, threads = LIBRARY.api()


def _xla(q, kc, vc, kn, vn, mask, scale: float, softcap: float | None):
  """The attention in XLA operations. q [B,T,K,G,D] (the T tokens' queries, G per kv head); kc, vc
  [B,K,S,D] or None (an empty cache: only the new entries are attended); kn, vn [B,T,K,D]; mask
  [B,T,W] with W = S + T (T without a cache) -> [B,T,K,G,D] in q's dtype. The T x G queries of a
  kv head form one [T*G, D] block: a plain batched matmul over (B, K)."""
  b, t, kd, g, d = q.shape
  cdt = (kc if kc is not None else kn).dtype
  q = jnp.transpose(q, (0, 2, 1, 3, 4)).reshape(b, kd, t * g, d)  # [B,K,T*G,D]
  kn, vn = jnp.swapaxes(kn, 1, 2).astype(cdt), jnp.swapaxes(vn, 1, 2).astype(cdt)  # [B,K,T,D]
  new = jnp.einsum("bkqd,bktd->bkqt", q, kn)
  if kc is None:
    scores = new.astype(jnp.float32) * scale
  else:
    scores = jnp.concatenate([jnp.einsum("bkqd,bksd->bkqs", q, kc), new],
                             axis=-1).astype(jnp.float32) * scale  # [B,K,T*G,S+T]
  if softcap:
    scores = softcap * jnp.tanh(scores / softcap)
  w = mask.shape[-1]
  qmask = jnp.broadcast_to(mask[:, None, :, None, :], (b, 1, t, g, w)).reshape(b, 1, t * g, w)
  scores = jnp.where(qmask, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
  o = jnp.einsum("bkqt,bktd->bkqd", probs[..., w - t:], vn)
  if kc is not None:
    o = o + jnp.einsum("bkqs,bksd->bkqd", probs[..., :w - t], vc)
  return jnp.transpose(o.reshape(b, kd, t, g, d), (0, 2, 1, 3, 4))


def _ffi(q, kc, vc, kn, vn, mask, scale, softcap):
  return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                          vmap_method="sequential")(
      q, kc, vc, kn, vn, mask, scale=np.float32(scale), softcap=np.float32(softcap or 0.0))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _kernel(q, kc, vc, kn, vn, mask, scale, softcap):
  return _ffi(q, kc, vc, kn, vn, mask, scale, softcap)


def _wide(q, kc, vc, kn, vn, mask, scale, softcap):
  """`_xla` over a cache read into q's float32, as the kernel reads a bfloat16 one."""
  return _xla(q, kc.astype(q.dtype), vc.astype(q.dtype), kn, vn, mask, scale, softcap)


def _kernel_fwd(q, kc, vc, kn, vn, mask, scale, softcap):
  return _wide(q, kc, vc, kn, vn, mask, scale, softcap), (q, kc, vc, kn, vn, mask)


def _kernel_bwd(scale, softcap, res, g):
  q, kc, vc, kn, vn, mask = res
  _, vjp = jax.vjp(lambda *a: _wide(*a, mask, scale, softcap), q, kc, vc, kn, vn)
  return (*vjp(g), None)


_kernel.defvjp(_kernel_fwd, _kernel_bwd)


def attend(q, kc, vc, kn, vn, mask, *, scale: float, softcap: float | None = None,
           kernel: bool = False):
  """Attention of q over the cache (kc, vc; None for an empty cache) and the new entries (kn, vn)
  under mask; see `_xla` for the shapes. kernel: run attention.cc where it applies (float32
  operands, the library available), else XLA. An empty cache (a prompt's prefill) goes to the
  kernel as one of 0 slots: it reads, per chunk of rows, the new entries up to the last one a row
  of the chunk sees (about half of a causal block's).

  bfloat16 operands (a bf16 model on the kernels) are read into float32 and attend there, on the
  kernel, the output rounded back to bf16: XLA's bf16 attention rounds by shape (a row of an
  8-token block differed from its one-token forward, by up to 0.5 in the logits), the kernel's
  float32 sums do not. The query and the new entries are converted here; the cache goes in as
  bf16 and the kernel widens the slots it reads (converting all of it here cost every decoding
  step a pass over the whole cache in every layer)."""
  floats = {a.dtype for a in (q, kn, vn) + (() if kc is None else (kc, vc))}
  if kernel and floats == {jnp.dtype(jnp.bfloat16)} and mask.dtype == jnp.bool_ and available():
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    return attend(f32(q), kc, vc, f32(kn), f32(vn), mask, scale=scale,
                  softcap=softcap, kernel=True).astype(q.dtype)
  cache_ok = kc is None or kc.dtype == vc.dtype and kc.dtype in (jnp.float32, jnp.bfloat16)
  if (kernel and cache_ok and q.dtype == kn.dtype == vn.dtype == jnp.float32
          and mask.dtype == jnp.bool_ and available()):
    cache = (kc, vc)
    if kc is None:
      b, _, kd, _, d = q.shape
      cache = (jnp.zeros((b, kd, 0, d), jnp.float32),) * 2

    def fallback(q, kc0, vc0, *rest):  # (elsewhere than a CPU: XLA, over a float32 cache)
      if kc is None:
        return _xla(q, None, None, *rest, scale, softcap)
      return _wide(q, kc0, vc0, *rest, scale, softcap)

    return on_cpu(lambda *a: _kernel(*a, float(scale), float(softcap or 0.0)), fallback,
                  q, *cache, kn, vn, mask)
  return _xla(q, kc, vc, kn, vn, mask, scale, softcap)
