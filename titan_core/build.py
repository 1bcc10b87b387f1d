"""Building a job's pieces before training: the checks that need no process group, the model
args a job resolves to, and the parallelized, materialized model parts.

Shared by the trainer, ``titan train`` (checks before torchrun starts), conversion, evaluation and
estimation, none of which should import the trainer for these.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from titan_core import storage
from titan_core.checkpoint.manager import checkpoint_model
from titan_core.config.job import (
    EvaluatorEntry,
    JobConfig,
    parse_evaluators,
    parse_injections,
    parse_mix,
)
from titan_core.data import Tokenizer, default_tokenizer_path
from titan_core.distributed import simulation
from titan_core.distributed import utils as dist_utils
from titan_core.distributed.parallel_dims import ParallelDims
from titan_core.distributed.pipeline_parallel import PipelineRunner
from titan_core.errors import ConfigError, DataError
from titan_core.logging import logger
from titan_core.models import CHECKPOINT_FLAVOR, ModelSpec, get_flavor, get_model_spec

SIDE_ROOT_ENV = "TITAN_SIDE_ROOT"


def local_side_folder(dump_folder: str) -> str:
    """Local folder for traces, snapshots, TensorBoard and metrics.jsonl.

    These writers need a real file system; when the dump folder is a URL they go to a local
    mirror that the pipeline uploads, under ``$TITAN_SIDE_ROOT`` (default: the temp folder;
    under Slurm a folder that the login and compute nodes share).
    """
    if not storage.is_url(dump_folder):
        return dump_folder.removeprefix("file://")
    safe = dump_folder.replace("://", "_").replace("/", "_")
    return os.path.join(os.environ.get(SIDE_ROOT_ENV) or tempfile.gettempdir(), "titan_runs", safe)


def flavor_args(cfg: JobConfig) -> Any:
    """A private copy of the model args ``model.flavor`` names, ``model.n_layers`` applied: the
    family's flavor, or for the reserved flavor ``checkpoint`` the exact model that
    ``checkpoint.initial_load_path``'s commit marker describes (vocabulary included)."""
    if cfg.model.flavor == CHECKPOINT_FLAVOR:
        args = _checkpoint_args(cfg)
    else:
        args = get_flavor(cfg.model.name, cfg.model.flavor)
    if cfg.model.n_layers > 0:
        args.n_layers = cfg.model.n_layers
    if cfg.model.mtp_layers >= 0:
        if not hasattr(args, "mtp_layers"):
            raise ConfigError(
                f"model.mtp_layers: {cfg.model.name} has no multi-token prediction (leave it -1)"
            )
        args.mtp_layers = cfg.model.mtp_layers
    if cfg.model.mtp_loss_weight >= 0:
        if not hasattr(args, "mtp_loss_weight"):
            raise ConfigError(
                f"model.mtp_loss_weight: {cfg.model.name} has no multi-token prediction (leave "
                "it -1)"
            )
        args.mtp_loss_weight = cfg.model.mtp_loss_weight
    _apply_moe_overrides(cfg, args)
    return args


def _apply_moe_overrides(cfg: JobConfig, args: Any) -> None:
    """``model.moe_*`` onto the flavor's ``moe`` args, checked (one line naming the key) before
    anything is built."""
    m = cfg.model
    bias = {"on": True, "off": False}.get(m.moe_load_balance_bias)
    overrides = {
        (field, key): value
        for field, key, value, given in (
            ("num_experts", "moe_num_experts", m.moe_num_experts, m.moe_num_experts > 0),
            ("top_k", "moe_top_k", m.moe_top_k, m.moe_top_k > 0),
            ("aux_loss_coef", "moe_aux_loss_coef", m.moe_aux_loss_coef, m.moe_aux_loss_coef >= 0),
            ("load_balance_bias", "moe_load_balance_bias", bias, bias is not None),
        )
        if given
    }
    if not overrides:
        return
    moe = getattr(args, "moe", None)
    if moe is None:
        key = next(iter(overrides))[1]
        raise ConfigError(f"model.{key}: {m.name} {m.flavor} has no mixture-of-experts layers")
    values = {field: value for (field, _), value in overrides.items()}
    num_experts = values.get("num_experts", moe.num_experts)
    top_k = values.get("top_k", moe.top_k)
    if top_k > num_experts:
        raise ConfigError(
            f"model.moe_top_k: {top_k} experts per token is more than the {num_experts} "
            "experts of each MoE layer"
        )
    args.moe = dataclasses.replace(moe, **values)


