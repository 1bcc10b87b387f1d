"""Helpers the families' Hugging Face adapters share: RoPE layout permutations and config reading.

The engine's RoPE rotates interleaved channel pairs (Meta's layout); ``transformers`` rotates
halves (``rotate_half``). Query/key projection rows (and a QK-norm's scale) are permuted within
each head on the way out and back; nothing else changes.
"""

from __future__ import annotations

from typing import Any

import torch

from titan_core.errors import CheckpointError
from titan_core.models.common.rope import RopeScaling


def to_rotate_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's rows from interleaved pairs (Meta) to halves (HF rotate_half).

    ``w`` is (n_heads * head_dim, ...) — a projection weight or a 1-D norm scale."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Exact inverse of ``to_rotate_half``."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *rest).transpose(1, 2).reshape(w.shape)


def require_keys(config: dict[str, Any], source: str, keys: tuple[str, ...]) -> None:
    """CheckpointError naming the ``config.json`` keys that are missing."""
    missing = [k for k in keys if k not in config]
    if missing:
        raise CheckpointError(f"hf: {source} lacks {', '.join(missing)}")


def rope_from_config(config: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """(theta, Llama 3.1 scaling or None) from ``rope_parameters`` (transformers >= 5) or the
    4.x ``rope_theta`` / ``rope_scaling`` keys; other RoPE types are refused."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise CheckpointError(
            f"hf: {source}: rope_type {rope_type!r} is not supported (default, llama3)"
        )
    defaults = RopeScaling()
    return theta, RopeScaling(
        factor=float(rope.get("factor", defaults.factor)),
        low_freq_factor=float(rope.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(rope.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(
            rope.get("original_max_position_embeddings", defaults.original_max_position_embeddings)
        ),
    )


def rope_parameters(theta: float, scaling: RopeScaling | None) -> dict[str, Any]:
    """``rope_parameters`` for ``config.json`` (transformers >= 5 reads theta and scaling only
    from it; 4.x took ``rope_theta`` and ``rope_scaling`` at top level instead)."""
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    return {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
    }


def refuse_biases(config: dict[str, Any], source: str) -> None:
    """CheckpointError for projections with biases (no family here has them)."""
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise CheckpointError(f"hf: {source}: attention_bias / mlp_bias are not supported")
