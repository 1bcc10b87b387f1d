"""FLOPs of one optimizer step on one rank: the model FLOPs the trainer reports MFU against, plus
the forward work that activation checkpointing recomputes in backward."""

from __future__ import annotations

from dataclasses import dataclass

from titan_core.estimate.activations import Profiles, layer_kind
from titan_core.estimate.layout import Layout


@dataclass(frozen=True)
class FlopsEstimate:
    """Training FLOPs per step on one rank (pipeline ranks averaged)."""

    flops_per_token: int
    """Model FLOPs per token, forward + backward: 6 x non-embedding params + attention."""
    tokens_per_step: int
    """Tokens one data-parallel rank trains on per step: local_batch_size x seq_len x accum."""
    model_flops: int
    """flops_per_token x tokens_per_step, split over the tp x pp x cp ranks of one replica."""
    recompute_flops: int
    """Forward FLOPs recomputed in backward under activation checkpointing (measured)."""

    @property
    def total_flops(self) -> int:
        """What the hardware executes: model FLOPs plus recomputation."""
        return self.model_flops + self.recompute_flops


def estimate_flops(layout: Layout, profiles: Profiles) -> FlopsEstimate:
    """Model and recompute FLOPs per step for the average rank of ``layout``."""
    t, dims = layout.cfg.training, layout.dims
    tokens = t.local_batch_size * t.seq_len * t.gradient_accumulation_steps
    model_flops = layout.flops_per_token * tokens // (dims.tp * dims.pp * dims.cp)
    plain = profiles.blocks["none"].backward_flops
    # Each measured block ran one microbatch on one TP/CP rank; a step runs every microbatch of
    # every accumulation step through all layers, spread over the pipeline ranks.
    per_microbatch = sum(
        profiles.blocks[layer_kind(layout, i)].backward_flops - plain
        for i in range(layout.model_args.n_layers)
    )
    runs = layout.num_microbatches * t.gradient_accumulation_steps
    return FlopsEstimate(
        flops_per_token=layout.flops_per_token,
        tokens_per_step=tokens,
        model_flops=model_flops,
        recompute_flops=per_microbatch * runs // dims.pp,
    )
