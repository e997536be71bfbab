"""specjax: speculative decoding in JAX. Public API (re-exported names only)."""

from specjax.config import ModelConfig
from specjax.decode import Autoregressive, DecodeState, GenerateOutput, generate
from specjax.errors import (ConfigError, InputError, ModelNotFoundError, SpecJaxError,
                            WeightsError)
from specjax.model import Model
from specjax.weights import load_model

__all__ = [
    "Autoregressive", "ConfigError", "DecodeState", "GenerateOutput", "InputError", "Model",
    "ModelConfig", "ModelNotFoundError", "SpecJaxError", "WeightsError", "generate", "load_model",
]

from specjax.methods.prompt_lookup import PromptLookup  # noqa: E402
__all__ += ["PromptLookup"]
from specjax.methods.lookahead import Lookahead  # noqa: E402
__all__ += ["Lookahead"]

from specjax.methods.draft import DraftModel, SelfSpeculative  # noqa: E402

__all__ += ["DraftModel", "SelfSpeculative"]

from specjax.heads import init_heads, load_heads  # noqa: E402
from specjax.methods.eagle import Eagle  # noqa: E402
from specjax.methods.medusa import Medusa  # noqa: E402
from specjax.methods.mtp import MTP  # noqa: E402

__all__ += ["Eagle", "MTP", "Medusa", "init_heads", "load_heads"]
