"""Per-rank memory of one training step: the persistent terms, exactly as the trainer allocates
them, plus activations measured on fake tensors, combined into a peak by training phase.

Persistent (per rank, bytes):
  parameters  fp32 master weights, TP-local, FSDP-sharded with dim 0 padded to the shard degree
              (routed experts: ep-local, then sharded over dp_shard * cp / ep)
  gradients   the same shapes in fp32 (FSDP2 keeps sharded grads in the parameter's dtype)
  optimizer   AdamW exp_avg + exp_avg_sq (2 x parameters) + a 4-byte step scalar per tensor
  buffers     RoPE table (``freqs_cis``), on every pipeline rank
Transient, combined by phase (see ``docs/estimation.md``): FSDP all-gather/reduce buffers,
saved activations, logits and cross-entropy, the backward of one block, optimizer temporaries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from titan_core.estimate.activations import Profiles, layer_kind
from titan_core.estimate.layout import Layout, RankLayout, fsdp_shard_numel, rank_param_shapes

_FP32 = 4
_ADAM_STEP_BYTES = 4  # AdamW's per-parameter "step" is a float32 scalar tensor


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on the busiest rank for one training step (all integers are bytes)."""

    pp_rank: int
    params: int
    grads: int
    optimizer: int
    buffers: int
    fsdp_buffers: int
    """All-gathered params (root unit + blocks in flight) and one block's reduce-scatter input."""
    activations: int
    """Tensors all local blocks save for backward, for every microbatch in flight."""
    loss: int
    """Head and loss: what the final norm/output save, log-probabilities, cross-entropy grads."""
    backward_transient: int
    """Peak extra while one block runs backward (recomputation under AC, grads, temporaries)."""
    optimizer_transient: int
    """Temporaries of the optimizer step (foreach AdamW: one fp32 copy of the local params)."""
    all_to_all: int
    """Expert parallelism: one MoE layer's dispatch + combine send/receive buffers for one
    microbatch (balanced routing), counted in the block-backward phase; 0 without ep."""
    peak: int
    """Modelled peak: persistent terms + the largest of the loss, block-backward, step phases."""
    peak_phase: str
    layers: int
    microbatches_in_flight: int

    @property
    def total(self) -> int:
        """Sum of every term: an upper bound that assumes nothing is ever freed."""
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.buffers
            + self.fsdp_buffers
            + self.activations
            + self.loss
            + self.backward_transient
            + self.optimizer_transient
            + self.all_to_all
        )


def fits(estimate: MemoryEstimate, device_bytes: int, *, headroom: float = 0.0) -> bool:
    """Whether the modelled peak, plus a ``headroom`` fraction of it, fits in ``device_bytes``."""
    return estimate.peak * (1.0 + headroom) <= device_bytes


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _persistent(layout: Layout, shapes: dict[str, tuple[int, ...]]) -> tuple[int, int, int, int]:
    """(params, grads, optimizer, optimizer-step temporaries) bytes for these local shapes."""
    numels = [fsdp_shard_numel(s, layout.param_shard_degree(n)) for n, s in shapes.items()]
    params = sum(numels) * _FP32
    # Rank 0's unpadded shard is the padded size; optimizer states are zeros_like(local shard).
    optimizer = 2 * params + _ADAM_STEP_BYTES * len(numels)
    impl = layout.cfg.optimizer.implementation
    if impl == "foreach":
        temp = params  # torch._foreach_sqrt(exp_avg_sqs) materializes one copy of everything
    elif impl == "for-loop":
        temp = max(numels, default=0) * _FP32
    else:  # fused kernels update in place
        temp = 0
    return params, params, optimizer, temp


def _fsdp_buffers(
    layout: Layout, rank: RankLayout, shapes: dict[str, tuple[int, ...]]
) -> tuple[int, int, int]:
    """(root unit, blocks in flight) all-gathered in the param dtype, and one block's
    reduce-scatter input in the reduce dtype; bytes."""
    if not layout.fsdp:
        return 0, 0, 0
    prefix = f"layers.{rank.layers[0]}."
    block_numel = sum(math.prod(s) for n, s in shapes.items() if n.startswith(prefix))
    root_numel = sum(math.prod(s) for n, s in shapes.items() if not n.startswith("layers."))
    # The root unit is never resharded after forward; a block is freed after use, with the next
    # one prefetched (two in flight), unless reshard_after_forward is off (pipeline default).
    blocks_held = min(2, len(rank.layers)) if layout.reshard_after_forward else len(rank.layers)
    param_bytes = _itemsize(layout.param_dtype)
    return (
        root_numel * param_bytes,
        blocks_held * block_numel * param_bytes,
        block_numel * _itemsize(layout.reduce_dtype),
    )


