"""Qwen3 dense family: model, published/debug flavors, Hugging Face conversion, recipes."""

from titan_core.models.common.family import decoder_family
from titan_core.models.qwen3.flavors import qwen3_flavors
from titan_core.models.qwen3.model import Qwen3Model, Qwen3ModelArgs
from titan_core.models.qwen3.state_dict_adapter import (
    HF,
    from_hf,
    from_hf_config,
    to_hf,
    to_hf_config,
)

MODEL_SPEC = decoder_family(
    __name__,
    Qwen3Model,
    qwen3_flavors,
    HF,
    "Qwen3 dense decoders (0.6B-32B): QK-norm, GQA, explicit head_dim",
)

__all__ = [
    "HF",
    "MODEL_SPEC",
    "Qwen3Model",
    "Qwen3ModelArgs",
    "from_hf",
    "from_hf_config",
    "qwen3_flavors",
    "to_hf",
    "to_hf_config",
]
