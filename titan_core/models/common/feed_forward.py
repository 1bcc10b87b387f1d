"""SwiGLU feed-forward block and Meta's rule for its hidden size."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None = None) -> int:
    """Hidden size of Meta's Llama SwiGLU: 2/3 of 4*dim, times the multiplier, rounded up."""
    # Two thirds keeps the 3-matrix SwiGLU at the parameter count of a 2-matrix 4*dim MLP.
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1(x)) * w3(x))``, no biases."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map (bs, seq, dim) to (bs, seq, dim)."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float) -> None:
        """``w1`` at std 0.02; ``w2`` and ``w3`` at the depth-scaled ``init_std``, as torchtitan."""
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)
