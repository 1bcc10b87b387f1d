"""PLACEHOLDER (helper A replaces this file): Qwen3-MoE <-> HF ``Qwen3MoeForCausalLM``."""

from __future__ import annotations

from typing import Any

from titan_core.errors import CheckpointError

HF_ARCHITECTURES = ("Qwen3MoeForCausalLM",)
HF_MODEL_TYPE = "qwen3_moe"


def _todo(*_: Any) -> Any:
    raise CheckpointError("qwen3_moe: HF conversion is not written yet")


to_hf = from_hf = to_hf_config = from_hf_config = _todo
