"""What each rank holds for a config and world size: degrees, shapes, dtypes, pipeline stages.

Built on the meta device only. The memory and FLOPs estimators read everything from a ``Layout``
so that both agree on the model, the parallel plan and the batch each rank sees.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch

from titan_core.config.dtypes import TORCH_DTYPES, autocast_dtype
from titan_core.config.job import JobConfig
from titan_core.distributed.parallel_dims import ParallelDims
from titan_core.errors import ConfigError
from titan_core.models import get_flavor, get_model_spec

# torchtitan's Llama TP plan: the dim of each weight that tensor parallelism shards. Embedding and
# output are split over the vocabulary; norms are replicated (SequenceParallel keeps them whole).
_TP_SHARD_DIM = {
    "tok_embeddings.weight": 0,
    "output.weight": 0,
    "attention.wq.weight": 0,
    "attention.wk.weight": 0,
    "attention.wv.weight": 0,
    "attention.wo.weight": 1,
    "feed_forward.w1.weight": 0,
    "feed_forward.w3.weight": 0,
    "feed_forward.w2.weight": 1,
}
_SINGLE_STAGE = ("GPipe", "1F1B")
_LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
_V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
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
    flops_per_token: int
    param_shapes: dict[str, tuple[int, ...]]
    """Every parameter by name; a tied table appears under both of its names."""
    tied: frozenset[str]
    """Names that alias another parameter (counted once per rank that holds both)."""
    ranks: tuple[RankLayout, ...]
    microbatch_size: int
    num_microbatches: int
    model: torch.nn.Module
    """The whole model on the meta device (no storage): the source of every shape."""

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
    def reshard_after_forward(self) -> bool:
        """FSDP's choice for blocks: free gathered params after forward unless PP is on."""
        policy = self.cfg.parallelism.fsdp_reshard_after_forward
        return policy == "always" or (policy == "default" and self.dims.pp == 1)


def tp_local_shape(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """Shape of parameter ``name`` on TP rank 0 (DTensor's chunking: the first ranks get ceil)."""
    dim = next((d for suffix, d in _TP_SHARD_DIM.items() if name.endswith(suffix)), None)
    if tp == 1 or dim is None:
        return shape
    local = list(shape)
    local[dim] = math.ceil(shape[dim] / tp)
    return tuple(local)


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
    from titan_core.data import Tokenizer, default_tokenizer_path

    if cfg.model.vocab_size > 0:
        return cfg.model.vocab_size, "model.vocab_size"
    if cfg.tokenizer.path:
        return Tokenizer(cfg.tokenizer.path).n_words, "tokenizer.path"
    flavor = get_flavor(cfg.model.name, cfg.model.flavor)
    bundled = default_tokenizer_path()
    if cfg.model.flavor.startswith("debug") and bundled.exists():
        return Tokenizer(str(bundled)).n_words, "bundled tokenizer"
    return flavor.vocab_size, "flavor"


def _stage_layers(n_layers: int, num_stages: int, split_points: list[str]) -> list[list[int]]:
    """Global layer ids of each pipeline stage (explicit split points or an even split)."""
    if split_points:
        starts = []
        for point in split_points:
            prefix, _, index = point.partition(".")
            if prefix != "layers" or not index.isdigit():
                raise ConfigError(
                    "parallelism.pipeline_parallel_split_points: expected names like layers.4, "
                    f"got {point!r}"
                )
            starts.append(int(index))
        if starts != sorted(set(starts)) or not 0 < starts[0] <= starts[-1] < n_layers:
            raise ConfigError(
                "parallelism.pipeline_parallel_split_points: expected increasing layers in "
                f"(0, {n_layers}), got {split_points}"
            )
        bounds = [0, *starts, n_layers]
        return [list(range(a, b)) for a, b in itertools.pairwise(bounds)]
    base, extra = divmod(n_layers, num_stages)
    sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
    offsets = [sum(sizes[:s]) for s in range(num_stages)]
    return [list(range(o, o + n)) for o, n in zip(offsets, sizes)]


def _num_stages(cfg: JobConfig, n_layers: int, pp: int) -> int:
    """Pipeline stages in total, checked against the schedule's stages per rank."""
    par = cfg.parallelism
    schedule = par.pipeline_parallel_schedule
    known = (*_SINGLE_STAGE, *_LOOPED, *_V_SHAPED)
    if schedule not in known:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule: expected one of {', '.join(known)}, "
            f"got {schedule!r}"
        )
    if par.pipeline_parallel_split_points:
        stages = len(par.pipeline_parallel_split_points) + 1
    elif par.pipeline_parallel_layers_per_stage > 0:
        stages = math.ceil(n_layers / par.pipeline_parallel_layers_per_stage)
    else:
        stages = pp * (1 if schedule in _SINGLE_STAGE else 2)
    if schedule in _SINGLE_STAGE:
        want, ok = f"{pp} (one per rank)", stages == pp
    elif schedule in _V_SHAPED:
        want, ok = f"{2 * pp} (two per rank)", stages == 2 * pp
    else:
        want, ok = f"a multiple of {pp}", stages % pp == 0
    if not ok or stages > n_layers:
        key = "pipeline_parallel_schedule"
        if par.pipeline_parallel_split_points:
            key = "pipeline_parallel_split_points"
        elif par.pipeline_parallel_layers_per_stage > 0:
            key = "pipeline_parallel_layers_per_stage"
        raise ConfigError(
            f"parallelism.{key}: expected {want} stages of >= 1 of the {n_layers} layers for "
            f"{schedule} on {pp} ranks, got {stages}"
        )
    return stages


