"""Llama 3 family: model, published/debug flavors and Hugging Face weight conversion."""

from titan_core.models.llama3.flavors import llama3_flavors
from titan_core.models.llama3.model import (
    RopeScaling,
    Transformer,
    TransformerBlock,
    TransformerModelArgs,
)
from titan_core.models.llama3.state_dict_adapter import from_hf, to_hf, to_hf_config

__all__ = [
    "RopeScaling",
    "Transformer",
    "TransformerBlock",
    "TransformerModelArgs",
    "from_hf",
    "llama3_flavors",
    "to_hf",
    "to_hf_config",
]
