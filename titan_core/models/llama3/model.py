"""Llama 3: the shared decoder with Meta's SwiGLU sizing rule and Llama 3.1 RoPE scaling."""

from __future__ import annotations

from dataclasses import dataclass

from titan_core.errors import ConfigError
from titan_core.models.common import RopeScaling, ffn_hidden_dim
from titan_core.models.common.decoder import Decoder, DecoderArgs

__all__ = ["RopeScaling", "Transformer", "TransformerModelArgs"]


@dataclass
class TransformerModelArgs(DecoderArgs):
    """Shape and initialization hyper-parameters of a Llama 3 model."""

    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None

    def __post_init__(self) -> None:
        if self.dim % self.n_heads != 0:
            raise ConfigError(f"model.dim: expected a multiple of n_heads, got {self.dim!r}")
        super().__post_init__()

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """Hidden size of the SwiGLU feed-forward (Meta's rounding rule)."""
        return ffn_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)


class Transformer(Decoder):
    """Llama 3 decoder: tokens (bs, seq) -> logits (bs, seq, vocab)."""

    def __init__(self, args: TransformerModelArgs) -> None:
        super().__init__(args)
