"""RMSNorm: ``torch.nn.RMSNorm`` (fused kernel where available) with the common init hook."""

from __future__ import annotations

from torch import nn


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` over the last dim with a learnable scale, plus ``init_weights``."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__(dim, eps=eps, elementwise_affine=True)

    def init_weights(self, init_std: float | None = None) -> None:
        """Reset the scale to ones; ``init_std`` is accepted for a uniform interface."""
        self.reset_parameters()
