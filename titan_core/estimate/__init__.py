"""Per-rank memory and FLOPs of a training job for a target world size, without real weights.

    est = estimate(parse_args(["--module", "llama3", "--config", "llama3_8b"]), world_size=8)
    est.memory.peak, est.memory.params, est.flops.total_flops, fits(est.memory, 80 * 2**30)

See ``docs/estimation.md`` for the model of each term and its measured accuracy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from titan_core.config.job import JobConfig
from titan_core.estimate.activations import Profiles, profile_layout
from titan_core.estimate.flops import FlopsEstimate, estimate_flops
from titan_core.estimate.layout import Layout, build_layout
from titan_core.estimate.memory import MemoryEstimate, estimate_memory, fits


@dataclass(frozen=True)
class Estimate:
    """Memory and FLOPs of one job on ``world_size`` ranks, with the layout they assume."""

    layout: Layout
    profiles: Profiles
    """The measured block (per checkpointing kind) and head, one microbatch on one rank."""
    memory: MemoryEstimate
    flops: FlopsEstimate

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values: model, degrees, batch, every memory term, FLOPs."""
        layout, cfg = self.layout, self.layout.cfg
        dims = layout.dims
        return {
            "model": {
                "name": cfg.model.name,
                "flavor": cfg.model.flavor,
                "num_params": layout.num_params,
                "num_activated_params": layout.num_activated_params,
                "num_mtp_params": layout.num_mtp_params,
                "num_mtp_activated_params": layout.num_mtp_activated_params,
                "n_layers": layout.model_args.n_layers,
                "vocab_size": layout.model_args.vocab_size,
                "vocab_source": layout.vocab_source,
            },
            "world_size": dims.world_size,
            "degrees": {
                name: getattr(dims, name)
                for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
            },
            "moe": self._moe(),
            "batch": {
                "local_batch_size": cfg.training.local_batch_size,
                "seq_len": cfg.training.seq_len,
                "gradient_accumulation_steps": cfg.training.gradient_accumulation_steps,
                "microbatch_size": layout.microbatch_size,
                "num_microbatches": layout.num_microbatches,
            },
            "dtypes": {
                "param": str(layout.param_dtype).removeprefix("torch."),
                "reduce": str(layout.reduce_dtype).removeprefix("torch."),
                "autocast": str(layout.autocast_dtype or "none").removeprefix("torch."),
            },
            "activation_checkpoint": {
                "mode": cfg.activation_checkpoint.mode,
                "selective_ac_option": cfg.activation_checkpoint.selective_ac_option,
            },
            "memory": {**dataclasses.asdict(self.memory), "total": self.memory.total},
            "per_layer_activation_bytes": {
                kind: self.profiles.block_saved(kind, dims.tp) for kind in self.profiles.blocks
            },
            "flops": {**dataclasses.asdict(self.flops), "total_flops": self.flops.total_flops},
        }

    def _moe(self) -> dict[str, Any] | None:
        """Experts, routing and expert-parallel figures (None for a dense model)."""
        layout = self.layout
        moe = layout.moe
        if moe is None:
            return None
        ep = layout.dims.ep
        return {
            "num_experts": moe.num_experts,
            "top_k": moe.top_k,
            "moe_layers": layout.num_moe_layers,
            "experts_per_rank": moe.num_experts // ep,
            "expert_fsdp_degree": layout.expert_shard_degree if layout.fsdp else 1,
            "routed_rows_per_layer": layout.routed_rows,
            "all_to_all_bytes_per_layer": layout.all_to_all_bytes,
            "routing": "balanced (tokens x top_k / experts rows per expert)",
        }


def estimate(cfg: JobConfig, world_size: int) -> Estimate:
    """Estimate ``cfg`` on ``world_size`` ranks; ``ConfigError`` if the degrees do not fit."""
    layout = build_layout(cfg, world_size)
    profiles = profile_layout(layout)
    return Estimate(
        layout=layout,
        profiles=profiles,
        memory=estimate_memory(layout, profiles),
        flops=estimate_flops(layout, profiles),
    )


__all__ = [
    "Estimate",
    "FlopsEstimate",
    "MemoryEstimate",
    "estimate",
    "fits",
]
