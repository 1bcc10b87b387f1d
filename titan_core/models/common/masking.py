"""Document masking: attention that stays inside each document of a packed sample, and RoPE
positions that restart at each document start.

``doc_ids`` (bs, seq) numbers the documents inside each sample (0, 0, 1, 1, 1, 2, ...). A token
attends to the earlier tokens of its own document only (block-causal). The mask is built once
per forward and shared by every layer: on CUDA as a flex-attention ``BlockMask``, whose kernel
skips the blocks that cross documents; elsewhere as a dense boolean mask for SDPA.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

# What attention receives: None (plain causal), a dense boolean mask or a flex BlockMask.
AttentionMask = torch.Tensor | BlockMask | None


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Each token's offset from the start of its document: (bs, seq) int64, 0 at each start.

    A document that began before the sample's first token counts from that first token.
    """
    bs, seq = doc_ids.shape
    index = torch.arange(seq, device=doc_ids.device).expand(bs, seq)  # (bs, seq)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    # Index of the latest document start at or before each token.
    last_start = torch.where(starts, index, 0).cummax(dim=1).values  # (bs, seq)
    return index - last_start


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Dense block-causal mask for SDPA: (bs, 1, seq, seq) bool, True where attention is allowed.

    Head dim 1 broadcasts over however many heads this rank holds (tensor parallelism).
    """
    seq = doc_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=doc_ids.device).tril()
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # (bs, seq, seq)
    return (same_doc & causal)[:, None]


def document_block_mask(doc_ids: torch.Tensor) -> BlockMask:
    """The same mask as ``document_causal_mask`` as a flex-attention ``BlockMask`` (any head)."""

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    bs, seq = doc_ids.shape
    # Compiled on CUDA so the (bs, seq, seq) mask is never materialized.
    return create_block_mask(
        mask_mod, bs, None, seq, seq, device=doc_ids.device, _compile=doc_ids.is_cuda
    )


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor | BlockMask:
    """The block-causal mask for ``doc_ids``' device: a ``BlockMask`` on CUDA (flex attention,
    which skips cross-document blocks), a dense boolean mask elsewhere (flex has no CPU
    backward)."""
    if doc_ids.is_cuda:
        return document_block_mask(doc_ids)
    return document_causal_mask(doc_ids)
