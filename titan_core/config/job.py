"""The one description of a job: nested kw-only dataclasses, one per component.

Every field carries a one-line docstring (shown by ``--help``). CLI flags, TOML files, registry
functions and later Prefect/MLflow views are all projections of ``JobConfig``. User errors raise
``ConfigError`` (a ``ValueError``) naming the key path.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Annotated, Literal

from titan_core.config.metrics import check_metric
from titan_core.errors import ConfigError

DTypeName = Literal["float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class UsedIn:
    """Marks a float setting that the engine computes with in ``dtype`` on the device: the
    schema refuses a value that ``dtype`` does not hold (``titan_core.config.schema``). A Python
    float is a double, so 1e39 is finite here and infinite in float32."""

    dtype: DTypeName


F32 = Annotated[float, UsedIn("float32")]
"""A float used in float32 arithmetic: the optimizers' settings (the weights and their moments
are float32, whatever the compute dtype), the gradient norm's clip, the step guard's statistics
and the MoE aux-loss gradient."""


def _require(cond: bool, key: str, expected: str, got: object) -> None:
    if not cond:
        raise ConfigError(f"{key}: expected {expected}, got {got!r}")


@dataclass(kw_only=True)
class Job:
    """Where a job writes and how it is described."""

    config_file: str = ""
    """TOML file whose values override the registry config (CLI overrides win over it)."""
    dump_folder: str = "./outputs"
    """Output root, a folder or fsspec URL (s3://bucket/prefix). `titan train` writes this job
    here (checkpoint/, metrics, config.toml); a pipeline run writes to
    <dump_folder>/<experiment>/<run_id>/ and keeps what its runs share here (data/, the default
    MLflow store, the tokenizer cache)."""
    description: str = "titan training job"
    """Free-text description recorded with the resolved config."""
    experiment: str = "titan"
    """Experiment this job belongs to: its MLflow experiment and <dump_folder>/<experiment>/."""
    print_config: bool = False
    """Log the resolved config as TOML at start-up."""
    save_config: bool = True
    """Write the resolved config to <dump_folder>/config.toml before training."""

    def __post_init__(self) -> None:
        _require(bool(self.dump_folder), "job.dump_folder", "a non-empty path or URL", "")
        _require(
            bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.experiment)),
            "job.experiment",
            "a name of letters, digits, '.', '_' or '-'",
            self.experiment,
        )


@dataclass(kw_only=True)
class Model:
    """Which model and flavor to build."""

    name: str = "llama3"
    """Model family, a key of the model registry."""
    flavor: str = "debugmodel"
    """Size preset of the family (e.g. debugmodel, 1B, 3B, 8B, 70B, 405B)."""
    vocab_size: int = -1
    """Vocabulary size; -1 takes it from the tokenizer (or the flavor when none is loaded)."""
    n_layers: int = -1
    """Override the flavor's number of layers; -1 keeps the flavor's."""
    max_seq_len: int = -1
    """Override the RoPE table length; -1 uses max(flavor's, training.seq_len)."""
    moe_num_experts: int = -1
    """Mixture-of-experts families: override the flavor's routed experts per layer; -1 keeps."""
    moe_top_k: int = -1
    """Mixture-of-experts families: override the experts each token is routed to; -1 keeps."""
    moe_aux_loss_coef: F32 = -1.0
    """Mixture-of-experts families: weight of the load-balancing loss (0 turns it off); -1
    keeps the flavor's (Qwen3-MoE: 0.001)."""
    moe_load_balance_bias: Literal["flavor", "on", "off"] = "flavor"
    """Mixture-of-experts families: DeepSeek-V3's loss-free balancing bias; flavor keeps the
    flavor's setting."""
    mtp_layers: int = -1
    """Multi-token prediction families (DeepSeek-V3): override the flavor's MTP depth (0 turns
    it off); -1 keeps the flavor's."""
    mtp_loss_weight: F32 = -1.0
    """Multi-token prediction families: weight of the mean MTP loss in the gradient (DeepSeek-V3
    0.3, later 0.1; 0 computes it for the metric only); -1 keeps the flavor's."""

    def __post_init__(self) -> None:
        _require(
            self.vocab_size == -1 or self.vocab_size > 0,
            "model.vocab_size",
            "-1 or > 0",
            self.vocab_size,
        )
        _require(
            self.n_layers == -1 or self.n_layers > 0, "model.n_layers", "-1 or > 0", self.n_layers
        )
        _require(self.mtp_layers >= -1, "model.mtp_layers", "-1 or an int >= 0", self.mtp_layers)
        _require(
            self.mtp_loss_weight == -1 or self.mtp_loss_weight >= 0,
            "model.mtp_loss_weight",
            "-1 or >= 0",
            self.mtp_loss_weight,
        )
        for key in ("moe_num_experts", "moe_top_k"):
            value = getattr(self, key)
            _require(value == -1 or value > 0, f"model.{key}", "-1 or > 0", value)
        _require(
            self.moe_aux_loss_coef == -1 or self.moe_aux_loss_coef >= 0,
            "model.moe_aux_loss_coef",
            "-1 or >= 0",
            self.moe_aux_loss_coef,
        )


@dataclass(kw_only=True)
class Tokenizer:
    """Where the tokenizer comes from."""

    path: str = ""
    """tiktoken ranks file; empty means the project's bundled offline BPE (built at set-up)."""


@dataclass(kw_only=True)
class Training:
    """Batch shape, step count and numerics of the training loop (its data: ``[dataloader]``)."""

    local_batch_size: int = 8
    """Sequences per micro-batch on each data-parallel rank."""
    gradient_accumulation_steps: int = 1
    """Micro-batches accumulated before each optimizer step."""
    seq_len: int = 256
    """Tokens per packed sequence."""
    steps: int = 100
    """Optimizer steps to train for (the total, counting steps done before a resume)."""
    max_norm: F32 = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    mixed_precision_param: DTypeName = "float32"
    """Dtype of parameters in forward/backward under FSDP (bfloat16 on GPUs)."""
    mixed_precision_reduce: DTypeName = "float32"
    """Dtype of gradient reduction under FSDP."""
    autocast_dtype: DTypeName = "float32"
    """Autocast dtype for the forward pass when FSDP is off; float32 disables autocast."""
    gc_freq: int = 50
    """Run Python's garbage collector every N steps (it is disabled in between)."""
    document_positions: bool = False
    """With dataloader.document_masking: RoPE positions restart at 0 at each document start."""

    def __post_init__(self) -> None:
        for key in ("local_batch_size", "gradient_accumulation_steps", "seq_len", "steps"):
            value = getattr(self, key)
            _require(isinstance(value, int) and value > 0, f"training.{key}", "an int > 0", value)
        _require(self.max_norm >= 0, "training.max_norm", ">= 0", self.max_norm)
        _require(self.gc_freq > 0, "training.gc_freq", "an int > 0", self.gc_freq)


@dataclass(kw_only=True)
class Dataloader:
    """What the training loop reads and how: raw text tokenized as it trains, or prepared
    datasets (``titan data prepare``) alone or mixed by weight."""

    dataset: str = "titan_corpus"
    """Registered dataset name, a local .txt/.jsonl file or folder, or a Hugging Face dataset."""
    path: str = ""
    """Optional path overriding where a registered dataset is read from."""
    split: str = "train"
    """Split to read for training (Hugging Face datasets)."""
    text_field: str = "text"
    """Field holding the text in json/jsonl/Hugging Face rows."""
    streaming: bool = True
    """Stream Hugging Face datasets instead of downloading them whole."""
    streams: int = 0
    """Independent data streams the global batch is drawn from; 0 = one per data-parallel rank.
    Fixing it (to a multiple of every DP degree you use) makes runs with different DP degrees,
    a single process included, see the same samples: the seed-checkpoint parity recipe.
    Prepared datasets need no streams: any DP degree sees the same global batches."""
    mix: list[str] = field(default_factory=list)
    """Prepared datasets mixed by weight, as URL=WEIGHT entries (weights are normalised); when
    set, it replaces dataloader.dataset."""
    shuffle: bool = True
    """Prepared datasets: draw samples in a seeded random order per epoch (else in file order)."""
    seed: int = 0
    """Seed of the prepared datasets' sample order (independent of debug.seed)."""
    verify: Literal["size", "checksum"] = "size"
    """Check of prepared shards before training: sizes (cheap), or full checksums too."""
    prefetch: int = 2
    """Batches a background thread reads ahead from prepared datasets; 0 reads in the step."""
    cache_mb: int = 64
    """Read-ahead cache per remote (non-local) shard reader, in MiB."""
    document_masking: bool = False
    """Prepared datasets: attention does not cross document boundaries inside a sample."""
    exclude: list[str] = field(default_factory=list)
    """Prepared datasets: ranges START:END of the global sample order to skip (a batch that
    would start in one starts at END); what a health rollback skips, to reproduce it."""

    def __post_init__(self) -> None:
        parse_ranges(self.exclude)
        _require(self.streams >= 0, "dataloader.streams", "an int >= 0", self.streams)
        _require(bool(self.dataset), "dataloader.dataset", "a dataset name or path", "")
        _require(self.prefetch >= 0, "dataloader.prefetch", ">= 0", self.prefetch)
        _require(self.cache_mb > 0, "dataloader.cache_mb", "> 0", self.cache_mb)
        parse_mix(self.mix)

    @property
    def location(self) -> str:
        """Where the dataset is read from: ``path`` when given, else ``dataset``."""
        return self.path or self.dataset


def parse_ranges(entries: list[str], key: str = "dataloader.exclude") -> list[tuple[int, int]]:
    """``START:END`` entries (0 <= START < END) as sorted (start, end) pairs."""
    out = []
    for entry in entries:
        start, _, end = entry.partition(":")
        ok = start.isdigit() and end.isdigit() and int(start) < int(end)
        _require(ok, key, "START:END sample positions with 0 <= START < END", entry)
        out.append((int(start), int(end)))
    return sorted(out)


def _dataset_place(url: str) -> str:
    """Where a dataset URL points: local paths resolved (``~``, ``.``, links, a trailing slash,
    ``file://``), other URLs without a trailing slash."""
    local = url.removeprefix("file://")
    if "://" in local:
        return local.rstrip("/")
    return os.path.realpath(os.path.expanduser(local))


def parse_mix(entries: list[str]) -> list[tuple[str, float]]:
    """``URL=WEIGHT`` entries → (url, weight normalised to sum 1); ConfigError naming the entry."""
    pairs: list[tuple[str, float]] = []
    for i, entry in enumerate(entries):
        url, sep, weight = str(entry).rpartition("=")
        try:
            value = float(weight) if sep and url else -1.0
        except ValueError:
            value = -1.0
        if not (value > 0 and value != float("inf")):
            raise ConfigError(
                f"dataloader.mix[{i}]: expected URL=WEIGHT with a weight > 0, got {entry!r}"
            )
        pairs.append((url, value))
    # Two spellings of one dataset (data/x, ./data/x/, /abs/data/x, file:///abs/data/x) would
    # mix it with itself: compared by where they point.
    places = [_dataset_place(url) for url, _ in pairs]
    dupes = sorted({url for (url, _), p in zip(pairs, places) if places.count(p) > 1})
    _require(not dupes, "dataloader.mix", "each dataset once", dupes)
    total = sum(w for _, w in pairs)
    return [(url, w / total) for url, w in pairs]


@dataclass(kw_only=True)
class Data:
    """Data preparation: raw sources tokenized once into shards that training memory-maps."""

    sources: list[str] = field(default_factory=list)
    """Raw sources to prepare (files or folders of .txt/.jsonl/.json/.parquet, compressed too; any
    fsspec URL; hf:NAME?name=CONFIG&split=SPLIT&revision=REV for Hugging Face datasets). When
    set, the pipeline prepares them and trains on the result instead of dataloader.dataset."""
    text_field: str = "text"
    """Row field holding the document text (jsonl, json, parquet and Hugging Face rows)."""
    root: str = ""
    """Where prepared datasets live (shared by model lines); empty uses <job.dump_folder>/data."""
    validation_every: int = 100
    """Hold out every Nth document of each source file as the validation split; 0 holds none."""
    workers: int = 0
    """Local processes tokenizing shards; 0 uses every core."""
    dask_address: str = ""
    """Address of a Dask scheduler (tcp://host:port): tokenize shards on that cluster instead."""

    def __post_init__(self) -> None:
        _require(bool(self.text_field), "data.text_field", "a field name", self.text_field)
        _require(self.validation_every >= 0, "data.validation_every", ">= 0", self.validation_every)
        _require(self.workers >= 0, "data.workers", ">= 0", self.workers)
        _require(
            not self.dask_address or "://" in self.dask_address,
            "data.dask_address",
            "a scheduler address like tcp://host:8786",
            self.dask_address,
        )


@dataclass(kw_only=True)
class Optimizer:
    """AdamW settings."""

    name: Literal["AdamW", "Adam"] = "AdamW"
    """Optimizer class from torch.optim."""
    lr: F32 = 8e-4
    """Peak learning rate."""
    beta1: F32 = 0.9
    """First-moment decay."""
    beta2: F32 = 0.95
    """Second-moment decay."""
    eps: F32 = 1e-8
    """Denominator epsilon."""
    weight_decay: F32 = 0.1
    """Decoupled weight decay."""
    implementation: Literal["for-loop", "foreach", "fused"] = "fused"
    """Kernel implementation: fused (default: the step guard skips updates on the device), foreach
    or for-loop (the guard reads its verdict on the host each step)."""

    def __post_init__(self) -> None:
        _require(self.lr > 0, "optimizer.lr", "> 0", self.lr)
        _require(0 <= self.beta1 < 1, "optimizer.beta1", "in [0, 1)", self.beta1)
        _require(0 <= self.beta2 < 1, "optimizer.beta2", "in [0, 1)", self.beta2)
        _require(self.weight_decay >= 0, "optimizer.weight_decay", ">= 0", self.weight_decay)


@dataclass(kw_only=True)
class LRScheduler:
    """Linear warmup, then a stable phase and decay to a minimum (WSD covers all shapes)."""

    warmup_steps: int = 10
    """Steps of linear warmup from lr*1/(warmup+1) to the peak lr."""
    decay_ratio: float = -1.0
    """Fraction of steps spent decaying (WSD); -1 decays over all steps after warmup."""
    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Shape of the decay: linear, sqrt or cosine."""
    min_lr_factor: float = 0.0
    """Final lr as a fraction of the peak lr."""

    def __post_init__(self) -> None:
        _require(self.warmup_steps >= 0, "lr_scheduler.warmup_steps", ">= 0", self.warmup_steps)
        _require(
            self.decay_ratio == -1.0 or 0.0 <= self.decay_ratio <= 1.0,
            "lr_scheduler.decay_ratio",
            "-1 or a value in [0, 1]",
            self.decay_ratio,
        )
        _require(
            0.0 <= self.min_lr_factor <= 1.0,
            "lr_scheduler.min_lr_factor",
            "in [0, 1]",
            self.min_lr_factor,
        )


@dataclass(kw_only=True)
class Parallelism:
    """Parallel degrees; their product must equal the world size."""

    data_parallel_replicate_degree: int = 1
    """Replicas of the model (DDP-style, the outer dim of HSDP)."""
    data_parallel_shard_degree: int = -1
    """FSDP shard degree; -1 uses the ranks left over by the other degrees."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered params after forward: default = always unless pipeline parallel is on."""
    tensor_parallel_degree: int = 1
    """Tensor (and sequence) parallel degree."""
    disable_loss_parallel: bool = False
    """Compute the loss on gathered logits instead of vocab-sharded ones under TP."""
    enable_async_tensor_parallel: bool = False
    """Overlap TP communication with compute (CUDA and compile only)."""
    pipeline_parallel_degree: int = 1
    """Pipeline stages across ranks."""
    pipeline_parallel_schedule: str = "1F1B"
    """Schedule: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble."""
    pipeline_parallel_microbatch_size: int = 1
    """Sequences per pipeline microbatch."""
    pipeline_parallel_layers_per_stage: int = -1
    """Layers per virtual stage; -1 gives one stage per rank (two for looped schedules)."""
    pipeline_parallel_split_points: list[str] = field(default_factory=list)
    """Explicit module names where new stages begin (e.g. layers.4); overrides layers_per_stage."""
    context_parallel_degree: int = 1
    """Context parallel degree (ring attention along the sequence)."""
    context_parallel_rotate_method: Literal["allgather", "alltoall"] = "allgather"
    """How K/V shards rotate between context-parallel ranks."""
    expert_parallel_degree: int = 1
    """Ranks each MoE layer's routed experts are spread over (tokens travel by all-to-all);
    carved from data_parallel_shard_degree x context_parallel_degree: a multiple of
    context_parallel_degree that divides that product and the number of experts."""

    def __post_init__(self) -> None:
        for key in (
            "data_parallel_replicate_degree",
            "tensor_parallel_degree",
            "pipeline_parallel_degree",
            "context_parallel_degree",
            "expert_parallel_degree",
            "pipeline_parallel_microbatch_size",
        ):
            value = getattr(self, key)
            _require(value >= 1, f"parallelism.{key}", "an int >= 1", value)
        _require(
            self.data_parallel_shard_degree == -1 or self.data_parallel_shard_degree >= 1,
            "parallelism.data_parallel_shard_degree",
            "-1 or an int >= 1",
            self.data_parallel_shard_degree,
        )


@dataclass(kw_only=True)
class Checkpoint:
    """Distributed checkpoints (DCP): when to save, what to keep, what to load."""

    enable: bool = False
    """Save and load checkpoints."""
    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder (or an absolute path/URL)."""
    interval: int = 500
    """Save every N steps (and always at the last step)."""
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """Block on saves, save in a background thread, or stage through pinned memory first."""
    keep_latest_k: int = 10
    """Keep the newest K complete step checkpoints; 0 keeps all."""
    model_weights_only: bool = False
    """Save only model weights (no optimizer, scheduler, dataloader or train state)."""
    export_dtype: DTypeName = "float32"
    """Dtype of model weights in model-only saves."""
    last_save_model_only: bool = True
    """Make the final save model-only (in export_dtype)."""
    load_step: int = -1
    """Load this step; -1 loads the newest complete one."""
    verify: Literal["checksum", "size"] = "checksum"
    """Check of a step's files before loading it: checksums (reads them whole), or sizes only."""
    initial_load_path: str = ""
    """Checkpoint to load model weights from when the folder holds none yet."""
    initial_load_model_only: bool = True
    """Load only the model part of initial_load_path."""
    initial_load_in_hf: bool = False
    """initial_load_path is a Hugging Face folder (safetensors + config.json), not DCP."""
    exclude_from_loading: list[str] = field(default_factory=list)
    """State keys not to restore (model, optimizer, lr_scheduler, dataloader, train_state)."""
    create_seed_checkpoint: bool = False
    """Initialize the model, save it as the seed checkpoint and exit (all degrees must be 1)."""
    load_only: bool = False
    """Load checkpoints but never save any."""

    def __post_init__(self) -> None:
        _require(self.interval > 0, "checkpoint.interval", "an int > 0", self.interval)
        _require(
            self.keep_latest_k == 0 or self.keep_latest_k >= 2,
            "checkpoint.keep_latest_k",
            "0 (keep all) or >= 2",
            self.keep_latest_k,
        )
        _require(self.load_step >= -1, "checkpoint.load_step", ">= -1", self.load_step)
        allowed = {"model", "optimizer", "lr_scheduler", "dataloader", "train_state"}
        unknown = sorted(set(self.exclude_from_loading) - allowed)
        _require(
            not unknown,
            "checkpoint.exclude_from_loading",
            f"names among {sorted(allowed)}",
            unknown,
        )


@dataclass(kw_only=True)
class ActivationCheckpoint:
    """Trade compute for memory by recomputing activations in backward."""

    mode: Literal["none", "full", "selective"] = "none"
    """none, full (every block), or selective (see selective_ac_option)."""
    selective_ac_option: str = "op"
    """'op' saves the outputs of expensive ops; an int N checkpoints every N-th block."""
    preserve_rng_state: bool = False
    """Stash and restore RNG state around recomputation (needed with dropout)."""
    determinism_check: Literal["default", "none"] = "default"
    """Check that recomputed tensors match the originals (torch.utils.checkpoint)."""
    debug: bool = False
    """Record and print the recomputed op trace on mismatch."""

    def __post_init__(self) -> None:
        option = self.selective_ac_option
        _require(
            option == "op" or (option.isdigit() and int(option) > 0),
            "activation_checkpoint.selective_ac_option",
            "'op' or a positive int",
            option,
        )


@dataclass(kw_only=True)
class Compile:
    """torch.compile of model blocks and/or the loss."""

    enable: bool = False
    """Compile each transformer block (and the loss) with torch.compile."""
    components: list[Literal["model", "loss"]] = field(default_factory=lambda: ["model", "loss"])
    """What to compile when enabled."""
    backend: str = "inductor"
    """torch.compile backend."""


@dataclass(kw_only=True)
class Float8:
    """float8 training through torchao (CUDA, SM89+)."""

    enable_fsdp_float8_all_gather: bool = False
    """All-gather FSDP params in float8."""
    recipe_name: Literal["", "tensorwise", "rowwise", "rowwise_with_gw_hp"] = ""
    """torchao float8 recipe; empty disables float8."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linear modules (by name fragment) kept in high precision."""


@dataclass(kw_only=True)
class Comm:
    """Process-group and collective settings."""

    init_timeout_seconds: int = 300
    """Timeout for process-group initialization."""
    train_timeout_seconds: int = 100
    """Collective timeout after the first step."""
    trace_buf_size: int = 20000
    """Flight-recorder entries per rank (dumped to <dump_folder>/comm_traces on failure); 0 off."""
    mode: Literal["default", "fake_backend", "local_tensor"] = "default"
    """default, fake_backend (dry run, fake collectives), local_tensor (simulate all ranks)."""
    fake_world_size: int = 0
    """Ranks that fake_backend / local_tensor simulate in one process (run_train.sh: NGPU)."""

    def __post_init__(self) -> None:
        for key in ("init_timeout_seconds", "train_timeout_seconds"):
            value = getattr(self, key)
            _require(value > 0, f"comm.{key}", "seconds > 0", value)
        _require(
            self.trace_buf_size >= 0, "comm.trace_buf_size", "an int >= 0", self.trace_buf_size
        )
        _require(
            self.mode == "default" or self.fake_world_size >= 1,
            "comm.fake_world_size",
            f"the number of ranks to simulate (>= 1) with comm.mode={self.mode}",
            self.fake_world_size,
        )
        _require(
            self.fake_world_size >= 0, "comm.fake_world_size", "an int >= 0", self.fake_world_size
        )


@dataclass(kw_only=True)
class Profiling:
    """torch profiler traces and memory snapshots."""

    enable_profiling: bool = False
    """Write torch profiler traces every profile_freq steps."""
    save_traces_folder: str = "profile_traces"
    """Trace folder, relative to job.dump_folder."""
    profile_freq: int = 10
    """Steps between traces and snapshots."""
    profiler_active: int = 1
    """Steps recorded per trace."""
    profiler_warmup: int = 3
    """Warm-up steps before each recorded window."""
    enable_memory_snapshot: bool = False
    """Write memory snapshots every profile_freq steps (a CPU memory report on CPU)."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Snapshot folder, relative to job.dump_folder."""

    def __post_init__(self) -> None:
        _require(self.profile_freq > 0, "profiling.profile_freq", "an int > 0", self.profile_freq)
        _require(
            self.profiler_active > 0,
            "profiling.profiler_active",
            "an int > 0",
            self.profiler_active,
        )
        _require(
            0 <= self.profiler_warmup < self.profile_freq,
            "profiling.profiler_warmup",
            "in [0, profile_freq)",
            self.profiler_warmup,
        )


@dataclass(kw_only=True)
class Metrics:
    """What to log, how often, and where."""

    log_freq: int = 10
    """Log metrics every N steps."""
    enable_tensorboard: bool = False
    """Write TensorBoard event files."""
    save_tb_folder: str = "tb"
    """TensorBoard folder, relative to job.dump_folder."""
    enable_jsonl: bool = True
    """Append each logged step to <dump_folder>/metrics.jsonl."""
    color: Literal["auto", "always", "never"] = "auto"
    """Colour the console line: auto (when a terminal), always or never."""
    cpu_peak_tflops: float = 0.0
    """Peak TFLOP/s per rank used for MFU on CPU; 0 uses the CPU's theoretical peak (cores x
    clock x FLOPs per cycle of its vector instructions)."""
    device_peak_tflops: float = 0.0
    """Override the GPU peak TFLOP/s used for MFU; 0 looks it up by device name."""

    def __post_init__(self) -> None:
        _require(self.log_freq > 0, "metrics.log_freq", "an int > 0", self.log_freq)


HealthPolicy = Literal["stop", "skip", "rollback"]


@dataclass(kw_only=True)
class Health:
    """The guard on every step: non-finite values and spikes, and what to do about them."""

    enable: bool = True
    """Check every step's loss and gradient norm (on all ranks) before the optimizer steps."""
    nonfinite: HealthPolicy = "skip"
    """A NaN/inf loss or gradient norm: skip (the update is not applied), stop, or rollback (to
    the newest checkpoint, past the samples read since)."""
    spike: HealthPolicy = "skip"
    """A loss or gradient norm above mean + spike_threshold x std of the window: skip, stop or
    rollback."""
    spike_window: int = 128
    """Healthy steps in the rolling statistics; spikes are looked for once it is full."""
    spike_threshold: F32 = 6.0
    """Standard deviations above the window's mean that make a spike."""
    max_consecutive: int = 5
    """Stop after this many anomalous steps in a row (a persistent fault, not a transient one)."""
    max_rollbacks: int = 3
    """Stop instead of rolling back once this many rollbacks happened within rollback_window."""
    rollback_window: int = 1000
    """Steps over which rollbacks are counted for max_rollbacks."""
    rollback_lr_factor: float = 1.0
    """Learning-rate factor for the rollback_lr_steps steps after a rollback (1: no damping)."""
    rollback_lr_steps: int = 0
    """Steps after a rollback that train at rollback_lr_factor x the scheduled learning rate."""
    straggler_factor: float = 1.5
    """Name a rank whose compute or data wait per step exceeds this x the other ranks' median
    (compared at log steps); 0 turns it off."""
    sdc_every: int = 0
    """Silent-data-corruption check: every N steps, recompute the step's forward and backward
    on the same inputs and compare; 0 turns it off."""
    sdc: HealthPolicy = "stop"
    """A recompute that differs (a silent data corruption): stop, skip or rollback."""

    def __post_init__(self) -> None:
        _require(self.spike_window > 1, "health.spike_window", "an int > 1", self.spike_window)
        _require(
            self.spike_threshold > 0 and math.isfinite(self.spike_threshold),
            "health.spike_threshold",
            "a finite number > 0",
            self.spike_threshold,
        )
        _require(self.max_consecutive > 0, "health.max_consecutive", "an int > 0",
                 self.max_consecutive)  # fmt: skip
        _require(self.max_rollbacks > 0, "health.max_rollbacks", "an int > 0", self.max_rollbacks)
        _require(self.rollback_window > 0, "health.rollback_window", "an int > 0",
                 self.rollback_window)  # fmt: skip
        _require(0 < self.rollback_lr_factor <= 1, "health.rollback_lr_factor",
                 "a number in (0, 1]", self.rollback_lr_factor)  # fmt: skip
        _require(self.rollback_lr_steps >= 0, "health.rollback_lr_steps", "an int >= 0",
                 self.rollback_lr_steps)  # fmt: skip
        _require(
            self.straggler_factor == 0
            or (self.straggler_factor > 1 and math.isfinite(self.straggler_factor)),
            "health.straggler_factor",
            "0 (off) or a finite number > 1",
            self.straggler_factor,
        )
        _require(self.sdc_every >= 0, "health.sdc_every", "an int >= 0 (0: off)", self.sdc_every)


@dataclass(kw_only=True)
class FaultTolerance:
    """Replica groups that outlive each other's failures (torchft; docs/fault-tolerance.md)."""

    enable: bool = False
    """Train parallelism.data_parallel_replicate_degree replica groups, each its own torchrun
    job, averaged across groups through a torchft quorum: a group that dies does not stop the
    others, and when it is restarted it heals from a live one, not from storage."""
    group_id: int = -1
    """This replica group's id, 0 .. groups - 1 (titan launch sets it for each group)."""
    lighthouse: str = ""
    """The torchft lighthouse's address (http://host:port); empty: titan launch starts one on
    this host for the job."""
    min_replicas: int = 1
    """Replica groups that must be live for a step to commit (and for the first quorum)."""
    timeout_seconds: float = 30.0
    """Limit of one collective or request across groups: a hung group is given up after it."""
    quorum_timeout_seconds: float = 120.0
    """Limit of one quorum (a group restarting and healing holds the others this long at most)."""
    heartbeat_timeout_ms: int = 2000
    """Lighthouse: a group silent this long is dead, and the next quorum goes on without it."""
    join_timeout_ms: int = 10000
    """Lighthouse: how long a quorum waits for groups that are alive but have not asked yet
    (a group starting or restarting; a steady quorum does not wait)."""
    semi_sync: Literal["off", "local_sgd", "diloco"] = "off"
    """off: gradients averaged across groups every step. local_sgd: each group steps on its
    own and the weights are averaged every sync_every steps. diloco: the same, but the groups'
    average drift since the last sync (the pseudo-gradient) is applied by an outer Nesterov
    SGD (outer_lr, outer_momentum). For groups on slow links."""
    sync_every: int = 20
    """semi_sync: steps between weight syncs (and after the last step)."""
    outer_lr: F32 = 0.7
    """semi_sync diloco: the outer optimizer's learning rate."""
    outer_momentum: F32 = 0.9
    """semi_sync diloco: the outer optimizer's Nesterov momentum (0: plain SGD)."""

    def __post_init__(self) -> None:
        _require(self.min_replicas >= 1, "fault_tolerance.min_replicas", "an int >= 1",
                 self.min_replicas)  # fmt: skip
        _require(self.sync_every >= 1, "fault_tolerance.sync_every", "an int >= 1",
                 self.sync_every)  # fmt: skip
        _require(self.outer_lr > 0 and math.isfinite(self.outer_lr), "fault_tolerance.outer_lr",
                 "a finite number > 0", self.outer_lr)  # fmt: skip
        _require(0 <= self.outer_momentum < 1, "fault_tolerance.outer_momentum",
                 "a number in [0, 1)", self.outer_momentum)  # fmt: skip
        _require(self.group_id >= -1, "fault_tolerance.group_id", "-1 (unset) or an int >= 0",
                 self.group_id)  # fmt: skip
        for key in ("timeout_seconds", "quorum_timeout_seconds"):
            value = getattr(self, key)
            _require(value > 0 and math.isfinite(value), f"fault_tolerance.{key}",
                     "a finite number of seconds > 0", value)  # fmt: skip
        for key in ("heartbeat_timeout_ms", "join_timeout_ms"):
            _require(getattr(self, key) > 0, f"fault_tolerance.{key}", "milliseconds > 0",
                     getattr(self, key))  # fmt: skip
        if self.lighthouse:
            _require(self.lighthouse.startswith(("http://", "https://")) and
                     ":" in self.lighthouse.split("://", 1)[1], "fault_tolerance.lighthouse",
                     "an address http://host:port", self.lighthouse)  # fmt: skip


@dataclass(kw_only=True)
class Validation:
    """Periodic held-out loss."""

    enable: bool = False
    """Compute validation loss every freq steps."""
    dataset: str = ""
    """Validation dataset; empty uses dataloader.dataset's validation split."""
    dataset_split: str = "validation"
    """Split to read when dataset is a Hugging Face dataset or the bundled corpus."""
    freq: int = 50
    """Validate every N steps (and at the last step)."""
    steps: int = 8
    """Batches per validation run."""
    local_batch_size: int = -1
    """Batch size for validation; -1 uses training.local_batch_size."""

    def __post_init__(self) -> None:
        _require(self.freq > 0, "validation.freq", "an int > 0", self.freq)
        _require(self.steps > 0, "validation.steps", "an int > 0", self.steps)


EVALUATOR_KINDS = ("heldout", "task")
# Options each kind takes after ``?`` (KEY=VALUE&...), and whether each is an int.
EVALUATOR_OPTIONS: dict[str, dict[str, bool]] = {
    "heldout": {"split": False, "batches": True},
    "task": {"num_shots": True, "seed": True, "shots": False, "format": False, "examples": True},
}
_EVALUATOR_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_OPTIONS = re.compile(r"[a-z_]+=[^&=]*(&[a-z_]+=[^&=]*)*")


@dataclass(frozen=True)
class EvaluatorEntry:
    """One ``evaluators.sets`` entry, ``NAME=KIND:SOURCE[?KEY=VALUE&...]``, parsed (not read)."""

    name: str
    kind: Literal["heldout", "task"]
    source: str
    options: dict[str, str | int]

    def option(self, key: str, default: str | int) -> str | int:
        """The option ``key`` when the entry gives it, else ``default``."""
        return self.options.get(key, default)

    def text(self) -> str:
        """The entry as written in ``evaluators.sets``."""
        options = "&".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.name}={self.kind}:{self.source}" + (f"?{options}" if options else "")


def parse_evaluators(entries: list[str], key: str = "evaluators.sets") -> list[EvaluatorEntry]:
    """``NAME=KIND:SOURCE[?KEY=VALUE&...]`` entries, checked for form only (names unique, kinds
    and options known); what a source holds is checked before training starts
    (``titan_core.components.evaluators.check_evaluators``)."""
    form = "NAME=KIND:SOURCE[?KEY=VALUE&...] with KIND heldout or task"
    out: list[EvaluatorEntry] = []
    for entry in entries:
        name, _, rest = str(entry).partition("=")
        kind, _, source = rest.partition(":")
        _require(bool(_EVALUATOR_NAME.fullmatch(name)), key,
                 f"{form}, NAME of letters, digits, '.', '_' or '-'", entry)  # fmt: skip
        _require(kind in EVALUATOR_KINDS and bool(source), key, form, entry)
        head, sep, tail = source.rpartition("?")
        options: dict[str, str | int] = {}
        if sep and _OPTIONS.fullmatch(tail):  # else the "?" belongs to the source
            source = head
            known = EVALUATOR_OPTIONS[kind]
            for pair in tail.split("&"):
                opt, _, value = pair.partition("=")
                _require(opt in known, key,
                         f"{kind} options among {', '.join(known)}", entry)  # fmt: skip
                is_int = value.lstrip("-").isdigit()
                _require(is_int or not known[opt], key, f"{opt}=<an int>", entry)
                options[opt] = int(value) if known[opt] else value
        _require(bool(source), key, form, entry)
        for opt, least in (("batches", 1), ("num_shots", 0), ("examples", 1)):
            _require(int(options.get(opt, least)) >= least, key,
                     f"{opt} >= {least}", entry)  # fmt: skip
        out.append(EvaluatorEntry(name, kind, source, options))  # type: ignore[arg-type]
    names = [e.name for e in out]
    dupes = sorted({n for n in names if names.count(n) > 1})
    _require(not dupes, key, "each evaluator name once", dupes)
    return out


@dataclass(kw_only=True)
class Evaluators:
    """In-loop evaluation: named held-out sets and downstream tasks, scored while training
    (docs/evaluation.md#in-loop-evaluation)."""

    sets: list[str] = field(default_factory=list)
    """Named evaluators, NAME=KIND:SOURCE[?KEY=VALUE&...]. heldout: loss, perplexity and bits
    per byte of a prepared dataset's validation split, a registered dataset or a .txt/.jsonl
    file or folder at any URL (options split, batches). task: accuracies and bits per byte of
    a bundled task (next_sentence, line_closing) or a task file URL (options num_shots, seed,
    shots, format, examples: a fixed subset of N examples drawn with seed). Logged as
    eval/NAME/METRIC; empty runs none."""
    freq: int = 100
    """Evaluate every N steps (and always at the last step)."""
    at_start: bool = False
    """Also evaluate before the first step of a run that starts at step 0 (logged at step 0)."""
    batch_size: int = -1
    """Sequences per forward on each data-parallel rank; -1 uses training.local_batch_size."""
    batches: int = 20
    """Held-out sets: batches scored, the split's first N over all ranks (a set's own
    ?batches=N wins)."""

    def __post_init__(self) -> None:
        parse_evaluators(self.sets)
        _require(self.freq > 0, "evaluators.freq", "an int > 0", self.freq)
        _require(
            self.batch_size == -1 or self.batch_size > 0,
            "evaluators.batch_size",
            "-1 or an int > 0",
            self.batch_size,
        )
        _require(self.batches > 0, "evaluators.batches", "an int > 0", self.batches)


DEFAULT_PROMPTS = ["The Python language", "To be, or not to be,", "A list comprehension"]
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass(kw_only=True)
class Evaluate:
    """Evaluation of a checkpoint, by the pipeline's evaluate stage and by ``titan eval``."""

    batches: int = 20
    """Held-out batches scored (validation.* says which data); 0 = the whole split."""
    prompts: list[str] = field(default_factory=lambda: list(DEFAULT_PROMPTS))
    """Prompts of the report's greedy samples; an empty list skips generation."""
    max_new_tokens: int = 32
    """Most tokens generated per greedy sample."""
    lm_eval_tasks: list[str] = field(default_factory=list)
    """lm-eval tasks from lm_eval_task_dir, run offline on the HF export; empty runs none."""
    lm_eval_task_dir: str = ""
    """Local folder of lm-eval task YAMLs (needed with lm_eval_tasks)."""
    lm_eval_limit: float = 0.0
    """Documents per lm-eval task (a fraction of each when < 1); 0 runs them all."""
    lm_eval_batch_size: int = 8
    """Sequences per forward pass in the lm-eval harness."""

    def __post_init__(self) -> None:
        _require(
            isinstance(self.batches, int) and self.batches >= 0,
            "evaluate.batches",
            "an int >= 0 (0 = all)",
            self.batches,
        )
        _require(self.max_new_tokens >= 0, "evaluate.max_new_tokens", ">= 0", self.max_new_tokens)
        _require(all(self.prompts), "evaluate.prompts", "non-empty prompts", self.prompts)
        _require(
            all(self.lm_eval_tasks), "evaluate.lm_eval_tasks", "task names", self.lm_eval_tasks
        )
        _require(
            not self.lm_eval_tasks or bool(self.lm_eval_task_dir),
            "evaluate.lm_eval_task_dir",
            "a local folder of task YAMLs with evaluate.lm_eval_tasks",
            self.lm_eval_task_dir,
        )
        _require(self.lm_eval_limit >= 0, "evaluate.lm_eval_limit", ">= 0", self.lm_eval_limit)
        _require(
            self.lm_eval_batch_size >= 1,
            "evaluate.lm_eval_batch_size",
            "an int >= 1",
            self.lm_eval_batch_size,
        )


def parse_size(text: str, key: str = "convert.max_shard_size") -> int:
    """Bytes in ``5GB`` / ``500MB`` / ``2GiB`` / ``123`` (decimal units, as transformers)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS or float(match.group(1)) <= 0:
        raise ConfigError(f"{key}: expected a size like 5GB, 500MB or 2GiB, got {text!r}")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


@dataclass(kw_only=True)
class Convert:
    """Export of a DCP checkpoint as a Hugging Face folder (the pipeline's convert stage and
    ``titan convert dcp-to-hf``). The checkpoint's own dtype is checkpoint.export_dtype."""

    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of the exported weights; float32 keeps a float32 checkpoint's bit for bit."""
    max_shard_size: str = "5GB"
    """Largest safetensors shard, e.g. 5GB, 500MB, 2GiB or bytes (a larger tensor gets its own)."""

    def __post_init__(self) -> None:
        parse_size(self.max_shard_size)


@dataclass(kw_only=True)
class Debug:
    """Reproducibility and debugging switches."""

    seed: int = 42
    """Seed for parameter init and every RNG."""
    deterministic: bool = False
    """Use deterministic algorithms only (and seed every rank identically)."""
    deterministic_warn_only: bool = False
    """Warn instead of failing on ops without a deterministic implementation."""
    num_threads: int = 0
    """torch intra-op threads; 0 keeps torch's default."""
    inject: list[str] = field(default_factory=list)
    """Fault drills, KIND:STEP[:RANK], KIND one of nan_loss, nan_grad, loss_spike, grad_spike,
    slow_rank (from STEP on), bitflip (in STEP's forward), overflow_update (STEP's update)."""
    drill: bool = False
    """Allow debug.inject: a run with injected faults must say it is a drill."""

    def __post_init__(self) -> None:
        parse_injections(self.inject)
        _require(
            self.drill or not self.inject,
            "debug.inject",
            "debug.drill on as well (injected faults are for drills only)",
            self.inject,
        )


INJECTION_KINDS = (
    "nan_loss",
    "nan_grad",
    "loss_spike",
    "grad_spike",
    "slow_rank",
    "bitflip",
    "overflow_update",
)


def parse_injections(entries: list[str]) -> list[tuple[str, int, int]]:
    """``debug.inject`` entries as (kind, step, rank); rank 0 when not given."""
    out = []
    for entry in entries:
        parts = entry.split(":")
        ok = 2 <= len(parts) <= 3 and parts[0] in INJECTION_KINDS
        ok = ok and all(p.isdigit() for p in parts[1:]) and int(parts[1]) > 0
        _require(
            ok,
            "debug.inject",
            f"KIND:STEP[:RANK] with KIND one of {', '.join(INJECTION_KINDS)} and STEP > 0",
            entry,
        )
        out.append((parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else 0))
    return out


# --- pipeline: launching, storage and tracking (used by tasks/ and flows/) ----------------------


@dataclass(kw_only=True)
class Slurm:
    """Slurm batch jobs of the slurm launcher (``[launch.slurm]``)."""

    partition: str = ""
    """Partition (sbatch --partition); empty: the cluster's default."""
    account: str = ""
    """Account to charge (sbatch --account); empty: the user's default."""
    time_limit: str = "04:00:00"
    """Job time limit (sbatch --time), e.g. 30, 04:00:00 or 2-00:00:00."""
    job_name: str = "titan"
    """Job name (sbatch --job-name)."""
    sbatch_args: list[str] = field(default_factory=list)
    """Extra sbatch options, one per item: gpus-per-node=8, exclusive (-- optional)."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run on the batch node before srun (module load, source a venv)."""
    python: str = ""
    """Python on the nodes; empty: this interpreter (the nodes share its filesystem)."""
    rdzv_port_base: int = 29500
    """Rendezvous port = base + job id % 1000 (jobs sharing a head node differ)."""
    poll_seconds: float = 10.0
    """Seconds between squeue polls (output is streamed more often)."""

    def __post_init__(self) -> None:
        _require(
            bool(re.fullmatch(r"(\d+-)?\d+(:\d{1,2}){0,2}", self.time_limit)),
            "launch.slurm.time_limit",
            "minutes, [D-]HH:MM[:SS] or MM:SS",
            self.time_limit,
        )
        _require(
            1 <= self.rdzv_port_base <= 64535,
            "launch.slurm.rdzv_port_base",
            "a port in 1..64535",
            self.rdzv_port_base,
        )
        _require(self.poll_seconds > 0, "launch.slurm.poll_seconds", "> 0", self.poll_seconds)
        for arg in self.sbatch_args:
            _require(
                bool(re.fullmatch(r"(--?)?[A-Za-z][\w-]*(=[^\s#]+)?", arg)),
                "launch.slurm.sbatch_args",
                "sbatch options such as exclusive or gpus-per-node=8, one per item",
                arg,
            )
        for key in ("partition", "account"):
            value = getattr(self, key)
            _require(
                bool(re.fullmatch(r"[\w.,+-]*", value)),
                f"launch.slurm.{key}",
                "a Slurm name (letters, digits and . , _ + -)",
                value,
            )
        _require(
            bool(re.fullmatch(r"[\w.+-]+", self.job_name)),
            "launch.slurm.job_name",
            "letters, digits and . _ + -",
            self.job_name,
        )


@dataclass(kw_only=True)
class Launch:
    """How the pipeline launches training (torchrun through titan_core.launch)."""

    backend: Literal["local", "local_multinode", "slurm"] = "local"
    """Launcher: local (one torchrun here), local_multinode (nnodes torchrun agents on loopback),
    slurm (sbatch + srun torchrun on every node)."""
    nproc_per_node: int = 1
    """Processes (ranks) per node."""
    nnodes: int = 1
    """Nodes in the job; world size = nnodes * nproc_per_node."""
    rdzv_endpoint: str = ""
    """host:port of the c10d rendezvous; empty: a free port here (slurm: the head node, per job)."""
    max_restarts: int = 0
    """torchrun's in-place restarts of a failed worker group (each resumes from a checkpoint)."""
    omp_num_threads: int = 1
    """OMP_NUM_THREADS of every rank; 0 keeps the environment's value."""
    log_ranks: str = "0"
    """Ranks whose output is streamed: a comma list of global ranks such as 0,1, or all."""
    retries: int = 2
    """Pipeline relaunches of failed training, each resuming from the newest complete checkpoint."""
    retry_delay_seconds: float = 10.0
    """Seconds before the first relaunch; doubles with each further attempt."""
    device_memory_gib: float = 0.0
    """Memory per device the preflight estimate must fit in; 0 = the GPU's own (none on CPU)."""
    slurm: Slurm = field(default_factory=Slurm)
    """Slurm batch jobs (backend slurm)."""

    def __post_init__(self) -> None:
        for key in ("nproc_per_node", "nnodes"):
            value = getattr(self, key)
            _require(value >= 1, f"launch.{key}", "an int >= 1", value)
        for key in ("max_restarts", "retries", "omp_num_threads"):
            value = getattr(self, key)
            _require(value >= 0, f"launch.{key}", "an int >= 0", value)
        _require(
            self.retry_delay_seconds >= 0,
            "launch.retry_delay_seconds",
            ">= 0",
            self.retry_delay_seconds,
        )
        _require(
            self.device_memory_gib >= 0, "launch.device_memory_gib", ">= 0", self.device_memory_gib
        )
        _require(
            not self.rdzv_endpoint or bool(re.fullmatch(r"[^\s:]+:\d+", self.rdzv_endpoint)),
            "launch.rdzv_endpoint",
            "host:port or empty",
            self.rdzv_endpoint,
        )
        _require(
            self.log_ranks == "all" or bool(re.fullmatch(r"\d+(,\d+)*", self.log_ranks)),
            "launch.log_ranks",
            "a comma list of ranks (e.g. 0,1) or all",
            self.log_ranks,
        )


@dataclass(kw_only=True)
class Storage:
    """How pipeline runs reach their storage (job.dump_folder says where it is)."""

    credentials_block: str = ""
    """Prefect Secret block with S3 credentials as JSON; empty reads the AWS_* environment."""
    retries: int = 4
    """Attempts per file for uploads and downloads, with exponential backoff."""
    progress: bool = True
    """Show progress bars for uploads and downloads."""

    def __post_init__(self) -> None:
        _require(self.retries >= 1, "storage.retries", "an int >= 1", self.retries)


@dataclass(kw_only=True)
class Tracking:
    """MLflow tracking of pipeline runs."""

    enable: bool = True
    """Record runs, params, metrics and models in MLflow."""
    uri: str = ""
    """Tracking URI; empty uses $MLFLOW_TRACKING_URI, else sqlite:///<job.dump_folder>/mlflow.db."""
    artifact_location: str = ""
    """Artifact root of a new experiment; empty uses <job.dump_folder>/mlflow-artifacts (or the
    server's default for an http URI)."""
    registered_model: str = ""
    """Registry name of the Hugging Face export; empty uses job.experiment."""
    champion_metric: str = "eval/loss"
    """Metric that moves the registry's champion alias when a new version beats the champion's:
    train/loss, eval/loss, eval/perplexity, eval/bits_per_byte or eval/NAME/METRIC of an
    evaluator (accuracies: higher wins; the rest: lower)."""


@dataclass(kw_only=True)
class JobConfig:
    """Root of the job configuration."""

    job: Job = field(default_factory=Job)
    """Job identity and output folder."""
    model: Model = field(default_factory=Model)
    """Model family and flavor."""
    tokenizer: Tokenizer = field(default_factory=Tokenizer)
    """Tokenizer source."""
    data: Data = field(default_factory=Data)
    """Data preparation (pre-tokenized shards)."""
    training: Training = field(default_factory=Training)
    """Training shapes and numerics."""
    dataloader: Dataloader = field(default_factory=Dataloader)
    """Training data: the dataset or mix, its sample order and reading."""
    optimizer: Optimizer = field(default_factory=Optimizer)
    """Optimizer."""
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    """Learning-rate schedule."""
    parallelism: Parallelism = field(default_factory=Parallelism)
    """Parallel degrees."""
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    """Checkpointing."""
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    """Activation checkpointing."""
    compile: Compile = field(default_factory=Compile)
    """torch.compile."""
    float8: Float8 = field(default_factory=Float8)
    """float8 training."""
    comm: Comm = field(default_factory=Comm)
    """Collectives and process groups."""
    profiling: Profiling = field(default_factory=Profiling)
    """Profiler traces and memory snapshots."""
    metrics: Metrics = field(default_factory=Metrics)
    """Metrics logging."""
    health: Health = field(default_factory=Health)
    """The step guard: NaN, inf and spikes."""
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    """Replica groups that outlive each other's failures (torchft)."""
    validation: Validation = field(default_factory=Validation)
    """Validation loss."""
    evaluators: Evaluators = field(default_factory=Evaluators)
    """In-loop evaluation on named held-out sets and downstream tasks."""
    evaluate: Evaluate = field(default_factory=Evaluate)
    """Evaluation of checkpoints."""
    convert: Convert = field(default_factory=Convert)
    """Hugging Face export of checkpoints."""
    debug: Debug = field(default_factory=Debug)
    """Seeds and determinism."""
    launch: Launch = field(default_factory=Launch)
    """How the pipeline launches training."""
    storage: Storage = field(default_factory=Storage)
    """Storage access of the pipeline (credentials, retries)."""
    tracking: Tracking = field(default_factory=Tracking)
    """MLflow tracking of the pipeline."""

    def __post_init__(self) -> None:
        # Checks across sections; every section has checked its own fields already.
        ft, groups = self.fault_tolerance, self.parallelism.data_parallel_replicate_degree
        if ft.enable:
            _require(groups >= 2, "fault_tolerance.enable",
                     "parallelism.data_parallel_replicate_degree >= 2 (the replica groups)",
                     groups)  # fmt: skip
            _require(ft.min_replicas <= groups, "fault_tolerance.min_replicas",
                     f"at most the {groups} replica groups "
                     "(parallelism.data_parallel_replicate_degree)", ft.min_replicas)  # fmt: skip
            _require(ft.group_id < groups, "fault_tolerance.group_id",
                     f"-1 or a group 0..{groups - 1}", ft.group_id)  # fmt: skip
        _require(ft.enable or ft.semi_sync == "off", "fault_tolerance.semi_sync",
                 "off unless fault_tolerance.enable (it syncs replica groups)",
                 ft.semi_sync)  # fmt: skip
        if ft.semi_sync != "off" and self.health.enable:
            for key in ("nonfinite", "spike", "sdc"):  # each group's guard sees its own loss
                _require(getattr(self.health, key) != "rollback", f"health.{key}",
                         "skip or stop with fault_tolerance.semi_sync (a group would roll back "
                         "alone, off the others' steps)", getattr(self.health, key))  # fmt: skip
        _require(
            self.dataloader.document_masking or not self.training.document_positions,
            "training.document_positions",
            "dataloader.document_masking on as well",
            self.training.document_positions,
        )
        evaluators = {e.name: e.kind for e in parse_evaluators(self.evaluators.sets)}
        check_metric(self.tracking.champion_metric, "tracking.champion_metric", evaluators)
