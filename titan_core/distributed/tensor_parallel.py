"""Tensor + sequence parallelism, model-agnostic parts: applying a plan (module name → parallel
style), the config checks, async TP, and two torch.compile + TP fixes (embedding output, cache).

Model-specific plans (which module gets which style) live in ``models/<name>/parallelize.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ParallelStyle,
    PrepareModuleInputOutput,
    parallelize_module,
)

from titan_core.config.job import JobConfig
from titan_core.distributed.parallel_dims import ParallelDims
from titan_core.errors import ConfigError
from titan_core.logging import logger


def find_module(root: nn.Module, fqn: str) -> nn.Module | None:
    """The submodule at ``fqn``, or None where a pipeline stage dropped it (set to None/deleted)."""
    module: nn.Module | None = root
    for part in fqn.split("."):
        module = getattr(module, part, None) if module is not None else None
        if module is not None and not isinstance(module, nn.Module):
            return None
    return module


def apply_tp_plan(
    model: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, ParallelStyle]
) -> list[str]:
    """Parallelize each module of ``plan`` (fully-qualified name → style) over ``tp_mesh``.

    Names whose module is absent (a pipeline stage without embeddings or output) are skipped;
    returns the names that were applied, in plan order.
    """
    applied = []
    for fqn, style in plan.items():
        module = find_module(model, fqn)
        if module is None:
            continue
        parallelize_module(module, tp_mesh, style)
        applied.append(fqn)
    return applied


def check_tensor_parallel(cfg: JobConfig, parallel_dims: ParallelDims, device_type: str) -> None:
    """Refuse TP layouts and options this device or config cannot run (one line each, before
    any process group starts)."""
    split = parallel_dims.tp * parallel_dims.cp  # each rank's slice of the sequence under SP
    if parallel_dims.tp_enabled and cfg.training.seq_len % split:
        by = f"tensor_parallel_degree * context_parallel_degree ({split})"
        if parallel_dims.cp == 1:
            by = f"parallelism.tensor_parallel_degree ({split})"
        raise ConfigError(
            f"training.seq_len: {cfg.training.seq_len} must be divisible by {by}: sequence "
            "parallelism splits every sequence evenly across the TP ranks"
        )
    ddp = parallel_dims.dp_replicate > 1 and not parallel_dims.fsdp_enabled
    if parallel_dims.tp_enabled and ddp:
        raise ConfigError(
            "parallelism.data_parallel_replicate_degree: DDP does not compose with tensor "
            "parallel; use data_parallel_shard_degree (FSDP) for the data-parallel ranks"
        )
    if not cfg.parallelism.enable_async_tensor_parallel:
        return
    if device_type != "cuda":
        raise ConfigError(
            "parallelism.enable_async_tensor_parallel: async TP needs CUDA (symmetric memory) "
            f"and torch.compile; device is {device_type}, set it to false"
        )
    if not parallel_dims.tp_enabled:
        raise ConfigError(
            "parallelism.enable_async_tensor_parallel: needs tensor_parallel_degree > 1, got 1"
        )
    if not (cfg.compile.enable and "model" in cfg.compile.components):
        raise ConfigError(
            "parallelism.enable_async_tensor_parallel: needs compile.enable with 'model' in "
            "compile.components (async TP is an inductor pass)"
        )


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Let inductor overlap TP collectives with matmuls (micro-pipelined, symmetric memory)."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    logger.info("Async tensor parallel enabled (micro-pipelined TP in compiled blocks)")


def _clone_output(_module: nn.Module, _args: tuple, output: torch.Tensor) -> torch.Tensor:
    # clone() makes autograd wait on the async collective; .wait() would cut the graph.
    return output.clone()


def wait_for_tp_output(module: nn.Module) -> None:
    """Materialize ``module``'s TP output before a compiled block consumes it.

    A RowwiseParallel embedding returns an ``AsyncCollectiveTensor`` (a pending reduce-scatter).
    Fed straight into a compiled block it gives a zero embedding gradient under FSDP and a crash
    without it (FIELD_NOTES); cloning it in a forward hook fixes both.
    """
    module.register_forward_hook(_clone_output)


def disable_autograd_cache() -> None:
    """Turn off torch.compile's persistent AOTAutograd cache in this process.

    torch 2.13 keys a DTensor in that cache by mesh, placements and global shape only
    (``DTensor._stable_hash_for_caching``), so every TP rank computes the same key. With a warm
    cache one rank then loads a graph another rank compiled, with that rank's constants baked
    in: the compiled loss-parallel cross entropy masks the wrong vocabulary slice and the loss
    is silently wrong (pytorch/pytorch#188390; hashing the device, its fix, cannot tell CPU
    ranks apart). The FX graph cache, keyed by the graph itself, stays on.
    """
    torch._functorch.config.enable_autograd_cache = False
    logger.info("AOTAutograd cache off: its DTensor keys do not tell TP ranks apart")


# ------------------------------------------------------------------ mixture-of-experts styles
class MoEParallel(PrepareModuleInputOutput):
    """A whole MoE layer under TP + SP: its input is gathered along the sequence (every TP rank
    routes every token), its output, a partial sum over the TP ranks (experts hidden-sharded),
    is reduce-scattered back along the sequence. Sets ``moe.tp_group``, over which the MoE sums
    the input gradient of its partial-sum branches (see ``models.common.moe.MoE``)."""

    def __init__(self) -> None:
        super().__init__(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Partial(),),
            desired_output_layouts=(Shard(1),),
            use_local_output=True,
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.tp_group = device_mesh.get_group()
        return super()._apply(module, device_mesh)


class ReplicateParallel(ParallelStyle):
    """A module computed whole on every TP rank (the MoE router): parameters replicated
    DTensors on ``tp`` (so that every block parameter lives on the same mesh), local tensors in
    and out."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(_name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):
                dt = DTensor.from_local(param.data, mesh, (Replicate(),), run_check=False)
                mod.register_parameter(pname, nn.Parameter(dt, param.requires_grad))

        def input_fn(_mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return tuple(
                DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
                else x
                for x in inputs
            )

        def output_fn(_mod: nn.Module, out: torch.Tensor, _mesh: DeviceMesh) -> torch.Tensor:
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(module, device_mesh, partition, input_fn, output_fn)


class ExpertTensorParallel(ParallelStyle):
    """Routed experts (``GroupedExperts``) with their hidden dim split over the TP ranks, like a
    column-wise ``w1``/``w3`` and row-wise ``w2`` SwiGLU: each rank's output is a partial sum.
    The weights stay the expert's business (it computes on their local shards)."""

    shard_dims: ClassVar[dict[str, int]] = {"w1": 1, "w2": 2, "w3": 1}
    """The TP-sharded dim of each parameter (read by ``titan estimate``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for pname, dim in self.shard_dims.items():
            param = module._parameters[pname]
            local = param.data.chunk(device_mesh.size(), dim=dim)[device_mesh.get_local_rank()]
            local = local.contiguous()
            dt = DTensor.from_local(
                local,
                device_mesh,
                (Shard(dim),),
                run_check=False,
                shape=param.shape,
                stride=param.stride(),
            )
            module.register_parameter(pname, nn.Parameter(dt, param.requires_grad))
        return module
