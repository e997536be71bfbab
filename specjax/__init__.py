"""specjax: speculative decoding in JAX. Public API (re-exported names only)."""

from specjax.api import generate
from specjax.config import ModelConfig
from specjax.decode import DecodeState, GenerateOutput, Method
from specjax.drafters import export_heads, head_logits
from specjax.errors import (ConfigError, InputError, ModelNotFoundError, SpecJaxError,
                            WeightsError)
from specjax.heads import init_heads, load_heads
from specjax.invariance import BatchInvariance
from specjax.methods import (MTP, Autoregressive, DFlash, DraftModel, Eagle, Hybrid, Lookahead, Medusa,
                             ParallelDraft, PromptLookup, QuantizedDraft, SelfSpeculative, SuffixDecoding,
                             SuffixStore)
from specjax.methods import names as _method_names
from specjax.model import Model
from specjax.weights import load_model

METHODS = tuple(_method_names())  # the registered method names (specjax.methods.REGISTRY)

__all__ = [
    "METHODS", "MTP", "Autoregressive", "BatchInvariance", "ConfigError", "DecodeState", "DFlash", "DraftModel",
    "Eagle",
    "GenerateOutput", "Hybrid", "InputError", "Lookahead", "Medusa", "Method", "Model",
    "ModelConfig", "ModelNotFoundError", "ParallelDraft", "PromptLookup", "QuantizedDraft", "SelfSpeculative",
    "SpecJaxError", "SuffixDecoding", "SuffixStore", "WeightsError", "export_heads", "generate",
    "head_logits", "init_heads", "load_heads", "load_model",
]
