"""Named DeepSeek-V3 sizes: the published shapes (DeepSeek-V3, Moonlight, Kimi K2, all
``DeepseekV3ForCausalLM`` checkpoints) plus small debug models for tests."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from titan_core.models.common.moe import MoEArgs
from titan_core.models.common.rope import YarnScaling
from titan_core.models.deepseek_v3.model import DeepseekV3ModelArgs

_DEBUG_VOCAB = 2048  # a placeholder: the trainer replaces it with the tokenizer's vocabulary


def _debug_moe(**overrides: Any) -> MoEArgs:
    # 8 experts in 4 groups, 2 groups and 2 experts per token: group-limited routing excludes
    # half the experts of every token, as DeepSeek-V3's 4 of 8 groups do.
    base = MoEArgs(
        num_experts=8,
        top_k=2,
        hidden_dim=64,
        score_func="sigmoid",
        route_norm=True,
        route_scale=2.5,
        num_shared_experts=1,
        aux_loss_coef=0.0,
        load_balance_bias=True,
        num_groups=4,
        top_groups=2,
    )
    return replace(base, **overrides)


def _debug(**overrides: Any) -> DeepseekV3ModelArgs:
    # Every DeepSeek-V3 feature at CPU size: query LoRA, YaRN (its softmax correction on),
    # a dense first layer, group-limited routing and one MTP depth.
    base = DeepseekV3ModelArgs(
        dim=256,
        n_layers=6,
        n_heads=8,
        vocab_size=_DEBUG_VOCAB,
        max_seq_len=2048,
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=512),
        hidden_dim=768,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        first_k_dense_replace=1,
        mtp_layers=1,
        moe=_debug_moe(),
    )
    return replace(base, **overrides)


def _published(
    *,
    dim: int,
    n_layers: int,
    n_heads: int,
    hidden_dim: int,
    q_lora_rank: int,
    first_k_dense_replace: int,
    vocab_size: int,
    rope_theta: float,
    rope_scaling: YarnScaling | None,
    max_seq_len: int,
    norm_eps: float,
    mtp_layers: int,
    moe: MoEArgs,
) -> DeepseekV3ModelArgs:
    """A published shape: latent ranks and head sizes are DeepSeek-V3's in all three."""
    return DeepseekV3ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        vocab_size=vocab_size,
        norm_eps=norm_eps,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_seq_len=max_seq_len,
        hidden_dim=hidden_dim,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        first_k_dense_replace=first_k_dense_replace,
        mtp_layers=mtp_layers,
        moe=moe,
    )


def _sigmoid_moe(**fields: Any) -> MoEArgs:
    return MoEArgs(
        score_func="sigmoid", route_norm=True, aux_loss_coef=0.0, load_balance_bias=True, **fields
    )


deepseek_v3_flavors: dict[str, DeepseekV3ModelArgs] = {
    "debugmodel": _debug(),
    "debugmodel_tiny": _debug(
        dim=64,
        n_layers=3,
        n_heads=4,
        hidden_dim=160,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=32),
        moe=_debug_moe(hidden_dim=32),
    ),
    # moonshotai/Moonlight-16B-A3B config.json: no query LoRA, 64 experts top-6 in one group,
    # 2 shared experts, no YaRN, no MTP.
    "16B-A3B": _published(
        dim=2048,
        n_layers=27,
        n_heads=16,
        hidden_dim=11264,
        q_lora_rank=0,
        first_k_dense_replace=1,
        vocab_size=163840,
        rope_theta=50000.0,
        rope_scaling=None,
        max_seq_len=8192,
        norm_eps=1e-5,
        mtp_layers=0,
        moe=_sigmoid_moe(
            num_experts=64, top_k=6, hidden_dim=1408, route_scale=2.446, num_shared_experts=2
        ),
    ),
    # deepseek-ai/DeepSeek-V3 config.json (YaRN x40 from a 4096 context, one MTP depth).
    "671B-A37B": _published(
        dim=7168,
        n_layers=61,
        n_heads=128,
        hidden_dim=18432,
        q_lora_rank=1536,
        first_k_dense_replace=3,
        vocab_size=129280,
        rope_theta=10000.0,
        rope_scaling=YarnScaling(factor=40.0, original_max_position_embeddings=4096),
        max_seq_len=4096,
        norm_eps=1e-6,
        mtp_layers=1,
        moe=_sigmoid_moe(
            num_experts=256,
            top_k=8,
            hidden_dim=2048,
            route_scale=2.5,
            num_shared_experts=1,
            num_groups=8,
            top_groups=4,
        ),
    ),
    # moonshotai/Kimi-K2-Instruct config.json: 64 heads, 384 experts top-8 in one group,
    # one dense layer, YaRN x32 with beta_fast 1, no MTP.
    "1T-A32B": _published(
        dim=7168,
        n_layers=61,
        n_heads=64,
        hidden_dim=18432,
        q_lora_rank=1536,
        first_k_dense_replace=1,
        vocab_size=163840,
        rope_theta=50000.0,
        rope_scaling=YarnScaling(
            factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0
        ),
        max_seq_len=4096,
        norm_eps=1e-6,
        mtp_layers=0,
        moe=_sigmoid_moe(
            num_experts=384, top_k=8, hidden_dim=2048, route_scale=2.827, num_shared_experts=1
        ),
    ),
}
