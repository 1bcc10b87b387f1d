"""Rotary position embeddings in Meta's convention: complex ``freqs_cis``, interleaved pairs."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class RopeScaling:
    """Llama 3.1 RoPE frequency scaling (HF ``rope_type="llama3"``)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def apply_rope_scaling(freqs: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Stretch the low frequencies of ``freqs`` (head_dim // 2,) as Llama 3.1 does."""
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context_len / scaling.low_freq_factor
    high_freq_wavelen = old_context_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / freqs
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated;
    # written exactly as HF's _compute_llama3_parameters so exported models agree to the last bit.
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / scaling.factor, freqs)
    smooth = (old_context_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def precompute_freqs_cis(
    dim: int, end: int, theta: float = 10000.0, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """Unit complex rotations for positions ``[0, end)``: shape (end, dim // 2), complex64."""
    # int64 arange then float matches HF's inv_freq bit for bit.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64)[: dim // 2].float() / dim
    freqs = 1.0 / (theta**exponents)  # (dim // 2,)
    if scaling is not None:
        freqs = apply_rope_scaling(freqs, scaling)
    t = torch.arange(end, dtype=torch.float32)
    angles = torch.outer(t, freqs)  # (end, dim // 2)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (bs, seq, n_heads, head_dim) and k (bs, seq, n_kv_heads, head_dim) by position.

    ``freqs_cis`` is either the table (>= ``seq`` rows, the first ``seq`` used, so callers may
    pass the whole table: under sequence parallelism only attention sees the full sequence), or
    one row per token (bs, seq, head_dim // 2) from ``freqs_at``.
    """
    bs, seq, half = xq.shape[0], xq.shape[1], xq.shape[-1] // 2
    if freqs_cis.dim() == 3:  # per-token rows
        assert freqs_cis.shape == (bs, seq, half), (
            f"freqs_cis {tuple(freqs_cis.shape)} does not match {(bs, seq, half)}"
        )
        freqs = freqs_cis.view(bs, seq, 1, half)
    else:
        assert freqs_cis.shape[0] >= seq and freqs_cis.shape[1] == half, (
            f"freqs_cis {tuple(freqs_cis.shape)} too small for {(seq, half)}"
        )
        freqs = freqs_cis[:seq].view(1, seq, 1, half)
    # Rotation in fp32 even under bf16 autocast/FSDP mixed precision: angles at long positions
    # lose too much precision otherwise.
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], half, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], half, 2))
    xq_out = torch.view_as_real(xq_ * freqs).flatten(3)  # (bs, seq, n_heads, head_dim)
    xk_out = torch.view_as_real(xk_ * freqs).flatten(3)  # (bs, seq, n_kv_heads, head_dim)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def freqs_at(freqs_cis: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows of the table ``freqs_cis`` (end, head_dim // 2) at ``positions`` (bs, seq):
    (bs, seq, head_dim // 2), for ``apply_rotary_emb`` when positions differ per sample."""
    return freqs_cis[positions]
