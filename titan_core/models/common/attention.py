"""Grouped-query causal self-attention on top of ``F.scaled_dot_product_attention`` (and of
flex attention for document masks on CUDA)."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from titan_core.models.common.masking import AttentionMask
from titan_core.models.common.rmsnorm import RMSNorm
from titan_core.models.common.rope import apply_rotary_emb


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Repeat each kv head ``n_rep`` times: (bs, seq, n_kv, hd) -> (bs, seq, n_kv * n_rep, hd)."""
    if n_rep == 1:
        return x
    bs, seq, n_kv_heads, head_dim = x.shape
    # expand is a view; the reshape's copy gives SDPA the dense equal-heads layout that the flash
    # kernel accepts on every backend (enable_gqa is not supported by all of them).
    return (
        x[:, :, :, None, :]
        .expand(bs, seq, n_kv_heads, n_rep, head_dim)
        .reshape(bs, seq, n_kv_heads * n_rep, head_dim)
    )


@cache
def _compiled_flex_attention() -> Callable[..., torch.Tensor]:
    # Uncompiled, flex attention runs an unfused reference: compiled once, on first use.
    return torch.compile(flex_attention)


class ScaledDotProductAttention(nn.Module):
    """Causal SDPA as its own module, so context parallelism and activation checkpointing can
    recognise and wrap the single op call."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask = None
    ) -> torch.Tensor:
        """Attend (bs, heads, seq, head_dim) inputs causally, or within the allowed pairs of
        ``mask`` (see ``masking``); returns the same shape as ``q``."""
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if isinstance(mask, BlockMask):
            return _compiled_flex_attention()(q, k, v, block_mask=mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Attention(nn.Module):
    """Multi-head causal self-attention with grouped-query kv heads and rotary embeddings.

    ``head_dim`` defaults to ``dim // n_heads`` (Llama); families such as Qwen3 set it apart
    from ``dim``. ``qk_norm`` adds an RMSNorm over each head's query and key channels before
    RoPE (Qwen3, OLMo 2), one scale vector shared by all heads.
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        *,
        head_dim: int | None = None,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if (head_dim is None and dim % n_heads != 0) or n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"dim ({dim}) must divide by n_heads ({n_heads}) and n_heads by "
                f"n_kv_heads ({self.n_kv_heads})"
            )
        self.n_rep = n_heads // self.n_kv_heads
        self.head_dim = dim // n_heads if head_dim is None else head_dim
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.q_norm: RMSNorm | None = RMSNorm(self.head_dim, eps=norm_eps) if qk_norm else None
        self.k_norm: RMSNorm | None = RMSNorm(self.head_dim, eps=norm_eps) if qk_norm else None
        self.sdpa = ScaledDotProductAttention()

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: AttentionMask = None
    ) -> torch.Tensor:
        """Map x (bs, seq, dim) to (bs, seq, dim); ``freqs_cis`` has >= seq rows, or one per
        token (see rope); ``mask`` None is causal, else a document mask (see ``masking``)."""
        bs, seq, _ = x.shape
        # -1 for the head count: under tensor parallelism each rank holds only its local heads.
        xq = self.wq(x).view(bs, seq, -1, self.head_dim)  # (bs, seq, n_heads, hd)
        xk = self.wk(x).view(bs, seq, -1, self.head_dim)  # (bs, seq, n_kv_heads, hd)
        xv = self.wv(x).view(bs, seq, -1, self.head_dim)  # (bs, seq, n_kv_heads, hd)
        if self.q_norm is not None and self.k_norm is not None:
            xq, xk = self.q_norm(xq), self.k_norm(xk)  # per head, over its hd channels
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        keys = repeat_kv(xk, self.n_rep)  # (bs, seq, n_heads, hd)
        values = repeat_kv(xv, self.n_rep)  # (bs, seq, n_heads, hd)
        out = self.sdpa(
            xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), mask
        )  # (bs, n_heads, seq, hd)
        out = out.transpose(1, 2).contiguous().view(bs, seq, -1)  # (bs, seq, n_heads * hd)
        return self.wo(out)

    def init_weights(self, init_std: float) -> None:
        """q/k/v at std 0.02; ``init_std`` (depth-scaled) for ``wo``, which feeds the residual;
        QK-norm scales to ones."""
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.init_weights()
