"""What each rank holds for a config and world size: degrees, shapes, dtypes, pipeline stages.

Routed experts (``layers.N.moe.experts.w*``) are split over ``ep`` on dim 0, then FSDP-sharded
over what is left of dp_shard x cp (``dp_shard_mod_ep``); every other parameter is sharded over
dp_shard x cp as for dense models.

Built on the meta device only. The memory and FLOPs estimators read everything from a ``Layout``
so that both agree on the model, the parallel plan and the batch each rank sees.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from titan_core.config.dtypes import TORCH_DTYPES, autocast_dtype
from titan_core.config.job import JobConfig
from titan_core.distributed import pipeline_parallel as pp_lib
from titan_core.distributed.parallel_dims import ParallelDims
from titan_core.errors import ConfigError
from titan_core.models import CHECKPOINT_FLAVOR, ModelSpec, get_model_spec

# Schedules that run every microbatch's forward before any backward.
_ALL_FORWARDS_FIRST = ("GPipe", "LoopedBFS")


@dataclass(frozen=True)
class RankLayout:
    """The part of the model one pipeline rank holds (every rank when pp is 1)."""

    pp_rank: int
    layers: tuple[int, ...]
    has_embedding: bool
    has_head: bool
    in_flight: int
    """Microbatches whose activations a local stage holds at once (schedule warm-up depth)."""


@dataclass(frozen=True)
class Layout:
    """Model shapes, parallel degrees, dtypes and pipeline split for one job on ``world_size``."""

    cfg: JobConfig
    dims: ParallelDims
    model_args: Any
    vocab_source: str
    num_params: int
    """The model's parameters, multi-token prediction modules left out (as published counts
    leave them: DeepSeek-V3's 671B); memory terms count every parameter."""
    num_activated_params: int
    """Parameters one token goes through (MoE: only its top-k routed experts), MTP modules
    left out. Equal to ``num_params`` for dense models."""
    flops_per_token: int
    param_shapes: dict[str, tuple[int, ...]]
    """Every parameter by name; a tied table appears under both of its names."""
    tied: frozenset[str]
    """Names that alias another parameter (counted once per rank that holds both)."""
    tp_shard_dims: Mapping[str, int]
    """Dim that tensor parallelism shards, by parameter name (absent: replicated over tp), read
    from the family's TP plan (``ModelSpec.tp_plan``); empty when tp is 1."""
    ranks: tuple[RankLayout, ...]
    microbatch_size: int
    num_microbatches: int
    model: torch.nn.Module
    """The whole model on the meta device (no storage): the source of every shape."""
    num_mtp_params: int = 0
    """Parameters of the multi-token prediction modules (trained, held and counted in the
    FLOPs like the others; 0 without MTP)."""
    num_mtp_activated_params: int = 0
    """Of those, the ones one token goes through."""

    @property
    def fsdp(self) -> bool:
        """Whether parameters are sharded (dp_shard * cp > 1), as the trainer decides."""
        return self.dims.fsdp_enabled

    @property
    def shard_degree(self) -> int:
        """Ranks one FSDP parameter is split over (dp_shard * cp)."""
        return self.dims.dp_shard * self.dims.cp

    @property
    def param_dtype(self) -> torch.dtype:
        """Dtype of parameters in forward/backward: the FSDP mixed-precision dtype, else fp32."""
        return TORCH_DTYPES[self.cfg.training.mixed_precision_param] if self.fsdp else torch.float32

    @property
    def reduce_dtype(self) -> torch.dtype:
        """Dtype of FSDP gradient reduce-scatter."""
        return TORCH_DTYPES[self.cfg.training.mixed_precision_reduce]

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """Autocast dtype when FSDP is off and autocast is on (the trainer's ``_autocast``)."""
        return autocast_dtype(self.cfg.training, self.fsdp)

    @property
    def local_seq(self) -> int:
        """Tokens of one sequence on this rank (context parallel splits the sequence)."""
        return self.cfg.training.seq_len // self.dims.cp

    @property
    def local_vocab(self) -> int:
        """Logit columns per rank: vocab-sharded under TP with loss parallel, else all."""
        vocab = self.model_args.vocab_size
        tp = self.dims.tp
        if tp > 1 and not self.cfg.parallelism.disable_loss_parallel:
            return math.ceil(vocab / tp)
        return vocab

    @property
    def moe(self) -> Any:
        """The model's ``MoEArgs``, or None for a dense model."""
        return getattr(self.model_args, "moe", None)

    @property
    def num_moe_layers(self) -> int:
        """Layers whose feed-forward is a mixture of experts."""
        if self.moe is None:
            return 0
        return sum(self.model_args.moe_layer(i) for i in range(self.model_args.n_layers))

    @property
    def expert_shard_degree(self) -> int:
        """Ranks FSDP splits each rank's routed experts over: dp_shard * cp / ep under expert
        parallelism (``dp_shard_mod_ep``), else the dense degree."""
        return self.dims.dp_shard_mod_ep if self.dims.ep_enabled else self.shard_degree

    def param_shard_degree(self, name: str) -> int:
        """Ranks FSDP splits parameter ``name`` over (1 without FSDP)."""
        if not self.fsdp:
            return 1
        return self.expert_shard_degree if is_routed_expert(name) else self.shard_degree

    @property
    def routed_rows(self) -> int:
        """Rows one MoE layer routes per microbatch on a rank: tokens x top_k (all the TP
        ranks route the gathered sequence)."""
        if self.moe is None:
            return 0
        return self.microbatch_size * self.local_seq * self.moe.top_k

    @property
    def all_to_all_bytes(self) -> int:
        """Buffers of one MoE layer's token exchange per microbatch under expert parallelism:
        dispatch and combine, each a send and a receive buffer of ``routed_rows`` x dim
        activations (balanced routing assumed); 0 without ep."""
        if self.moe is None or not self.dims.ep_enabled:
            return 0
        dtype = self.autocast_dtype or self.param_dtype
        itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
        return 4 * self.routed_rows * self.model_args.dim * itemsize

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP's choice for blocks: free gathered params after forward unless PP is on."""
        policy = self.cfg.parallelism.fsdp_reshard_after_forward
        return policy == "always" or (policy == "default" and self.dims.pp == 1)