def _rank_layouts(cfg: JobConfig, n_layers: int, pp: int, num_mb: int) -> tuple[RankLayout, ...]:
    """Which stages, layers and in-flight microbatches each pipeline rank holds."""
    if pp == 1:
        return (RankLayout(0, tuple(range(n_layers)), True, True, 1),)
    par = cfg.parallelism
    schedule = par.pipeline_parallel_schedule
    stages = _num_stages(cfg, n_layers, pp)
    layers = _stage_layers(n_layers, stages, par.pipeline_parallel_split_points)
    if schedule in _V_SHAPED:
        owner = [s if s < pp else 2 * pp - 1 - s for s in range(stages)]
    else:
        owner = [s % pp for s in range(stages)]
    out = []
    for rank in range(pp):
        local = [s for s in range(stages) if owner[s] == rank]
        if schedule in _ALL_FORWARDS_FIRST:
            in_flight = num_mb
        elif schedule == "1F1B":
            in_flight = min(num_mb, pp - rank)
        else:  # interleaved and zero-bubble schedules: about one round of warm-up per stage
            in_flight = min(num_mb, pp)
        out.append(
            RankLayout(
                pp_rank=rank,
                layers=tuple(i for s in local for i in layers[s]),
                has_embedding=0 in local,
                has_head=stages - 1 in local,
                in_flight=in_flight,
            )
        )
    return tuple(out)


def _check_divisible(cfg: JobConfig, dims: ParallelDims) -> tuple[int, int]:
    """Microbatch size and count; the sequence must split over cp, then over tp (SP)."""
    t, par = cfg.training, cfg.parallelism
    if t.seq_len % dims.cp or (t.seq_len // dims.cp) % dims.tp:
        raise ConfigError(
            f"training.seq_len: expected a multiple of context_parallel_degree * "
            f"tensor_parallel_degree ({dims.cp * dims.tp}), got {t.seq_len}"
        )
    if dims.pp == 1:
        return t.local_batch_size, 1
    if t.local_batch_size % par.pipeline_parallel_microbatch_size:
        raise ConfigError(
            "parallelism.pipeline_parallel_microbatch_size: expected a divisor of "
            f"training.local_batch_size ({t.local_batch_size}), "
            f"got {par.pipeline_parallel_microbatch_size}"
        )
    size = par.pipeline_parallel_microbatch_size
    return size, t.local_batch_size // size


def build_layout(cfg: JobConfig, world_size: int) -> Layout:
    """Validate ``cfg`` for ``world_size`` ranks and describe what each rank holds."""
    from titan_core.build import build_model_args

    if world_size < 1:
        raise ConfigError(f"--ngpu: expected an int >= 1, got {world_size}")
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    vocab, source = resolve_vocab(cfg)
    args = build_model_args(cfg, vocab)
    dims.validate_model(args.n_heads, args.num_kv_heads, args.n_layers)
    mb_size, num_mb = _check_divisible(cfg, dims)
    with torch.device("meta"):
        model = get_model_spec(cfg.model.name).model_cls(args)
    num_params, flops_per_token = args.get_nparams_and_flops(model, cfg.training.seq_len)
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
        num_params=num_params,
        flops_per_token=flops_per_token,
        param_shapes=shapes,
        tied=frozenset(tied),
        ranks=_rank_layouts(cfg, args.n_layers, dims.pp, num_mb),
        microbatch_size=mb_size,
        num_microbatches=num_mb,
        model=model,
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
        # An alias is a second copy only where its twin lives on another stage.
        if held and name in layout.tied and rank.has_embedding:
            held = False
        if held:
            out[name] = tp_local_shape(name, shape, layout.dims.tp)
    return out
