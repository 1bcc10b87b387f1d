"""Qwen3-MoE: the Qwen3 decoder (QK-norm, explicit head_dim, GQA) with mixture-of-experts
feed-forwards (``models.common.moe``) on the layers ``decoder_sparse_step`` and
``mlp_only_layers`` pick, dense SwiGLU on the others."""

from __future__ import annotations

from dataclasses import dataclass, field

from titan_core.errors import ConfigError
from titan_core.models.common.decoder import Decoder
from titan_core.models.common.moe import MoEArgs
from titan_core.models.qwen3.model import Qwen3ModelArgs

__all__ = ["Qwen3MoeModel", "Qwen3MoeModelArgs"]


@dataclass
class Qwen3MoeModelArgs(Qwen3ModelArgs):
    """Shape hyper-parameters of a Qwen3-MoE model (defaults: Qwen3-30B-A3B).

    ``hidden_dim`` is the dense layers' SwiGLU width (HF ``intermediate_size``); the experts'
    own width is ``moe.hidden_dim`` (HF ``moe_intermediate_size``).
    """

    dim: int = 2048
    n_layers: int = 48
    n_heads: int = 32
    n_kv_heads: int | None = 4
    head_dim: int = 128
    hidden_dim: int = 6144
    moe: MoEArgs | None = field(
        default_factory=lambda: MoEArgs(num_experts=128, top_k=8, hidden_dim=768)
    )
    decoder_sparse_step: int = 1
    """Every ``decoder_sparse_step``-th layer (1-based) is MoE (HF ``decoder_sparse_step``)."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers kept dense whatever the step (HF ``mlp_only_layers``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.decoder_sparse_step < 1:
            raise ConfigError(
                f"model.decoder_sparse_step: expected an int >= 1, got {self.decoder_sparse_step}"
            )
        self.mlp_only_layers = tuple(self.mlp_only_layers)

    def moe_layer(self, layer_id: int) -> bool:
        """HF's rule: MoE unless listed in ``mlp_only_layers`` or off the sparse step."""
        return (
            self.moe is not None
            and layer_id not in self.mlp_only_layers
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )


class Qwen3MoeModel(Decoder):
    """Qwen3-MoE decoder: tokens (bs, seq) -> logits (bs, seq, vocab)."""

    def __init__(self, args: Qwen3MoeModelArgs) -> None:
        super().__init__(args)