def _checkpoint_args(cfg: JobConfig) -> Any:
    path = cfg.checkpoint.initial_load_path
    where = f"model.flavor: {CHECKPOINT_FLAVOR!r} builds the model checkpoint.initial_load_path"
    if not path or cfg.checkpoint.initial_load_in_hf:
        raise ConfigError(f"{where} describes, but that is not set to a DCP checkpoint")
    found = checkpoint_model(path)
    if found is None:
        raise ConfigError(f"{where} describes, but {path} has no model description")
    name, args = found
    if name != cfg.model.name:
        raise ConfigError(f"model.name: {path} holds a {name} model, got {cfg.model.name!r}")
    return args


def build_model_args(cfg: JobConfig, tokenizer_vocab: int) -> Any:
    """The flavor's model args with the vocabulary, depth and RoPE length this job needs.

    With ``model.flavor checkpoint`` the vocabulary is the described model's own.
    """
    args = flavor_args(cfg)
    if cfg.model.flavor == CHECKPOINT_FLAVOR:
        path = cfg.checkpoint.initial_load_path
        if args.vocab_size < tokenizer_vocab:
            raise ConfigError(
                f"model.vocab_size: the model of {path} has {args.vocab_size} tokens, fewer "
                f"than the tokenizer's {tokenizer_vocab} (tokenizer.path)"
            )
        if cfg.model.vocab_size > 0 and cfg.model.vocab_size != args.vocab_size:
            raise ConfigError(
                f"model.vocab_size: the model of {path} has {args.vocab_size} tokens, "
                f"got {cfg.model.vocab_size}"
            )
    elif 0 < cfg.model.vocab_size < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size: expected >= the tokenizer's {tokenizer_vocab} "
            f"tokens, got {cfg.model.vocab_size}"
        )
    else:
        args.vocab_size = cfg.model.vocab_size if cfg.model.vocab_size > 0 else tokenizer_vocab
    if cfg.model.max_seq_len > 0:
        if cfg.model.max_seq_len < cfg.training.seq_len:
            raise ConfigError(
                f"model.max_seq_len: expected >= training.seq_len "
                f"({cfg.training.seq_len}), got {cfg.model.max_seq_len}"
            )
        args.max_seq_len = cfg.model.max_seq_len
    else:
        args.max_seq_len = max(args.max_seq_len, cfg.training.seq_len)
    args.document_positions = cfg.training.document_positions
    return args


