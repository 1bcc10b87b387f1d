"""Rotary position embeddings in Meta's convention: complex ``freqs_cis``, interleaved pairs.

Frequency scaling: Llama 3.1's (``RopeScaling``) and YaRN (``YarnScaling``, DeepSeek-V3, Kimi
K2), whose attention-temperature correction multiplies the table (``yarn_attention_factor``) and
the softmax scale (``yarn_softmax_mscale``)."""

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


@dataclass
class YarnScaling:
    """YaRN RoPE scaling (HF ``rope_type="yarn"``) as DeepSeek-V3 uses it: frequencies between
    the ``beta_fast`` and ``beta_slow`` rotation counts ramp from kept to divided by ``factor``.

    ``mscale`` / ``mscale_all_dim`` set the attention-temperature correction: the rotary table
    is multiplied by ``yarn_attention_factor`` (1 when the two are equal, as in DeepSeek-V3),
    and attention's softmax scale by ``yarn_softmax_mscale`` squared (HF takes it from
    ``mscale_all_dim``)."""

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    truncate: bool = True
    """Round the correction range outward to whole dims (HF's default)."""


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's temperature ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(scaling: YarnScaling) -> float:
    """Magnitude of the rotary table: ``mscale(factor, mscale) / mscale(factor, all_dim)`` when
    both are set, else ``mscale(factor)`` (HF ``_compute_yarn_parameters``)."""
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_get_mscale(scaling.factor, scaling.mscale) / yarn_get_mscale(
            scaling.factor, scaling.mscale_all_dim
        )
    return yarn_get_mscale(scaling.factor)


def yarn_softmax_mscale(scaling: YarnScaling | None) -> float:
    """Factor on the softmax scale's square root: ``mscale(factor, mscale_all_dim)`` (1 without
    YaRN or with ``mscale_all_dim`` 0), as DeepSeek's attention applies it."""
    if scaling is None or not scaling.mscale_all_dim:
        return 1.0
    return yarn_get_mscale(scaling.factor, scaling.mscale_all_dim)


def yarn_freqs(exponents: torch.Tensor, dim: int, theta: float, s: YarnScaling) -> torch.Tensor:
    """YaRN's blend of the frequencies ``theta ** -exponents`` (dim // 2,) and the same divided
    by ``factor``, written as HF's ``_compute_yarn_parameters`` so the tables agree bit for bit."""

    def correction_dim(rotations: float) -> float:
        ctx = s.original_max_position_embeddings
        return (dim * math.log(ctx / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the frequency, 0: divide it by the factor
    pos_freqs = theta**exponents
    return 1.0 / (s.factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


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
    dim: int,
    end: int,
    theta: float = 10000.0,
    scaling: RopeScaling | YarnScaling | None = None,
) -> torch.Tensor:
    """Complex rotations for positions ``[0, end)``: shape (end, dim // 2), complex64; unit
    magnitude except under YaRN (``yarn_attention_factor``)."""
    # int64 arange then float matches HF's inv_freq bit for bit.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64)[: dim // 2].float() / dim
    freqs = 1.0 / (theta**exponents)  # (dim // 2,)
    magnitude = 1.0
    if isinstance(scaling, YarnScaling):
        freqs = yarn_freqs(exponents, dim, theta, scaling)
        magnitude = yarn_attention_factor(scaling)
    elif scaling is not None:
        freqs = apply_rope_scaling(freqs, scaling)
    t = torch.arange(end, dtype=torch.float32)
    angles = torch.outer(t, freqs)  # (end, dim // 2)
    return torch.polar(torch.full_like(angles, magnitude), angles)


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
