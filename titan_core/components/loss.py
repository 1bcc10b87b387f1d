"""Training loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy in float32; pred (bs, seq, vocab), labels (bs, seq)."""
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
