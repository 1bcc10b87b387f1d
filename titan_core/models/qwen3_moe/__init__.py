"""Qwen3-MoE family: Qwen3 attention with mixture-of-experts feed-forwards, published/debug
flavors, Hugging Face conversion (per-expert HF tensors <-> stacked native ones), recipes."""

from titan_core.models.common.family import decoder_family
from titan_core.models.qwen3_moe.flavors import qwen3_moe_flavors
from titan_core.models.qwen3_moe.model import Qwen3MoeModel, Qwen3MoeModelArgs
from titan_core.models.qwen3_moe.state_dict_adapter import (
    HF,
    from_hf,
    from_hf_config,
    to_hf,
    to_hf_config,
)

MODEL_SPEC = decoder_family(
    __name__,
    Qwen3MoeModel,
    qwen3_moe_flavors,
    HF,
    "Qwen3-MoE (30B-A3B, 235B-A22B): routed experts, expert parallel",
)

__all__ = [
    "HF",
    "MODEL_SPEC",
    "Qwen3MoeModel",
    "Qwen3MoeModelArgs",
    "from_hf",
    "from_hf_config",
    "qwen3_moe_flavors",
    "to_hf",
    "to_hf_config",
]
