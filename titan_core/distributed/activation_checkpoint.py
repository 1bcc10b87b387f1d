"""Activation checkpointing of transformer blocks: full, every-N-th block, or op-selective."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titan_core.config.job import ActivationCheckpoint as ACConfig
from titan_core.logging import logger

# Outputs of these ops are kept (not recomputed) under op-selective AC. The CPU flash op must be
# listed too, or CPU runs recompute attention (FIELD_NOTES).
_OP_SAVE_LIST = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.max.default,
}


def _op_sac_context_fn() -> tuple:
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            counts[f"{mode}_mm"] += 1
            # Save every other matmul: half the memory of saving all, most of the speed.
            if counts[f"{mode}_mm"] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        if func in _OP_SAVE_LIST:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _wrap(block: nn.Module, cfg: ACConfig, op_selective: bool) -> nn.Module:
    kwargs = {
        "preserve_rng_state": cfg.preserve_rng_state,
        "determinism_check": cfg.determinism_check,
        "debug": cfg.debug,
    }
    if op_selective:
        kwargs["context_fn"] = _op_sac_context_fn
    return checkpoint_wrapper(block, **kwargs)


def apply_activation_checkpointing(blocks: nn.ModuleDict, cfg: ACConfig) -> None:
    """Wrap the blocks of ``blocks`` in place according to ``cfg.mode``."""
    if cfg.mode == "none":
        return
    op_selective = cfg.mode == "selective" and cfg.selective_ac_option == "op"
    every = 1 if cfg.mode == "full" or op_selective else int(cfg.selective_ac_option)
    wrapped = 0
    for i, (name, block) in enumerate(list(blocks.items())):
        if (i + 1) % every == 0:
            blocks[name] = _wrap(block, cfg, op_selective)
            wrapped += 1
    detail = "op-selective" if op_selective else f"every {every} block(s)"
    logger.info(
        "Activation checkpointing (%s, %s) on %d/%d blocks", cfg.mode, detail, wrapped, len(blocks)
    )


__all__ = ["apply_activation_checkpointing"]
