"""Qwen3 dense family: model, published/debug flavors, Hugging Face conversion, recipes."""

from titan_core.models.protocol import HFAdapter, decoder_spec
from titan_core.models.qwen3.flavors import qwen3_flavors
from titan_core.models.qwen3.model import Qwen3Model, Qwen3ModelArgs
from titan_core.models.qwen3.state_dict_adapter import (
    HF_ARCHITECTURES,
    HF_MODEL_TYPE,
    from_hf,
    from_hf_config,
    to_hf,
    to_hf_config,
)

MODEL_SPEC = decoder_spec(
    name="qwen3",
    model_cls=Qwen3Model,
    args_cls=Qwen3ModelArgs,
    flavors=qwen3_flavors,
    hf=HFAdapter(
        architectures=HF_ARCHITECTURES,
        model_type=HF_MODEL_TYPE,
        to_hf=to_hf,
        from_hf=from_hf,
        to_hf_config=to_hf_config,
        from_hf_config=from_hf_config,
    ),
    config_registry="titan_core.models.qwen3.config_registry",
    description="Qwen3 dense decoders (0.6B-32B): QK-norm, GQA, explicit head_dim",
)

__all__ = [
    "MODEL_SPEC",
    "Qwen3Model",
    "Qwen3ModelArgs",
    "from_hf",
    "from_hf_config",
    "qwen3_flavors",
    "to_hf",
    "to_hf_config",
]
