"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): keys and values come from one
low-rank latent per token, queries optionally from another, and only ``qk_rope_head_dim``
channels of each head carry RoPE (one rotary key shared by every head).

Native names (what checkpoints and the HF adapters key on), for a layer's ``attention``:
``wq`` (no query LoRA) or ``wq_a`` -> ``q_norm`` -> ``wq_b``; ``wkv_a`` (latent + rotary key),
``kv_norm``, ``wkv_b`` (per-head no-RoPE keys and values); ``wo``.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_core.models.common.attention import ScaledDotProductAttention
from titan_core.models.common.masking import AttentionMask
from titan_core.models.common.rmsnorm import RMSNorm
from titan_core.models.common.rope import apply_rotary_emb

LATENT_NORM_EPS = 1e-6
"""transformers builds MLA's two latent RMSNorms with their default epsilon, whatever the
config's ``rms_norm_eps``: the same here, so that checkpoints compute alike."""


class MultiHeadLatentAttention(nn.Module):
    """Causal MLA: (bs, seq, dim) -> (bs, seq, dim).

    ``q_lora_rank`` 0 projects queries straight from ``dim`` (``wq``; DeepSeek-V2-Lite,
    Moonlight keep the LoRA). ``softmax_scale`` defaults to ``qk_head_dim ** -0.5``; YaRN models
    multiply it by ``rope.yarn_softmax_mscale`` squared.
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        *,
        q_lora_rank: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        softmax_scale: float | None = None,
    ) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        q_out = n_heads * self.qk_head_dim
        self.wq: nn.Linear | None = None
        self.wq_a: nn.Linear | None = None
        self.q_norm: RMSNorm | None = None
        self.wq_b: nn.Linear | None = None
        if q_lora_rank == 0:
            self.wq = nn.Linear(dim, q_out, bias=False)
        else:
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_norm = RMSNorm(q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(q_lora_rank, q_out, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)
        # SDPA scales by qk_head_dim ** -0.5 itself: a different softmax scale (YaRN's
        # correction) is folded into the queries, so the attention op stays the shared one.
        scale = self.qk_head_dim**-0.5 if softmax_scale is None else softmax_scale
        self.q_scale = scale * self.qk_head_dim**0.5
        self.sdpa = ScaledDotProductAttention()

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.wq is not None:
            return self.wq(x)
        return self.wq_b(self.q_norm(self.wq_a(x)))

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: AttentionMask = None
    ) -> torch.Tensor:
        """Map x (bs, seq, dim) to (bs, seq, dim); ``freqs_cis`` is the rope table of
        ``qk_rope_head_dim`` channels (or one row per token); ``mask`` None is causal."""
        bs, seq, _ = x.shape
        nope, rope = self.qk_nope_head_dim, self.qk_rope_head_dim
        # -1 for the head count: under tensor parallelism a rank holds its local heads only.
        q = self._queries(x).view(bs, seq, -1, self.qk_head_dim)  # (bs, seq, heads, qk_hd)
        q_nope, q_pe = torch.split(q, [nope, rope], dim=-1)
        latent, k_pe = torch.split(self.wkv_a(x), [self.kv_lora_rank, rope], dim=-1)
        q_pe, k_pe = apply_rotary_emb(q_pe, k_pe.unsqueeze(2), freqs_cis)  # k_pe: 1 head
        kv = self.wkv_b(self.kv_norm(latent)).view(bs, seq, -1, nope + self.v_head_dim)
        k_nope, v = torch.split(kv, [nope, self.v_head_dim], dim=-1)
        heads = k_nope.shape[2]
        q = torch.cat([q_nope, q_pe], dim=-1)  # (bs, seq, heads, qk_hd)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        k = torch.cat([k_nope, k_pe.expand(bs, seq, heads, rope)], dim=-1)
        out = self.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        out = out.transpose(1, 2).contiguous().view(bs, seq, -1)  # (bs, seq, heads * v_hd)
        return self.wo(out)

    def init_weights(self, init_std: float) -> None:
        """Projections into the heads at std 0.02, ``wo`` (which feeds the residual) at the
        depth-scaled ``init_std``, latent norms to ones."""
        for linear in (self.wq, self.wq_a, self.wq_b, self.wkv_a, self.wkv_b):
            if linear is not None:
                nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for norm in (self.q_norm, self.kv_norm):
            if norm is not None:
                norm.init_weights()
