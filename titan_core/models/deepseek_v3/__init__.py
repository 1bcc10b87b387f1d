"""DeepSeek-V3 family (DeepSeek-V3, Moonlight, Kimi K2 shapes): multi-head latent attention,
YaRN, group-limited sigmoid routing with shared experts and the loss-free bias, multi-token
prediction; Hugging Face conversion both ways (FP8 block-scaled checkpoints read), recipes.

Parallelism: FSDP/HSDP, expert parallel, activation checkpointing, pipeline and context
parallel through the shared decoder path; tensor parallel with MLA's own plan
(``parallelize.deepseek_v3_tp_plan``). Multi-token prediction runs with FSDP/HSDP and expert
parallel only: its shifted windows and shared embedding/head do not split along the sequence
(SP, CP) or across stages (PP), so ``check`` refuses it there in one line.
"""

from __future__ import annotations

from typing import Any

from titan_core.errors import ConfigError
from titan_core.models.common.family import decoder_family
from titan_core.models.common.parallelize import check_decoder_support
from titan_core.models.deepseek_v3.flavors import deepseek_v3_flavors
from titan_core.models.deepseek_v3.model import DeepseekV3Model, DeepseekV3ModelArgs
from titan_core.models.deepseek_v3.parallelize import deepseek_v3_tp_plan
from titan_core.models.deepseek_v3.state_dict_adapter import (
    HF,
    from_hf,
    from_hf_config,
    to_hf,
    to_hf_config,
)


def check(parallel_dims: Any, cfg: Any, device_type: str, args: DeepseekV3ModelArgs) -> None:
    """The shared decoder checks, plus one line for multi-token prediction under PP."""
    if parallel_dims.pp > 1 and args.mtp_layers > 0:
        raise ConfigError(
            f"parallelism.pipeline_parallel_degree: {parallel_dims.pp} does not run multi-token "
            "prediction (its modules need the first stage's embedding after the last stage); "
            "set --model.mtp_layers 0 or use FSDP, TP, CP or expert parallel"
        )
    check_decoder_support(parallel_dims, cfg, device_type, args)


MODEL_SPEC = decoder_family(
    __name__,
    DeepseekV3Model,
    deepseek_v3_flavors,
    HF,
    "DeepSeek-V3 (Moonlight 16B, 671B, Kimi K2 1T): MLA, grouped MoE, MTP",
    tp_plan=deepseek_v3_tp_plan,
    check=check,
)

__all__ = [
    "HF",
    "MODEL_SPEC",
    "DeepseekV3Model",
    "DeepseekV3ModelArgs",
    "deepseek_v3_flavors",
    "from_hf",
    "from_hf_config",
    "to_hf",
    "to_hf_config",
]
