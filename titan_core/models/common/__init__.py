"""Model-agnostic transformer building blocks: attention, document masks, RoPE, RMSNorm,
SwiGLU."""

from titan_core.models.common.attention import Attention, ScaledDotProductAttention, repeat_kv
from titan_core.models.common.feed_forward import FeedForward, ffn_hidden_dim
from titan_core.models.common.masking import (
    AttentionMask,
    document_block_mask,
    document_causal_mask,
    document_mask,
    document_positions,
)
from titan_core.models.common.rmsnorm import RMSNorm
from titan_core.models.common.rope import (
    RopeScaling,
    apply_rope_scaling,
    apply_rotary_emb,
    freqs_at,
    precompute_freqs_cis,
)

__all__ = [
    "Attention",
    "AttentionMask",
    "FeedForward",
    "RMSNorm",
    "RopeScaling",
    "ScaledDotProductAttention",
    "apply_rope_scaling",
    "apply_rotary_emb",
    "document_block_mask",
    "document_causal_mask",
    "document_mask",
    "document_positions",
    "ffn_hidden_dim",
    "freqs_at",
    "precompute_freqs_cis",
    "repeat_kv",
]