def check_prepared_data(cfg: JobConfig, tokenizer: Tokenizer, dp_degree: int = 1) -> None:
    """Prepared datasets the job reads (dataloader.dataset or its mix, and validation's):
    manifest present, this job's tokenizer, shard sizes as listed (one listing per dataset),
    enough tokens for one sample. DataError naming the file; raw text is checked later."""
    from titan_core.components.validate import validation_data
    from titan_core.data import shards
    from titan_core.data.windows import check_prepared

    t, d = cfg.training, cfg.dataloader
    mix = [url for url, _ in parse_mix(d.mix)]
    train = mix or [loc for loc in [d.location] if shards.is_prepared(loc)]
    needs = (
        ("dataloader.document_masking", d.document_masking),
        ("dataloader.exclude", bool(d.exclude)),
        # Replica groups read one global order, whose position every group holds the same.
        ("fault_tolerance.enable", cfg.fault_tolerance.enable),
    )
    for key, on in needs:
        if on and not train:
            raise ConfigError(
                f"{key}: needs a prepared dataset (titan data prepare), got {d.location!r}"
            )
    todo = [(url, "train") for url in train]
    if cfg.validation.enable:
        data = validation_data(cfg)
        if shards.is_prepared(loc := data["dataset_path"] or data["dataset"]):
            todo.append((loc, data["split"]))
        elif d.document_masking:
            raise ConfigError(
                f"validation.dataset: dataloader.document_masking needs a prepared dataset, got "
                f"{loc!r}"
            )
    for url, split in todo:
        manifest = check_prepared(
            url, split, fingerprint=tokenizer.fingerprint, seq_len=t.seq_len, verify="size"
        )
        if split != "train":  # a validation pass runs whole global batches only
            samples = (sum(s.num_tokens for s in manifest.split_shards(split)) - 1) // t.seq_len
            batch = validation_data(cfg)["local_batch_size"] * dp_degree
            if samples < batch:
                raise DataError(
                    f"{url}: the {split} split holds {samples} samples of {t.seq_len + 1} tokens, "
                    f"fewer than one validation batch over the data-parallel ranks ({batch}); "
                    "lower validation.local_batch_size or hold out more (data.validation_every)"
                )


def check_job(cfg: JobConfig, world_size: int) -> tuple[ParallelDims, Tokenizer, Any]:
    """Every check that needs no process group: degrees, the parallel plan, tokenizer,
    prepared data (manifests, shard sizes), model shapes. Run by the trainer before
    ``init_distributed`` and by ``titan train`` before it launches torchrun, so a bad config
    fails with one line before any process starts."""
    parallel_dims = ParallelDims.from_config(cfg.parallelism, world_size)
    spec = get_model_spec(cfg.model.name)
    # Depth and tying from the flavor: the vocabulary (the tokenizer's) is filled in below.
    spec.check(parallel_dims, cfg, dist_utils.device_type(), flavor_args(cfg))
    if cfg.dataloader.document_masking and (parallel_dims.pp_enabled or parallel_dims.cp_enabled):
        raise ConfigError(
            "dataloader.document_masking: not supported with pipeline or context parallelism yet "
            "(parallelism.pipeline_parallel_degree and context_parallel_degree must be 1)"
        )
    for kind, step, rank in parse_injections(cfg.debug.inject):
        _check_injection(cfg, kind, step, rank, world_size)
    tokenizer = Tokenizer(cfg.tokenizer.path or str(default_tokenizer_path()))
    check_prepared_data(cfg, tokenizer, parallel_dims.dp_degree)
    if cfg.evaluators.sets:
        from titan_core.components.evaluators import check_evaluators

        check_evaluators(cfg, tokenizer)  # task files read whole, held-out sets' first batch
    model_args = build_model_args(cfg, tokenizer.n_words)
    if parallel_dims.cp_enabled:
        # CP shards the RoPE table with the tokens, so it needs exactly one row per token.
        model_args.max_seq_len = cfg.training.seq_len
    return parallel_dims, tokenizer, model_args


def check_outputs_writable(cfg: JobConfig) -> None:
    """One ``ConfigError`` line, before anything starts, unless this process can write where
    the job writes: ``job.dump_folder`` and, when the job saves checkpoints, the checkpoint
    folder (``checkpoint.folder`` may be an absolute path or a URL outside the dump folder)."""
    storage.check_writable(cfg.job.dump_folder, "job.dump_folder")
    ckpt = cfg.checkpoint
    if (ckpt.enable and not ckpt.load_only) or ckpt.create_seed_checkpoint:
        folder = storage.resolve(cfg.job.dump_folder, ckpt.folder)
        storage.check_writable(folder, "checkpoint.folder")