def _block_backward(
    layout: Layout,
    profiles: Profiles,
    rank: RankLayout,
    shapes: dict[str, tuple[int, ...]],
    activations: int,
    accumulating: bool,
) -> int:
    """Peak while the blocks run backward, last to first: one block's extra on top of the
    activations not consumed yet and the gradients already produced."""
    # Unsharded head grads wait for the root's reduce-scatter at the end of backward under FSDP;
    # without FSDP they are ordinary grads, already counted when accumulating.
    held = profiles.head.param_grad_bytes if rank.has_head else 0
    if accumulating and not layout.fsdp:
        held = 0
    peak, remaining = 0, activations
    for i in reversed(rank.layers):
        kind = layer_kind(layout, i)
        peak = max(peak, remaining + held + profiles.blocks[kind].backward_extra_bytes)
        remaining -= profiles.block_saved(kind, layout.dims.tp)
        if not accumulating:
            prefix = f"layers.{i}."
            held += _FP32 * sum(
                fsdp_shard_numel(s, layout.param_shard_degree(n))
                for n, s in shapes.items()
                if n.startswith(prefix)
            )
    return peak


def _is_moe(layout: Layout, index: int) -> bool:
    return layout.moe is not None and bool(layout.model_args.moe_layer(index))


def _rank_estimate(layout: Layout, profiles: Profiles, rank: RankLayout) -> MemoryEstimate:
    tp, t = layout.dims.tp, layout.cfg.training
    shapes = rank_param_shapes(layout, rank)
    params, grads, optimizer, opt_temp = _persistent(layout, shapes)
    buffers = sum(b.numel() * b.element_size() for b in layout.model.buffers())
    root, blocks_gathered, reduce = _fsdp_buffers(layout, rank, shapes)
    # Between forward and backward only what is never resharded stays gathered.
    kept = root + (blocks_gathered if not layout.reshard_after_forward else 0)
    kinds = [layer_kind(layout, i) for i in rank.layers]
    per_microbatch = sum(profiles.block_saved(kind, tp) for kind in kinds)
    if rank.has_embedding:  # the embedding saves its token ids
        per_microbatch += layout.microbatch_size * layout.local_seq * 8
    activations = per_microbatch * rank.in_flight
    head = profiles.head
    loss = profiles.head_saved(tp) + head.backward_extra_bytes if rank.has_head else 0
    # Gradients persist through forward only when earlier microbatches already produced them.
    accumulating = t.gradient_accumulation_steps > 1 or layout.num_microbatches > 1
    grads_held = grads if accumulating else 0
    blocks = _block_backward(layout, profiles, rank, shapes, activations, accumulating)
    a2a = layout.all_to_all_bytes if any(_is_moe(layout, i) for i in rank.layers) else 0
    phases = {
        "block backward": grads_held + root + blocks_gathered + reduce + blocks + a2a,
        "optimizer step": grads + opt_temp,
    }
    if rank.has_head:
        phases["loss backward"] = grads_held + kept + activations + loss
    phase = max(phases, key=lambda k: phases[k])
    return MemoryEstimate(
        pp_rank=rank.pp_rank,
        params=params,
        grads=grads,
        optimizer=optimizer,
        buffers=buffers,
        fsdp_buffers=root + blocks_gathered + reduce,
        activations=activations,
        loss=loss,
        backward_transient=max(profiles.blocks[k].backward_extra_bytes for k in kinds),
        optimizer_transient=opt_temp,
        all_to_all=a2a,
        peak=params + buffers + optimizer + phases[phase],
        peak_phase=phase,
        layers=len(rank.layers),
        microbatches_in_flight=rank.in_flight,
    )


def estimate_memory(layout: Layout, profiles: Profiles) -> MemoryEstimate:
    """The estimate of the pipeline rank with the highest modelled peak."""
    estimates = [_rank_estimate(layout, profiles, rank) for rank in layout.ranks]
    return max(estimates, key=lambda e: e.peak)


def estimate_rank_memory(layout: Layout, profiles: Profiles, pp_rank: int) -> MemoryEstimate:
    """The estimate of pipeline rank ``pp_rank`` (``estimate_memory`` reports the fullest)."""
    return _rank_estimate(layout, profiles, layout.ranks[pp_rank])
