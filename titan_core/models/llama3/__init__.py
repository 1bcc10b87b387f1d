"""Llama 3 family: model, published/debug flavors, Hugging Face conversion, recipes."""

from titan_core.models.common.decoder import DecoderBlock as TransformerBlock
from titan_core.models.common.family import decoder_family
from titan_core.models.llama3.flavors import llama3_flavors
from titan_core.models.llama3.model import RopeScaling, Transformer, TransformerModelArgs
from titan_core.models.llama3.state_dict_adapter import (
    HF,
    from_hf,
    from_hf_config,
    to_hf,
    to_hf_config,
)

MODEL_SPEC = decoder_family(
    __name__, Transformer, llama3_flavors, HF, "Meta Llama 3 / 3.1 / 3.2 dense decoders"
)

__all__ = [
    "HF",
    "MODEL_SPEC",
    "RopeScaling",
    "Transformer",
    "TransformerBlock",
    "TransformerModelArgs",
    "from_hf",
    "from_hf_config",
    "llama3_flavors",
    "to_hf",
    "to_hf_config",
]
