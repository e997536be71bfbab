"""Drafting heads on a frozen target, the user's API; the code lives in specjax/drafters/.

    heads = sj.init_heads(target, "medusa", num_heads=4, seed=0)   # untrained
    heads = sj.load_heads("smollm2-135m-medusa")                  # shipped (specjax/assets)
    heads = sj.load_heads("my_heads.npz", target)                 # checked against the target
    save_heads(heads, "my_heads.npz")

Heads are data, a frozen config plus a params pytree (specjax/drafters/heads_file.py, with their
file format); the kind a config names picks the nnx module that runs them, one type per kind
(specjax/drafters/kinds.py): Medusa-1 heads (drafters/medusa.py), EAGLE-1/2 heads with or
without fused features (drafters/eagle.py), MTP modules (drafters/mtp.py), EAGLE-3 heads
(drafters/eagle3.py) and DFlash drafters (drafters/dflash.py).
"""

from __future__ import annotations

from specjax.drafters.eagle import add_taps, check_taps, feature_shapes, init_modules
from specjax.drafters.eagle3 import init_eagle3_heads, midlayer_config
from specjax.drafters.heads_file import (FEATURE_KINDS, HEADS_FILE, KINDS, NAMED_HEADS, Heads,
                                         HeadsConfig, save_heads)
from specjax.drafters.kinds import (MODULES, check_fits, drafter, init_feature_heads, init_heads,
                                    load_heads, module_type)
from specjax.drafters.layer import layer_template, module_arrays, pack_module
from specjax.drafters.medusa import medusa_hidden
from specjax.sampling import top_k_ids

__all__ = ["FEATURE_KINDS", "HEADS_FILE", "KINDS", "MODULES", "NAMED_HEADS", "Heads",
           "HeadsConfig", "add_taps", "check_fits", "check_taps", "drafter", "feature_shapes",
           "init_eagle3_heads", "init_feature_heads", "init_heads", "init_modules",
           "layer_template", "load_heads", "medusa_hidden", "midlayer_config", "module_arrays",
           "module_type", "pack_module", "save_heads", "top_k_ids"]
