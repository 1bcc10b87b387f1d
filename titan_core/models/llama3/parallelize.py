"""Apply parallelism and training transforms to a Llama 3 model, in torchtitan's order:
TP/SP → activation checkpointing → torch.compile → FSDP. The model itself knows nothing of this."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from titan_core.config.job import Float8 as Float8Config
from titan_core.config.job import JobConfig
from titan_core.distributed.activation_checkpoint import apply_activation_checkpointing
from titan_core.distributed.compile import apply_compile
from titan_core.distributed.context_parallel import check_context_parallel
from titan_core.distributed.float8 import check_float8, convert_to_float8, float8_enabled
from titan_core.distributed.float8 import tp_styles as float8_tp_styles
from titan_core.distributed.fsdp import apply_ddp, apply_fsdp
from titan_core.distributed.parallel_dims import ParallelDims
from titan_core.distributed.tensor_parallel import (
    apply_tp_plan,
    check_tensor_parallel,
    disable_autograd_cache,
    enable_async_tp,
    find_module,
    wait_for_tp_output,
)
from titan_core.logging import logger
from titan_core.models.llama3.pipeline import check_pipeline


def check_supported(parallel_dims: ParallelDims, cfg: JobConfig, device_type: str) -> None:
    """Refuse features this build cannot run, before anything is launched or written."""
    if parallel_dims.pp_enabled:
        check_pipeline(cfg, parallel_dims)  # every pipeline setting, before any group
    if parallel_dims.cp_enabled:
        check_context_parallel(cfg)
    check_tensor_parallel(cfg, parallel_dims, device_type)
    check_float8(cfg.float8, device_type)


def llama_tp_plan(
    model: nn.Module, loss_parallel: bool, float8_cfg: Float8Config
) -> dict[str, ParallelStyle]:
    """Megatron-style TP + sequence parallel plan for the modules ``model`` has.

    Between blocks activations stay sharded along the sequence (Shard(1)); attention and the
    feed-forward gather them, split heads / hidden units column-wise and reduce-scatter back.
    With loss parallel the logits stay sharded along the vocabulary for the loss.
    """
    colwise, rowwise, prepare_input = float8_tp_styles(float8_cfg)
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    for name in model.layers:
        block = {
            "attention_norm": SequenceParallel(),
            # freqs_cis (the second argument) is the same on every rank: left as it is.
            "attention": prepare_input(
                input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
            ),
            "attention.wq": colwise(),
            "attention.wk": colwise(),
            "attention.wv": colwise(),
            "attention.wo": rowwise(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": prepare_input(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w1": colwise(),
            "feed_forward.w2": rowwise(output_layouts=Shard(1)),
            "feed_forward.w3": colwise(),
        }
        plan.update({f"layers.{name}.{fqn}": style for fqn, style in block.items()})
    return plan


def apply_tp(model: nn.Module, parallel_dims: ParallelDims, cfg: JobConfig) -> None:
    """Tensor + sequence parallelism over the ``tp`` mesh dim (plus async TP when asked)."""
    tp_mesh = parallel_dims.mesh["tp"]
    loss_parallel = parallel_dims.loss_parallel_enabled(cfg.parallelism)
    applied = apply_tp_plan(model, tp_mesh, llama_tp_plan(model, loss_parallel, cfg.float8))
    tied = getattr(model, "model_args", None) and model.model_args.tie_word_embeddings
    if tied and find_module(model, "output") and find_module(model, "tok_embeddings"):
        # Each style made its own sharded copy of the shared table (Shard(0) suits both uses):
        # tie them again so that FSDP shards one table, not a stale second copy.
        model.output.weight = model.tok_embeddings.weight
    if cfg.parallelism.enable_async_tensor_parallel:
        enable_async_tp(tp_mesh)
    logger.info(
        "Applied tensor + sequence parallel (degree %d, loss parallel %s) to %d modules",
        parallel_dims.tp,
        loss_parallel,
        len(applied),
    )


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, cfg: JobConfig) -> nn.Module:
    """Apply float8, TP/SP, AC, compile and FSDP/HSDP (or DDP) to ``model`` (on the meta
    device) in place."""
    if float8_enabled(cfg.float8):
        convert_to_float8(model, cfg.float8)
    if parallel_dims.tp_enabled:
        apply_tp(model, parallel_dims, cfg)
        if cfg.compile.enable:
            disable_autograd_cache()
    apply_activation_checkpointing(model.layers, cfg.activation_checkpoint)
    if cfg.compile.enable and "model" in cfg.compile.components:
        if parallel_dims.tp_enabled and find_module(model, "tok_embeddings") is not None:
            wait_for_tp_output(model.tok_embeddings)
        apply_compile(model.layers, cfg.compile)
    if parallel_dims.fsdp_enabled:
        dims = parallel_dims.fsdp_mesh_dims
        dp_mesh = parallel_dims.mesh[dims]
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