def tp_local_shape(shape: tuple[int, ...], dim: int | None, tp: int) -> tuple[int, ...]:
    """Shape on TP rank 0 of a parameter sharded along ``dim`` (None: replicated); DTensor's
    chunking gives the first ranks the ceiling."""
    if tp == 1 or dim is None:
        return shape
    local = list(shape)
    local[dim] = math.ceil(shape[dim] / tp)
    return tuple(local)


def _style_shard_dims(module: nn.Module, style: ParallelStyle) -> dict[str, int]:
    """Dims that ``style`` shards of ``module``'s own parameters: column-wise splits a Linear's
    output features (weight dim 0, bias) and an Embedding's columns (dim 1); row-wise splits a
    Linear's input features (dim 1) and an Embedding's rows (dim 0). Other styles (sequence
    parallel, input preparation) keep parameters whole."""
    embedding = isinstance(module, nn.Embedding)
    if isinstance(getattr(style, "shard_dims", None), dict):  # e.g. the routed experts' style
        return dict(style.shard_dims)
    if isinstance(style, ColwiseParallel):
        return {"weight": 1} if embedding else {"weight": 0, "bias": 0}
    if isinstance(style, RowwiseParallel):
        return {"weight": 0 if embedding else 1}
    return {}


def tp_shard_dims(
    spec: ModelSpec, model: nn.Module, cfg: JobConfig, dims: ParallelDims
) -> dict[str, int]:
    """The TP-sharded dim of every parameter of ``model`` (meta) under the family's TP plan,
    by parameter name; parameters absent are replicated over the ``tp`` ranks."""
    if dims.tp == 1:
        return {}
    plan = spec.tp_plan(model, dims.loss_parallel_enabled(cfg.parallelism), cfg.float8)
    out = {}
    for fqn, style in plan.items():
        try:
            module = model.get_submodule(fqn)
        except AttributeError:  # the plan names modules a family may not have (QK-norm)
            continue
        for pname, dim in _style_shard_dims(module, style).items():
            if module._parameters.get(pname) is not None:
                out[f"{fqn}.{pname}"] = dim
    return out


