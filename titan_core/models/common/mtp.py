"""Multi-token prediction (DeepSeek-V3 §2.2): D sequential modules after the decoder, the k-th
predicting the token k + 1 positions ahead from the (k-1)-th's hidden states and the embedding
of the token k positions ahead, through one more decoder block, sharing the embedding and the
output head with the main model.

A family's MTP module is its decoder block plus ``MTPInput``'s modules (``enorm``, ``hnorm``,
``eh_proj``) and a ``head_norm``: ``block(h_prev, emb, freqs_cis, mask=...)`` returns the new
hidden states and their ``head_norm`` (applied inside the block's forward, where FSDP has the
block's weights gathered). ``mtp_losses`` runs them and returns each depth's cross entropy; the
model adds their weighted mean to the training gradient with ``moe.add_loss_gradient`` (the
engine's loss stays the next-token loss) and keeps the value for the trainer to log.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from titan_core.models.common.masking import document_mask, document_positions
from titan_core.models.common.rmsnorm import RMSNorm
from titan_core.models.common.rope import freqs_at


class MTPInput(nn.Module):
    """``eh_proj([enorm(embedding of token i + k); hnorm(h_i)])``: (bs, seq, dim) twice ->
    (bs, seq, dim)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.enorm = RMSNorm(dim, eps=eps)
        self.hnorm = RMSNorm(dim, eps=eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """Previous depth's hidden states and the shifted tokens' embeddings, combined."""
        return self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))

    def init_weights(self) -> None:
        """Norms to ones, the projection at std 0.02."""
        self.enorm.init_weights()
        self.hnorm.init_weights()
        nn.init.trunc_normal_(self.eh_proj.weight, mean=0.0, std=0.02)


def mtp_losses(
    h: torch.Tensor,
    tokens: torch.Tensor,
    blocks: Sequence[nn.Module],
    embed: nn.Module,
    output: nn.Module,
    freqs_cis: torch.Tensor,
    *,
    doc_ids: torch.Tensor | None = None,
    restart_positions: bool = False,
    labels: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Each depth's mean cross entropy (fp32), depth k = 1..len(blocks).

    ``h`` (bs, seq, dim) is the decoder's last hidden state before its final norm. Depth k sees
    positions ``0 .. seq - k - 1``; its targets are ``labels[:, k:]`` when the training labels
    are given, else the input ``tokens[:, k + 1:]`` (the last position, whose target is past
    the window, left out). ``doc_ids`` masks attention within documents as in the decoder.
    """
    seq = tokens.shape[1]
    losses = []
    for k, block in enumerate(blocks, start=1):
        n = seq - k  # positions this depth predicts from
        if n < 1:
            break
        emb = embed(tokens[:, k:])  # (bs, n, dim): the token k ahead
        freqs, mask = freqs_cis, None
        if doc_ids is not None:
            mask = document_mask(doc_ids[:, :n])
            if restart_positions:
                freqs = freqs_at(freqs_cis, document_positions(doc_ids[:, :n]))
        h, normed = block(h[:, :n], emb, freqs, mask=mask)  # (bs, n, dim) each
        logits = output(normed)  # (bs, n, vocab)
        if labels is not None:
            target = labels[:, k:]
        else:
            target, logits = tokens[:, k + 1 :], logits[:, : n - 1]
        if target.numel() == 0:
            break
        losses.append(F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(0, 1)))
    return losses
