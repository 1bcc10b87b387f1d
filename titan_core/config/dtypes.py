"""Config dtype names as torch dtypes, and the one rule for which dtype the forward runs in."""

from __future__ import annotations

import torch

from titan_core.config.job import Training

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def autocast_dtype(training: Training, fsdp: bool) -> torch.dtype | None:
    """The autocast dtype of the forward pass, or None: float32 needs none, and under FSDP its
    MixedPrecisionPolicy (``mixed_precision_param``) sets the compute dtype instead."""
    if fsdp or training.autocast_dtype == "float32":
        return None
    return TORCH_DTYPES[training.autocast_dtype]


def compute_dtype(training: Training, fsdp: bool) -> torch.dtype:
    """The dtype matmuls run in: autocast's, else FSDP's param dtype, else float32."""
    if fsdp:
        return TORCH_DTYPES[training.mixed_precision_param]
    return autocast_dtype(training, fsdp) or torch.float32
