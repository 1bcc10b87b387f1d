"""Qwen3-MoE family: Qwen3 attention with mixture-of-experts feed-forwards, published/debug
flavors, Hugging Face conversion (per-expert HF tensors <-> stacked native ones), recipes."""

from titan_core.models.protocol import HFAdapter, decoder_spec
from titan_core.models.qwen3_moe.flavors import qwen3_moe_flavors
from titan_core.models.qwen3_moe.model import Qwen3MoeModel, Qwen3MoeModelArgs
from titan_core.models.qwen3_moe.state_dict_adapter import (
    HF_ARCHITECTURES,
    HF_MODEL_TYPE,
    from_hf,
    from_hf_config,
    to_hf,
    to_hf_config,
)

MODEL_SPEC = decoder_spec(
    name="qwen3_moe",
    model_cls=Qwen3MoeModel,
    args_cls=Qwen3MoeModelArgs,
    flavors=qwen3_moe_flavors,
    hf=HFAdapter(
        architectures=HF_ARCHITECTURES,
        model_type=HF_MODEL_TYPE,
        to_hf=to_hf,
        from_hf=from_hf,
        to_hf_config=to_hf_config,
        from_hf_config=from_hf_config,
    ),
    config_registry="titan_core.models.qwen3_moe.config_registry",
    description="Qwen3-MoE (30B-A3B, 235B-A22B): routed experts, expert parallel",
)

__all__ = [
    "MODEL_SPEC",
    "Qwen3MoeModel",
    "Qwen3MoeModelArgs",
    "from_hf",
    "from_hf_config",
    "qwen3_moe_flavors",
    "to_hf",
    "to_hf_config",
]