def _check_injection(cfg: JobConfig, kind: str, step: int, rank: int, world_size: int) -> None:
    """One ``debug.inject`` entry against the job: its rank and step exist, and what would see
    the fault is on (a drill nothing can detect proves nothing)."""
    entry, health = f"debug.inject: {kind}:{step}:{rank}", cfg.health
    if rank >= world_size:
        raise ConfigError(f"{entry} names rank {rank}, but the job has ranks 0..{world_size - 1}")
    if step > cfg.training.steps:
        raise ConfigError(
            f"{entry}: step {step} is past the last step (training.steps = "
            f"{cfg.training.steps}): it would never fire"
        )
    if kind == "slow_rank" and (world_size < 2 or not health.enable or not health.straggler_factor):
        raise ConfigError(
            f"{entry}: a slow rank is found by comparing ranks: it needs a job of 2 or more "
            f"ranks (this one has {world_size}), health.enable and health.straggler_factor > 0"
        )
    if kind == "bitflip" and (not health.enable or not health.sdc_every or step % health.sdc_every):
        raise ConfigError(
            f"{entry}: step {step} is not checked: a bit flip is found by the recompute of "
            f"a step that health.sdc_every (now {health.sdc_every}) divides, with health.enable"
        )


def resolved_config(cfg: JobConfig, parallel_dims: ParallelDims, model_args: Any) -> JobConfig:
    """``cfg`` with the "auto" values the engine resolved written out, as the ranks run it: the
    model's vocabulary, depth and RoPE length (and a mixture-of-experts flavor's routing), the
    FSDP degree, the validation and evaluation batches and the evaluators' paths.
    ``job.config_file`` is cleared: the file it names is already applied, and reloading the
    saved config must give the same config back.

    ``model_args`` and ``parallel_dims`` are ``check_job``'s. Rules that follow other keys stay
    rules: ``lr_scheduler.decay_ratio`` (-1: every step after warmup, which a retrain with more
    steps must recompute), ``pipeline_parallel_layers_per_stage`` (uneven splits have no single
    value) and ``checkpoint.load_step`` (the newest checkpoint at load time).
    """
    moe = getattr(model_args, "moe", None)
    routing = (
        {
            "moe_num_experts": moe.num_experts,
            "moe_top_k": moe.top_k,
            "moe_aux_loss_coef": moe.aux_loss_coef,
            "moe_load_balance_bias": "on" if moe.load_balance_bias else "off",
        }
        if moe is not None
        else {}  # a dense model has no routing to write (a value would be refused)
    )
    validation_batch = cfg.validation.local_batch_size
    loader = cfg.dataloader
    return dataclasses.replace(
        cfg,
        job=dataclasses.replace(cfg.job, config_file=""),
        tokenizer=dataclasses.replace(cfg.tokenizer, path=_absolute(cfg.tokenizer.path)),
        dataloader=dataclasses.replace(
            loader,
            dataset=_absolute(loader.dataset),
            path=_absolute(loader.path),
            mix=[_absolute(url) + sep + weight for url, sep, weight in map(_split_mix, loader.mix)],
        ),
        checkpoint=dataclasses.replace(
            cfg.checkpoint, initial_load_path=_absolute(cfg.checkpoint.initial_load_path)
        ),
        model=dataclasses.replace(
            cfg.model,
            vocab_size=model_args.vocab_size,
            n_layers=model_args.n_layers,
            max_seq_len=model_args.max_seq_len,
            **routing,
        ),
        parallelism=dataclasses.replace(
            cfg.parallelism, data_parallel_shard_degree=parallel_dims.dp_shard
        ),
        validation=dataclasses.replace(
            cfg.validation,
            dataset=_absolute(cfg.validation.dataset),
            local_batch_size=(
                validation_batch if validation_batch > 0 else cfg.training.local_batch_size
            ),
        ),
        data=dataclasses.replace(
            cfg.data,
            sources=[_absolute(s) for s in cfg.data.sources],
            root=_absolute(cfg.data.root),
        ),
        evaluators=dataclasses.replace(
            cfg.evaluators,
            sets=[_absolute_evaluator(e) for e in parse_evaluators(cfg.evaluators.sets)],
            batch_size=cfg.evaluators.batch_size
            if cfg.evaluators.batch_size > 0
            else cfg.training.local_batch_size,
        ),
    )


