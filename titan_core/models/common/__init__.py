"""Model-agnostic transformer building blocks: attention, RoPE, RMSNorm, SwiGLU."""

from titan_core.models.common.attention import Attention, ScaledDotProductAttention, repeat_kv
from titan_core.models.common.feed_forward import FeedForward, ffn_hidden_dim
from titan_core.models.common.rmsnorm import RMSNorm
from titan_core.models.common.rope import (
    RopeScaling,
    apply_rope_scaling,
    apply_rotary_emb,
    precompute_freqs_cis,
)

__all__ = [
    "Attention",
    "FeedForward",
    "RMSNorm",
    "RopeScaling",
    "ScaledDotProductAttention",
    "apply_rope_scaling",
    "apply_rotary_emb",
    "ffn_hidden_dim",
    "precompute_freqs_cis",
    "repeat_kv",
]
