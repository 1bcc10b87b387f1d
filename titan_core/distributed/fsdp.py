"""FSDP2 (``fully_shard``) per block and at the root (HSDP when a replicate dim exists), and
DDP-style replication when data parallelism does not shard."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from titan_core.config.dtypes import TORCH_DTYPES


def apply_fsdp(
    model: nn.Module,
    blocks: Iterable[nn.Module],
    mesh: DeviceMesh,
    *,
    param_dtype: str,
    reduce_dtype: str,
    reshard_after_forward: bool,
    cpu_offload: bool = False,
    expert_mesh: DeviceMesh | None = None,
    expert_divide_factor: int = 1,
    experts_of: Callable[[nn.Module], Iterable[nn.Module]] | None = None,
) -> None:
    """Shard each block, then the root (which holds embeddings, final norm and output).

    Under expert parallelism (``expert_mesh``: what is left of the FSDP ranks once ``ep`` is
    carved out) each block's routed-expert modules (``experts_of(block)``: the model's
    parallelize knows which they are) are sharded on their own first, over ``expert_mesh``,
    with their gradients divided by ``expert_divide_factor``: the number of data x context
    ranks whose tokens reach an expert (all of them), so that expert gradients are the same
    average over the batch as the dense ones (FSDP would divide by its own mesh size)."""
    mp = MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPES[param_dtype], reduce_dtype=TORCH_DTYPES[reduce_dtype]
    )
    kwargs = {"mesh": mesh, "mp_policy": mp}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in blocks:
        if expert_mesh is not None:
            assert experts_of is not None, "expert_mesh needs experts_of"
            for routed in experts_of(block):
                experts = fully_shard(
                    routed,
                    **{**kwargs, "mesh": expert_mesh},
                    reshard_after_forward=reshard_after_forward,
                )
                experts.set_gradient_divide_factor(expert_divide_factor)
                # A custom factor is a PREMUL_SUM, which gloo lacks; sum then divide instead
                # (only where the reduce-scatter spans ranks: torch 2.13 would divide twice on
                # one rank).
                if expert_mesh.size(-1) > 1:
                    experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    # The root's params are needed again at once by backward: never reshard them after forward.
    fully_shard(model, reshard_after_forward=False, **kwargs)


def apply_ddp(model: nn.Module, mesh: DeviceMesh) -> None:
    """Replicate the whole model on every rank of ``mesh``; gradients are all-reduced."""
    from torch.distributed._composable.replicate import replicate

    # A bucket cap tuned by torchtitan for LLM-sized parameters.
    replicate(model, device_mesh=mesh, bucket_cap_mb=100)
