"""Multi-token prediction (DeepSeek-V3 §2.2): D sequential modules after the decoder, the k-th
predicting the token k + 1 positions ahead from the (k-1)-th's hidden states and the embedding
of the token k positions ahead, through one more decoder block, sharing the embedding and the
output head with the main model.

Every depth keeps the whole window (``labels_ahead`` carries each position's future tokens and
targets, ignored past the window's end), so MTP splits along the sequence like the decoder:
tensor (sequence) parallel and context parallel run it; pipeline parallel does not (the
embedding lives on the first stage, MTP after the last).

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
from torch.distributed.tensor import DTensor

from titan_core.models.common.rmsnorm import RMSNorm


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


IGNORE = -100  # a target past the window: cross entropy's ignore_index


def labels_ahead(labels: torch.Tensor, depth: int) -> torch.Tensor:
    """(bs, seq) training targets -> (bs, seq, depth + 1): column j holds the target j positions
    further on (column 0 the targets themselves), ``IGNORE`` past the window's end.

    Depth k's MTP module reads the token k ahead of each position (column k - 1: the targets
    are the tokens shifted by one) and predicts the one after it (column k). Built from the whole
    window before anything splits the sequence (context parallel shards it with the tokens), so
    a position keeps its own future wherever it lands.
    """
    bs, seq = labels.shape
    out = labels.new_full((bs, seq, depth + 1), IGNORE)
    for j in range(depth + 1):
        if j < seq:
            out[:, : seq - j, j] = labels[:, j:]
    return out


def mtp_losses(
    h: torch.Tensor,
    ahead: torch.Tensor,
    blocks: Sequence[nn.Module],
    embed: nn.Module,
    output: nn.Module,
    freqs_cis: torch.Tensor,
    *,
    mask: object = None,
    context_parallel: int = 1,
) -> list[torch.Tensor]:
    """Each depth's cross entropy (fp32), depth k = 1..len(blocks), averaged over the positions
    whose target lies inside the window.

    ``h`` (bs, seq, dim) is the decoder's last hidden state before its final norm, ``ahead``
    ``labels_ahead``'s (bs, seq, >= len(blocks) + 1) and ``freqs_cis`` / ``mask`` the decoder's.
    Every depth keeps all ``seq`` positions (the window is not cut, so it splits along the
    sequence as the decoder's does under TP's sequence parallel and CP): at the last k positions
    the token k ahead lies past the window; they read token 0 and their target is ignored.
    Attention is causal, so they change no other position's output, and the loss equals the mean
    over the ``seq - k`` positions DeepSeek-V3 predicts from. Under context parallel each rank
    holds ``seq`` of the ``seq x context_parallel`` positions; its loss is scaled so that the
    mean over the CP ranks (the gradients' average) is the whole window's mean.
    """
    bs, seq = ahead.shape[:2]
    window = seq * context_parallel
    losses = []
    for k, block in enumerate(blocks, start=1):
        if window - k < 1:
            break
        emb = embed(ahead[..., k - 1].clamp(min=0))  # (bs, seq, dim): the token k ahead
        h, normed = block(h, emb, freqs_cis, mask=mask)  # (bs, seq, dim) each
        logits = output(normed)  # (bs, seq, vocab)
        per_token = F.cross_entropy(
            logits.flatten(0, 1).float(),
            ahead[..., k].flatten(),
            ignore_index=IGNORE,
            reduction="none",
        )
        if isinstance(per_token, DTensor):  # loss parallel: replicated once reduced over vocab
            per_token = per_token.full_tensor()
        losses.append(per_token.sum() / (bs * seq) * window / (window - k))
    return losses
