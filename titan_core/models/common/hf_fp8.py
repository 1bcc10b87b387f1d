"""Hugging Face checkpoints published in FP8 with block scales (DeepSeek-V3, Kimi K2, Qwen3
FP8): each quantized ``<name>.weight`` is ``float8_e4m3fn`` and ``<name>.weight_scale_inv``
holds one float32 factor per (128 x 128) block, the last blocks partial. Reading multiplies
them back, as DeepSeek's own ``fp8_cast_bf16`` does.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from titan_core.errors import CheckpointError

SCALE_SUFFIX = "_scale_inv"
BLOCK = 128


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The ``weight_scale_inv`` shape of a 2-D weight: one factor per (B x B) tile."""
    return tuple(-(-n // BLOCK) for n in shape)


def scale_shapes(
    found: Mapping[str, tuple[int, ...]], weights: Mapping[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """The shape each block scale among ``found``'s names must have, from its weight's shape in
    ``weights`` (the scales of weights not there, or not 2-D, left out: they are unknown)."""
    out = {}
    for name in found:
        weight = weights.get(name.removesuffix(SCALE_SUFFIX))
        if name.endswith(".weight" + SCALE_SUFFIX) and weight is not None and len(weight) == 2:
            out[name] = scale_shape(weight)
    return out


def dequantize_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``weight`` (rows, cols) float8 times its per-block ``scale_inv`` (ceil(rows / B),
    ceil(cols / B)) float32, computed in float32 and returned in ``dtype``."""
    rows, cols = weight.shape
    blocks = scale_shape((rows, cols))
    if tuple(scale_inv.shape) != blocks:
        raise ValueError(f"scale shape {tuple(scale_inv.shape)}, expected {blocks}")
    scale = scale_inv.float().repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)
    return (weight.float() * scale[:, :cols]).to(dtype)


def dequantize_fp8_blocks(
    hf_state_dict: dict[str, torch.Tensor], family: str
) -> dict[str, torch.Tensor]:
    """The state dict with every block-scaled FP8 weight dequantized and its scale dropped
    (unchanged when nothing is quantized). The weights come back in the dtype of the
    checkpoint's unquantized floating tensors (bf16 for the published ones). CheckpointError
    naming the tensor for a scale without its weight or a shape that does not match."""
    scales = {k for k in hf_state_dict if k.endswith(".weight" + SCALE_SUFFIX)}
    if not scales:
        return hf_state_dict
    others = [
        v.dtype
        for k, v in hf_state_dict.items()
        if k not in scales and v.is_floating_point() and v.element_size() > 1
    ]
    dtype = others[0] if others else torch.bfloat16
    out = {k: v for k, v in hf_state_dict.items() if k not in scales}
    for key in sorted(scales):
        name = key.removesuffix(SCALE_SUFFIX)
        weight = out.get(name)
        if weight is None:
            raise CheckpointError(f"from_hf: {key}: no {name} in the {family} checkpoint")
        if weight.dim() != 2:
            raise CheckpointError(f"from_hf: {name}: a block-scaled weight must be 2-D")
        try:
            out[name] = dequantize_block(weight, hf_state_dict[key], dtype)
        except ValueError as e:
            raise CheckpointError(f"from_hf: {key}: {e} for {name} {tuple(weight.shape)}") from None
    return out
