"""Apply parallelism and training transforms to a decoder (``models.common.decoder``), in
torchtitan's order: TP/SP → expert parallel → activation checkpointing → torch.compile → FSDP
(routed experts first, on their own mesh). The model itself knows nothing of this. Families
whose modules differ pass their own TP plan."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
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
from titan_core.distributed.expert_parallel import apply_expert_parallel
from titan_core.distributed.float8 import check_float8, convert_to_float8, float8_enabled
from titan_core.distributed.float8 import tp_styles as float8_tp_styles
from titan_core.distributed.fsdp import apply_ddp, apply_fsdp
from titan_core.distributed.parallel_dims import ParallelDims
from titan_core.distributed.tensor_parallel import (
    ExpertTensorParallel,
    MoEParallel,
    ReplicateParallel,
    apply_tp_plan,
    check_tensor_parallel,
    disable_autograd_cache,
    enable_async_tp,
    find_module,
    wait_for_tp_output,
)
from titan_core.errors import ConfigError
from titan_core.logging import logger
from titan_core.models.common.moe import moe_layers
from titan_core.models.common.pipeline import plan_decoder_pipeline

TPPlan = Callable[[nn.Module, bool, Float8Config], dict[str, ParallelStyle]]


def check_decoder_support(
    parallel_dims: ParallelDims, cfg: JobConfig, device_type: str, model_args: Any
) -> None:
    """Refuse features this build cannot run, before anything is launched or written."""
    parallel_dims.validate_model(model_args.n_heads, model_args.num_kv_heads, model_args.n_layers)
    if parallel_dims.pp_enabled:
        if parallel_dims.dp_replicate > 1 and not parallel_dims.fsdp_enabled:
            raise ConfigError(
                "parallelism.data_parallel_replicate_degree: pipeline stages do not compose "
                "with DDP-style replication; use data_parallel_shard_degree (FSDP/HSDP) for "
                "data parallel"
            )
        plan_decoder_pipeline(cfg, model_args, parallel_dims.pp)  # every pipeline setting
    if parallel_dims.cp_enabled:
        check_context_parallel(cfg)
    check_tensor_parallel(cfg, parallel_dims, device_type)
    check_float8(cfg.float8, device_type)
    moe = getattr(model_args, "moe", None)
    if moe is not None:
        parallel_dims.validate_experts(moe.num_experts)
        if cfg.compile.enable and "model" in cfg.compile.components:
            raise ConfigError(
                "compile.enable: mixture-of-experts blocks do not compile as one graph yet "
                "(data-dependent routing); drop 'model' from compile.components or disable it"
            )
        if float8_enabled(cfg.float8):
            raise ConfigError(
                "float8: not supported with mixture-of-experts layers yet (the router and "
                "grouped experts would need their own float8 handling); disable it"
            )
    elif parallel_dims.ep_enabled:
        raise ConfigError(
            f"parallelism.expert_parallel_degree: {parallel_dims.ep} needs a mixture-of-experts "
            f"model; {type(model_args).__name__} has no MoE layers (set it to 1)"
        )


def decoder_tp_plan(
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
            # QK-norm (where the family has it: absent modules are skipped): one scale vector
            # for every head, applied to this rank's heads (dim 2 of bs, seq, heads, hd).
            "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "ffn_norm": SequenceParallel(),
            "feed_forward": prepare_input(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w1": colwise(),
            "feed_forward.w2": rowwise(output_layouts=Shard(1)),
            "feed_forward.w3": colwise(),
        }
        if getattr(model.layers[name], "moe", None) is not None:
            block = {k: v for k, v in block.items() if not k.startswith("feed_forward")}
            block.update(moe_tp_plan(colwise, rowwise))
        plan.update({f"layers.{name}.{fqn}": style for fqn, style in block.items()})
    return plan


def moe_tp_plan(colwise: Any, rowwise: Any) -> dict[str, ParallelStyle]:
    """A block's MoE under TP + SP (names relative to the block): the layer gathers its input
    along the sequence and reduce-scatters its partial-sum output; the router is replicated;
    routed experts split their hidden dim; shared experts are a column/row-wise SwiGLU whose
    output stays a partial sum (the layer's output reduce-scatters it with the routed one).
    The input-gradient contract is ``MoE.tp_group``'s."""
    return {
        "moe": MoEParallel(),
        "moe.router.gate": ReplicateParallel(),
        "moe.experts": ExpertTensorParallel(),
        "moe.shared_experts.w1": colwise(),
        "moe.shared_experts.w2": rowwise(output_layouts=Partial()),
        "moe.shared_experts.w3": colwise(),
    }


def apply_tp(
    model: nn.Module, parallel_dims: ParallelDims, cfg: JobConfig, tp_plan: TPPlan
) -> None:
    """Tensor + sequence parallelism over the ``tp`` mesh dim (plus async TP when asked)."""
    tp_mesh = parallel_dims.mesh["tp"]
    loss_parallel = parallel_dims.loss_parallel_enabled(cfg.parallelism)
    applied = apply_tp_plan(model, tp_mesh, tp_plan(model, loss_parallel, cfg.float8))
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


def parallelize_decoder(
    model: nn.Module,
    parallel_dims: ParallelDims,
    cfg: JobConfig,
    tp_plan: TPPlan = decoder_tp_plan,
) -> nn.Module:
    """Apply float8, TP/SP, EP, AC, compile and FSDP/HSDP (or DDP) to ``model`` (on the meta
    device) in place.

    MoE layers: EP shards the routed experts over ``ep`` (after TP split their hidden dim);
    FSDP then shards them over what is left of the FSDP ranks (``expert_fsdp_mesh_dims``) with
    their gradients divided by dp x cp, since every data/context rank's tokens reach every
    expert (FSDP's own divide, its mesh size, would leave them ``ep`` times too large)."""
    if float8_enabled(cfg.float8):
        convert_to_float8(model, cfg.float8)
    if parallel_dims.tp_enabled:
        apply_tp(model, parallel_dims, cfg, tp_plan)
        if cfg.compile.enable:
            disable_autograd_cache()
    if moes := list(moe_layers(model).values()):
        apply_expert_parallel(moes, parallel_dims)
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
        expert_mesh = None
        if parallel_dims.ep_enabled:
            expert_mesh = parallel_dims.mesh[parallel_dims.expert_fsdp_mesh_dims]
        apply_fsdp(
            model,
            model.layers.values(),
            dp_mesh,
            param_dtype=cfg.training.mixed_precision_param,
            reduce_dtype=cfg.training.mixed_precision_reduce,
            reshard_after_forward=reshard,
            expert_mesh=expert_mesh,
            # Every data x context rank's tokens reach each expert: average over all of them.
            expert_divide_factor=parallel_dims.dp_degree * parallel_dims.cp,
            experts_of=lambda block: [moe.experts for moe in moe_layers(block).values()],
        )
        kind = "HSDP" if len(dims) == 2 else "FSDP"
        shape = dict(zip(dims, dp_mesh.shape, strict=True))
        logger.info("Applied %s on mesh %s (reshard_after_forward=%s)", kind, shape, reshard)
    elif parallel_dims.dp_replicate > 1:
        apply_ddp(model, parallel_dims.mesh["dp_replicate"])
        logger.info("Applied DDP over %d replicas", parallel_dims.dp_replicate)
    if parallel_dims.ep_enabled:
        log_expert_layout(model, parallel_dims)
    return model


def log_expert_layout(model: nn.Module, parallel_dims: ParallelDims) -> None:
    """One line per rank: how this part's first MoE layer's ``w1`` is laid out here (read back
    from the parameter itself, so a layout that silently replicated experts shows)."""
    layers = moe_layers(model)
    if not layers:
        return
    name, moe = next(iter(layers.items()))
    w1 = moe.experts.w1
    if isinstance(w1, DTensor):
        dims = w1.device_mesh.mesh_dim_names or ()
        where = f"placements {dict(zip(dims, map(str, w1.placements), strict=True))}"
        local = tuple(w1.to_local().shape)
    else:
        where, local = "not sharded", tuple(w1.shape)
    ep_rank = parallel_dims.ep_mesh.get_local_rank()
    logger.info(
        "Expert parallel %d: ep rank %d, %s.experts.w1 local %s of %s, %s",
        parallel_dims.ep,
        ep_rank,
        name,
        local,
        tuple(w1.shape),
        where,
    )
