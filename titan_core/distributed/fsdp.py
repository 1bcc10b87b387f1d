"""FSDP2 (``fully_shard``) per block and at the root (HSDP when a replicate dim exists), and
DDP-style replication when data parallelism does not shard."""

from __future__ import annotations

from collections.abc import Iterable

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
) -> None:
    """Shard each block, then the root (which holds embeddings, final norm and output)."""
    mp = MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPES[param_dtype], reduce_dtype=TORCH_DTYPES[reduce_dtype]
    )
    kwargs = {"mesh": mesh, "mp_policy": mp}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    # The root's params are needed again at once by backward: never reshard them after forward.
    fully_shard(model, reshard_after_forward=False, **kwargs)


def apply_ddp(model: nn.Module, mesh: DeviceMesh) -> None:
    """Replicate the whole model on every rank of ``mesh``; gradients are all-reduced."""
    from torch.distributed._composable.replicate import replicate

    # A bucket cap tuned by torchtitan for LLM-sized parameters.
    replicate(model, device_mesh=mesh, bucket_cap_mb=100)
