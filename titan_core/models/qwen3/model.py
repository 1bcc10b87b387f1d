"""Qwen3 (dense): the shared decoder with QK-norm, an explicit head size and FFN width."""

from __future__ import annotations

from dataclasses import dataclass

from titan_core.errors import ConfigError
from titan_core.models.common.decoder import Decoder, DecoderArgs
from titan_core.models.common.rope import RopeScaling

__all__ = ["Qwen3Model", "Qwen3ModelArgs"]


@dataclass
class Qwen3ModelArgs(DecoderArgs):
    """Shape and initialization hyper-parameters of a Qwen3 dense model (defaults: Qwen3-8B).

    Unlike Llama, ``head_dim`` is its own field (``n_heads * head_dim`` need not equal ``dim``)
    and the feed-forward width ``hidden_dim`` is given, not derived from ``dim``.
    """

    dim: int = 4096
    n_layers: int = 36
    n_heads: int = 32
    n_kv_heads: int | None = 8
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    rope_scaling: RopeScaling | None = None
    qk_norm: bool = True
    depth_init: bool = True
    head_dim: int = 128
    """Channels per attention head."""
    hidden_dim: int = 12288
    """Hidden size of the SwiGLU feed-forward (HF ``intermediate_size``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_dim <= 0 or self.head_dim % 2 != 0:
            raise ConfigError(f"model.head_dim: expected an even int > 0, got {self.head_dim!r}")
        if self.hidden_dim <= 0:
            raise ConfigError(f"model.hidden_dim: expected an int > 0, got {self.hidden_dim!r}")

    @property
    def ffn_hidden_dim(self) -> int:
        """Hidden size of the SwiGLU feed-forward."""
        return self.hidden_dim


class Qwen3Model(Decoder):
    """Qwen3 dense decoder: tokens (bs, seq) -> logits (bs, seq, vocab)."""

    def __init__(self, args: Qwen3ModelArgs) -> None:
        super().__init__(args)
