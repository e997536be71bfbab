"""MTP modules (DeepSeek-V3's multi-token prediction) as an nnx module.

Module k reads, at position i, the embedding of token x_{i+k+1} and module k - 1's output h^k_i
(the target's feature for k = 0), each RMS-normed ("norm_e", "norm_h" [K,E]), then runs EAGLE's
fc and one target Block (`eagle.FeatureLayer`): x = [RMSNorm_e(emb), RMSNorm_h(h)] W_fc + b_fc.
Its output is a residual stream, read through its own output norm ("norm_o" [K,E], published
DeepSeek-V3 layers) or else the target's final norm, then the target's LM head. Params and init:
specjax/drafters/eagle.py (`feature_shapes`, `init_modules` of MtpModule).
"""

from __future__ import annotations

from flax import nnx

from specjax.drafters import layer as ly
from specjax.drafters.eagle import FeatureLayer


class MtpModule(FeatureLayer):
  """One MTP module over its arrays (`layer.module_arrays`)."""

  kind = "mtp"
  modules = (2, 16, "")  # (default, most, why) modules per head
  norms = ("norm_e", "norm_h")

  def __init__(self, heads_config, config, mod: dict):
    super().__init__(heads_config, config, mod)
    self.eps = config.norm_eps
    self.norm_e, self.norm_h = nnx.Param(mod["norm_e"]), nnx.Param(mod["norm_h"])
    own = mod.get("norm_o")  # published DeepSeek-V3 layers have their own output norm
    self.norm_o = None if own is None else nnx.Param(own)

  def inputs(self, emb, feat):
    return ly.rms(emb, self.norm_e[...], self.eps), ly.rms(feat, self.norm_h[...], self.eps)

  def out(self, h):
    """The module's output h [...,E] -> what the LM head reads: its own output norm's, else None
    (the caller applies the target's final norm)."""
    return None if self.norm_o is None else ly.rms(h, self.norm_o[...], self.eps)