def is_routed_expert(name: str) -> bool:
    """Whether parameter ``name`` is a routed-expert weight (``layers.3.moe.experts.w1``),
    the ones expert parallelism shards on dim 0."""
    return ".moe.experts." in name


def ep_local_shape(shape: tuple[int, ...], ep: int) -> tuple[int, ...]:
    """Shape of a routed-expert weight on one ep rank: its experts (dim 0) split evenly."""
    return (shape[0] // ep, *shape[1:]) if ep > 1 else shape


def fsdp_shard_numel(shape: tuple[int, ...], shard: int) -> int:
    """Elements FSDP2 allocates per rank: dim 0 padded to a multiple of ``shard``, then split."""
    if shard == 1:
        return math.prod(shape)
    return math.ceil(shape[0] / shard) * math.prod(shape[1:])


def resolve_vocab(cfg: JobConfig) -> tuple[int, str]:
    """The vocabulary a run of ``cfg`` would use, without loading weights; and where it came from.

    ``model.vocab_size`` wins, then ``tokenizer.path``. Debug flavors train with the bundled
    tokenizer, so they use its size; published flavors use their own vocabulary (a real run of
    that size passes the matching tokenizer).
    """
    from titan_core.build import flavor_args
    from titan_core.data import Tokenizer, default_tokenizer_path

    if cfg.model.vocab_size > 0:
        return cfg.model.vocab_size, "model.vocab_size"
    if cfg.tokenizer.path:
        return Tokenizer(cfg.tokenizer.path).n_words, "tokenizer.path"
    flavor = flavor_args(cfg)  # a family's flavor, or the model a checkpoint describes
    if cfg.model.flavor == CHECKPOINT_FLAVOR:
        return flavor.vocab_size, "checkpoint"
    bundled = default_tokenizer_path()
    if cfg.model.flavor.startswith("debug") and bundled.exists():
        return Tokenizer(str(bundled)).n_words, "bundled tokenizer"
    return flavor.vocab_size, "flavor"


def _in_flight(schedule: str, pp: int, pp_rank: int, num_mb: int) -> int:
    """Microbatches whose activations a pipeline rank holds at once: the schedule's warm-up."""
    if schedule in _ALL_FORWARDS_FIRST:
        return num_mb
    if schedule == "1F1B":
        return min(num_mb, pp - pp_rank)
    return min(num_mb, pp)  # interleaved and zero-bubble schedules: about one round per stage


def _rank_layouts(
    spec: ModelSpec, cfg: JobConfig, model_args: Any, pp: int
) -> tuple[tuple[RankLayout, ...], int]:
    """What each pipeline rank holds under the family's own stage split
    (``ModelSpec.plan_pipeline``, as training uses it), and the microbatch count."""
    if pp == 1:  # every layer, multi-token prediction blocks (after the last) included
        layers = tuple(range(model_args.n_layers + getattr(model_args, "mtp_layers", 0)))
        return (RankLayout(0, layers, True, True, 1),), 1
    plan = spec.plan_pipeline(cfg, model_args, pp)
    out = []
    for rank in range(pp):
        stages = pp_lib.stage_ids_this_rank(rank, pp, plan.num_stages, plan.schedule)
        names = [n for s in stages for n in plan.module_names(s)]
        out.append(
            RankLayout(
                pp_rank=rank,
                layers=tuple(int(n.partition(".")[2]) for n in names if n.startswith("layers.")),
                has_embedding="tok_embeddings" in names,
                has_head="output" in names,
                in_flight=_in_flight(plan.schedule, pp, rank, plan.num_microbatches),
            )
        )
    return tuple(out), plan.num_microbatches


def _check_seq_len(cfg: JobConfig, dims: ParallelDims) -> None:
    """The sequence must split over cp, then over tp (sequence parallel)."""
    seq_len = cfg.training.seq_len
    if seq_len % dims.cp or (seq_len // dims.cp) % dims.tp:
        raise ConfigError(
            f"training.seq_len: expected a multiple of context_parallel_degree * "
            f"tensor_parallel_degree ({dims.cp * dims.tp}), got {seq_len}"
        )


def build_layout(cfg: JobConfig, world_size: int) -> Layout:
    """Validate ``cfg`` for ``world_size`` ranks and describe what each rank holds."""
    from titan_core.build import build_model_args

    if world_size < 1:
        raise ConfigError(f"--ngpu: expected an int >= 1, got {world_size}")
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    vocab, source = resolve_vocab(cfg)
    args = build_model_args(cfg, vocab)
    dims.validate_model(args.n_heads, args.num_kv_heads, args.n_layers)
    moe = getattr(args, "moe", None)
    if moe is not None:
        dims.validate_experts(moe.num_experts)
    elif dims.ep_enabled:
        raise ConfigError(
            f"parallelism.expert_parallel_degree: {dims.ep} needs a mixture-of-experts model; "
            f"{cfg.model.name} {cfg.model.flavor} has none (set it to 1)"
        )
    _check_seq_len(cfg, dims)
    spec = get_model_spec(cfg.model.name)
    ranks, num_mb = _rank_layouts(spec, cfg, args, dims.pp)
    with torch.device("meta"):
        model = spec.model_cls(args)
    num_params, flops_per_token = spec.nparams_and_flops(args, model, cfg.training.seq_len)
    counts = getattr(args, "param_counts", None)
    activated = num_params - (counts()[0] - counts()[1]) if counts is not None else num_params
    mtp_counts = getattr(args, "mtp_param_counts", None)
    mtp, mtp_activated = mtp_counts() if mtp_counts is not None else (0, 0)
    shapes: dict[str, tuple[int, ...]] = {}
    first_name: dict[int, str] = {}
    tied = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        shapes[name] = tuple(p.shape)
        if first_name.setdefault(id(p), name) != name:
            tied.add(name)
    return Layout(
        cfg=cfg,
        dims=dims,
        model_args=args,
        vocab_source=source,
        num_params=num_params - mtp,
        num_activated_params=activated - mtp_activated,
        flops_per_token=flops_per_token,
        param_shapes=shapes,
        tied=frozenset(tied),
        tp_shard_dims=tp_shard_dims(spec, model, cfg, dims),
        ranks=ranks,
        microbatch_size=cfg.training.local_batch_size // num_mb,
        num_microbatches=num_mb,
        model=model,
        num_mtp_params=mtp,
        num_mtp_activated_params=mtp_activated,
    )


def rank_param_shapes(layout: Layout, rank: RankLayout) -> dict[str, tuple[int, ...]]:
    """TP-local shapes of the parameters one pipeline rank holds (aliases counted once)."""
    layers = {str(i) for i in rank.layers}
    out = {}
    for name, shape in layout.param_shapes.items():
        head, _, rest = name.partition(".")
        if head == "layers":
            held = rest.partition(".")[0] in layers
        elif head == "tok_embeddings":
            held = rank.has_embedding
        else:  # final norm and output projection
            held = rank.has_head
        # An alias is no second copy: the stage split refuses tied tables across stages.
        if held and name not in layout.tied:
            local = tp_local_shape(shape, layout.tp_shard_dims.get(name), layout.dims.tp)
            out[name] = ep_local_shape(local, layout.dims.ep) if is_routed_expert(name) else local
    return out
