"""Named Qwen3-MoE sizes: the published shapes plus small debug models for tests."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from titan_core.models.common.moe import MoEArgs
from titan_core.models.qwen3_moe.model import Qwen3MoeModelArgs

_PUBLISHED_ROPE_ROWS = 8192  # as for Qwen3 dense: the trainer extends it to longer seq_len
_DEBUG_VOCAB = 2048  # a placeholder: the trainer replaces it with the tokenizer's vocabulary


def _debug(moe: MoEArgs | None = None, **overrides: Any) -> Qwen3MoeModelArgs:
    # 8 experts (EP 2, 4 and 8 divide them), top-2, head_dim apart from dim / n_heads.
    base = Qwen3MoeModelArgs(
        dim=256,
        n_layers=6,
        n_heads=16,
        n_kv_heads=4,
        head_dim=32,
        hidden_dim=768,
        vocab_size=_DEBUG_VOCAB,
        max_seq_len=2048,
        tie_word_embeddings=False,
        moe=moe or MoEArgs(num_experts=8, top_k=2, hidden_dim=128),
    )
    return replace(base, **overrides)


def _published(
    dim: int, n_layers: int, n_heads: int, hidden_dim: int, moe_hidden_dim: int
) -> Qwen3MoeModelArgs:
    """A published Qwen3-MoE shape: 4 kv heads of 128 channels, 128 experts, top-8."""
    return Qwen3MoeModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=4,
        head_dim=128,
        hidden_dim=hidden_dim,
        vocab_size=151936,
        max_seq_len=_PUBLISHED_ROPE_ROWS,
        tie_word_embeddings=False,
        moe=MoEArgs(num_experts=128, top_k=8, hidden_dim=moe_hidden_dim),
    )


qwen3_moe_flavors: dict[str, Qwen3MoeModelArgs] = {
    "debugmodel": _debug(),
    "debugmodel_tiny": _debug(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=192,
        moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=32),
    ),
    # A dense layer between MoE ones (HF decoder_sparse_step 2): both kinds in one model.
    "debugmodel_sparse_step": _debug(decoder_sparse_step=2),
    # DeepSeek-style routing on the same shapes: a shared expert, sigmoid scores, loss-free
    # bias balancing instead of the aux loss. Not a Qwen3-MoE checkpoint (no HF export).
    "debugmodel_shared": _debug(
        moe=MoEArgs(
            num_experts=8,
            top_k=2,
            hidden_dim=128,
            num_shared_experts=1,
            score_func="sigmoid",
            aux_loss_coef=0.0,
            load_balance_bias=True,
        )
    ),
    # Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B config.json.
    "30B-A3B": _published(2048, 48, 32, 6144, 768),
    "235B-A22B": _published(4096, 94, 64, 12288, 1536),
}