def _absolute(value: str) -> str:
    """A relative path that exists here, made absolute, so that the saved config reads the same
    data from any directory (an evaluation run elsewhere took ``data/x.jsonl`` for a Hugging Face
    dataset); names, URLs, absolute and missing paths are kept as given."""
    if not value or "://" in value or value.startswith(("hf:", "~")) or os.path.isabs(value):
        return value
    return os.path.abspath(value) if os.path.exists(value) else value


def _absolute_evaluator(entry: EvaluatorEntry) -> str:
    """An ``evaluators.sets`` entry with its relative source and shots paths made absolute."""
    options = dict(entry.options)
    if "shots" in options:
        options["shots"] = _absolute(str(options["shots"]))
    return dataclasses.replace(entry, source=_absolute(entry.source), options=options).text()


def _split_mix(entry: str) -> tuple[str, str, str]:
    """A ``URL=WEIGHT`` mix entry as (URL, "=", WEIGHT); no weight: (entry, "", "")."""
    url, sep, weight = entry.rpartition("=")
    return (url, sep, weight) if sep else (entry, "", "")


def resolve_auto(cfg: JobConfig, world_size: int) -> JobConfig:
    """``cfg`` checked for ``world_size`` ranks (``check_job``) with its "auto" values resolved
    (``resolved_config``): the config a run saves as ``config.toml`` and logs as params."""
    parallel_dims, _, model_args = check_job(cfg, world_size)
    return resolved_config(cfg, parallel_dims, model_args)


def build_model_parts(
    spec: ModelSpec,
    model_args: Any,
    parallel_dims: ParallelDims,
    cfg: JobConfig,
    device: torch.device,
    loss_fn: Callable[..., torch.Tensor],
) -> tuple[list[torch.nn.Module], PipelineRunner | None, int]:
    """Build on meta, parallelize (and split into pipeline stages), then materialize: no rank
    ever holds the full model. Returns (this rank's model parts, the pipeline runner or None,
    training FLOPs per token)."""
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    nparams, flops_per_token = spec.nparams_and_flops(model_args, model, cfg.training.seq_len)
    counts = getattr(model_args, "param_counts", None)
    activated = counts()[1] if counts is not None and getattr(model_args, "moe", None) else None
    # Multi-token prediction apart, as titan estimate prints it (the published counts omit it).
    mtp_counts = getattr(model_args, "mtp_param_counts", None)
    mtp, mtp_activated = mtp_counts() if mtp_counts is not None else (0, 0)
    described = f"{nparams - mtp:,} parameters"
    if activated is not None:
        described += f" ({activated - mtp_activated:,} activated)"
    if mtp:
        described += f" + multi-token prediction {mtp:,} ({mtp_activated:,} activated)"
    logger.info(
        "Model %s %s: %s, %.3e training FLOPs/token",
        cfg.model.name,
        cfg.model.flavor,
        described,
        flops_per_token,
    )
    pipeline, parts = None, [model]
    if parallel_dims.pp_enabled:
        pipeline, parts = spec.pipeline(
            model,
            parallel_dims,
            cfg,
            device,
            loss_fn,
            lambda part: spec.parallelize(part, parallel_dims, cfg),
        )
    else:
        spec.parallelize(model, parallel_dims, cfg)
    for part in parts:
        with simulation.materialize_context():  # fake tensors under COMM_MODE=fake_backend
            part.to_empty(device=device)
            with torch.no_grad():
                part.init_weights(buffer_device=None)
        part.train()
    return parts, pipeline, flops_per_token
