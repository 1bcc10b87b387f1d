"""Apply parallelism and training transforms to a Llama 3 model, in torchtitan's order:
TP/SP → activation checkpointing → torch.compile → FSDP. The model itself knows nothing of this."""

from __future__ import annotations

from torch import nn

from titan_core.config.job import JobConfig
from titan_core.distributed.activation_checkpoint import apply_activation_checkpointing
from titan_core.distributed.compile import apply_compile
from titan_core.distributed.fsdp import apply_ddp, apply_fsdp
from titan_core.distributed.parallel_dims import ParallelDims
from titan_core.errors import ConfigError
from titan_core.logging import logger


def check_supported(parallel_dims: ParallelDims, cfg: JobConfig, device_type: str) -> None:
    """Refuse features this build cannot run, before anything is launched or written."""
    for name, degree in (
        ("tensor_parallel_degree", parallel_dims.tp),
        ("pipeline_parallel_degree", parallel_dims.pp),
        ("context_parallel_degree", parallel_dims.cp),
    ):
        if degree > 1:
            raise ConfigError(
                f"parallelism.{name}: {degree} is not supported yet "
                "(TP/PP/CP arrive with the parallelism milestone); use 1"
            )
    if cfg.comm.mode != "default":
        raise ConfigError(
            f"comm.mode: {cfg.comm.mode!r} is not supported yet (the COMM_MODE "
            "debug modes arrive with the parallelism milestone); use 'default'"
        )
    if cfg.float8.recipe_name or cfg.float8.enable_fsdp_float8_all_gather:
        raise ConfigError(
            f"float8: float8 training needs CUDA (SM89+) and torchao; device is {device_type}"
        )


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, cfg: JobConfig) -> nn.Module:
    """Apply AC, compile and FSDP/HSDP to ``model`` (on the meta device) in place."""
    apply_activation_checkpointing(model.layers, cfg.activation_checkpoint)
    if cfg.compile.enable and "model" in cfg.compile.components:
        apply_compile(model.layers, cfg.compile)
    if parallel_dims.fsdp_enabled:
        mesh = parallel_dims.mesh
        dims = tuple(d for d in ("dp_replicate", "dp_shard") if d in mesh.mesh_dim_names)
        dp_mesh = mesh[dims]
        policy = cfg.parallelism.fsdp_reshard_after_forward
        reshard = policy == "always" or (policy == "default" and parallel_dims.pp == 1)
        apply_fsdp(
            model,
            model.layers.values(),
            dp_mesh,
            param_dtype=cfg.training.mixed_precision_param,
            reduce_dtype=cfg.training.mixed_precision_reduce,
            reshard_after_forward=reshard,
        )
        kind = "HSDP" if len(dims) == 2 else "FSDP"
        shape = dict(zip(dims, dp_mesh.shape, strict=True))
        logger.info("Applied %s on mesh %s (reshard_after_forward=%s)", kind, shape, reshard)
    elif parallel_dims.dp_replicate > 1:
        apply_ddp(model, parallel_dims.mesh["dp_replicate"])
        logger.info("Applied DDP over %d replicas", parallel_dims.dp_replicate)
    return model
