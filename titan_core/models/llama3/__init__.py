"""Llama 3 family: model, published/debug flavors, Hugging Face conversion, recipes."""

from titan_core.models.common.decoder import DecoderBlock as TransformerBlock
from titan_core.models.llama3.flavors import llama3_flavors
from titan_core.models.llama3.model import RopeScaling, Transformer, TransformerModelArgs
from titan_core.models.llama3.state_dict_adapter import (
    HF_ARCHITECTURES,
    HF_MODEL_TYPE,
    from_hf,
    from_hf_config,
    to_hf,
    to_hf_config,
)
from titan_core.models.protocol import HFAdapter, decoder_spec

MODEL_SPEC = decoder_spec(
    name="llama3",
    model_cls=Transformer,
    args_cls=TransformerModelArgs,
    flavors=llama3_flavors,
    hf=HFAdapter(
        architectures=HF_ARCHITECTURES,
        model_type=HF_MODEL_TYPE,
        to_hf=to_hf,
        from_hf=from_hf,
        to_hf_config=to_hf_config,
        from_hf_config=from_hf_config,
    ),
    config_registry="titan_core.models.llama3.config_registry",
    description="Meta Llama 3 / 3.1 / 3.2 dense decoders",
)

__all__ = [
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
