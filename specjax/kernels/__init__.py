"""Ground-floor CPU kernels: plain array operations that know nothing of the model.

    matmul.py   a weight-streaming matmul (matmul.cc through jax.ffi) for 1..32-row products,
                beside its pure-JAX fallback: `dense`, `pack_weight`, loading and ISA control
    blocks.py   a matmul on GGUF's quantized blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K; blocks.cc
                through jax.ffi) beside its dequantise-in-JAX fallback: `blocks_dense`,
                `pack_blocks`, `dequantize`
    quant.py    4- / 8-bit weight blocks (Q4_1, Q8_0) times int8 activations in pure JAX (a
                quantized self-draft's products; qdot.py's kernel where available): `QWeight`,
                `quantize_weight`, `quantize_activations`, `qdense`
    qdot.py     int8 activations x Q4_1 blocks with the CPU's integer dot (qdot.cc), beside
                its JAX reference: a quantized self-draft's products
    attention.py  decode attention over a static KV cache plus the step's new entries
                (attention.cc through jax.ffi: only the slots a row sees, both products and the
                softmax in one pass) beside its XLA form: `attend`
    library.py  one C++ library as Python sees it: build, load, ISA choice, FFI registration
    build.py    compiles the C++ sources with the system compiler into a per-user cache, once
    isa.h, handler.h, pool.h  what the four C++ sources share: the instruction-set parts and
                their dispatch, the FFI handler shape and ctypes exports, the thread pool;
                fp16.h the scalar paths' exact fp16 -> fp32 (blocks.cc, qdot.cc)

Packing a model's dense weights for these kernels (which weights, where the copies live, when
load_model packs) is specjax/packing.py; model.py calls only `dense` (blocks.dense: a packed
copy of either kind, or none) and `attention.attend` (on its kernel where the layer has a packed
copy). This package re-exports the matmul's public names, so
`from specjax import kernels; kernels.dense(...)` reads as before. Each kernel module's loading
state is its `LIBRARY` (library.Library); its `_detect_isa` hook lives in the module: patch it
there.
"""

from specjax.kernels import matmul
from specjax.kernels.matmul import (BLOCK_WIDTHS, ENV, ISAS, MAX_ROWS, TARGET,
                                    KernelFallbackWarning, available, block_width, isa, load,
                                    pack_weight, set_isa, switched_off, threads)
from specjax.kernels.blocks import QTYPES, blocks_dense, dense, dequantize, pack_blocks
from specjax.kernels import quant
from specjax.kernels.quant import QWeight, qdense, quantize_activations, quantize_weight

__all__ = ["BLOCK_WIDTHS", "ENV", "ISAS", "MAX_ROWS", "QTYPES", "TARGET", "KernelFallbackWarning",
           "QWeight", "available", "block_width", "blocks", "blocks_dense", "dense", "dequantize",
           "isa", "load", "matmul", "pack_blocks", "pack_weight", "qdense", "quant",
           "quantize_activations", "quantize_weight", "set_isa", "switched_off", "threads"]
