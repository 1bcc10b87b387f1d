"""Find a checkpoint and its job config, then build the model it holds (on meta, then load).

A checkpoint URL is a step directory (``<run>/checkpoint/step-N``, or ``seed``), or a checkpoint
folder (or a run folder holding ``checkpoint/``), which means its newest complete step. A
directory counts only with its commit marker.
The run root (``<run>``) holds the job's resolved ``config.toml`` and receives ``eval/``.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from titan_core import storage
from titan_core.build import build_model_args
from titan_core.checkpoint.dcp_io import dcp_reader
from titan_core.checkpoint.manager import (
    COMMIT_MARKER,
    SEED_DIR,
    check_healthy,
    checkpoint_model,
    complete_steps,
    data_file_damage,
    read_marker,
)
from titan_core.checkpoint.states import ModelState
from titan_core.config.job import (
    ActivationCheckpoint,
    Compile,
    FaultTolerance,
    JobConfig,
    Parallelism,
)
from titan_core.distributed.parallel_dims import ParallelDims
from titan_core.errors import CheckpointError, ConfigError
from titan_core.models import get_model_spec
from titan_core.resolve import parse_args

_STEP_DIR_RE = re.compile(rf"^(step-\d+|{SEED_DIR})$")


@dataclass(frozen=True)
class ResolvedCheckpoint:
    """A complete checkpoint directory, its step and the run root it belongs to."""

    step_dir: str
    step: int
    run_root: str
    model_only: bool


def _parent(path: str) -> str:
    # posixpath keeps a URL's scheme ("s3://b/run/checkpoint" -> "s3://b/run").
    return posixpath.dirname(path.rstrip("/"))


def resolve_checkpoint(url: str) -> ResolvedCheckpoint:
    """The complete step directory ``url`` names; CheckpointError when missing or incomplete."""
    path = url if storage.is_url(url) else url.removeprefix("file://")
    if not path or not storage.exists(path):
        raise CheckpointError(f"--checkpoint: not found: {url}")
    marker = read_marker(path)
    if marker is not None:
        check_healthy(path, marker, "--checkpoint")
        # A cut-short or missing model file is refused here, naming it (not mid-load).
        metadata = dcp_reader(path).read_metadata()
        if (why := data_file_damage(path, metadata, "model.")) is not None:
            raise CheckpointError(f"--checkpoint: {why}")
        return ResolvedCheckpoint(
            step_dir=path,
            step=int(marker["step"]),
            run_root=_parent(_parent(path)),
            model_only=bool(marker["model_only"]),
        )
    name = posixpath.basename(path.rstrip("/"))
    if storage.exists(storage.join(path, ".metadata")) or _STEP_DIR_RE.match(name):
        raise CheckpointError(
            f"--checkpoint: {url} is incomplete (no {COMMIT_MARKER} commit marker; "
            "the save was interrupted)"
        )
    steps = complete_steps(path)
    if not steps and complete_steps(storage.join(path, "checkpoint")):
        return resolve_checkpoint(storage.join(path, "checkpoint"))  # a run folder was given
    if not steps:
        raise CheckpointError(
            f"--checkpoint: {url} holds no complete step-N checkpoint "
            "(expected a step directory or a checkpoint folder)"
        )
    return resolve_checkpoint(storage.join(path, f"step-{steps[-1]}"))


def _has_option(argv: list[str], *names: str) -> bool:
    return any(a == n or a.startswith(n + "=") for a in argv for n in names)


def resolve_config(ckpt: ResolvedCheckpoint, config_argv: list[str]) -> JobConfig:
    """The job config: ``--module/--config`` or a config file when given, else the run's own
    ``config.toml``, else the defaults building the model the checkpoint's commit marker
    describes; overrides in ``config_argv`` apply on top either way."""
    argv = list(config_argv)
    if not _has_option(argv, "--module", "--job.config_file", "--job.config-file"):
        saved = storage.join(ckpt.run_root, "config.toml")
        if storage.exists(saved):
            argv = ["--job.config_file", saved, *argv]
        elif checkpoint_model(ckpt.step_dir) is not None:
            # model.name/flavor from the marker (resolve.model_from_initial_checkpoint)
            argv = ["--checkpoint.initial_load_path", ckpt.step_dir, *argv]
        else:
            raise ConfigError(
                f"--checkpoint: no config.toml in the run folder {ckpt.run_root} and the "
                "checkpoint describes no model; pass --module/--config or --config-file"
            )
    return parse_args(argv)


def eval_config(cfg: JobConfig) -> JobConfig:
    """``cfg`` for inference: no activation checkpointing or compile, FSDP-only parallelism."""
    # Training's TP/PP degrees describe the training world, not this one; eval shards over
    # whatever world it gets. Compile would recompile for every generation length.
    return dataclasses.replace(
        cfg,
        activation_checkpoint=ActivationCheckpoint(mode="none"),
        compile=Compile(enable=False),
        parallelism=Parallelism(),
        fault_tolerance=FaultTolerance(),  # one process (or world), no replica groups
    )


def build_model(
    cfg: JobConfig, vocab_size: int, device: torch.device, world_size: int
) -> tuple[nn.Module, Any]:
    """The configured model, FSDP-sharded over the world when it has several ranks.

    Built on meta and materialized after sharding, so no rank holds the full model.
    """
    cfg = eval_config(cfg)
    args = build_model_args(cfg, vocab_size)
    spec = get_model_spec(cfg.model.name)
    with torch.device("meta"):
        model = spec.model_cls(args)
    if world_size > 1:
        dims = ParallelDims.from_config(cfg.parallelism, world_size)
        dims.build_mesh(device.type)
        spec.parallelize(model, dims, cfg)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # also computes the RoPE table the checkpoint lacks
    model.eval()
    return model, args


def check_fits(model: nn.Module, step_dir: str, flavor: str) -> None:
    """CheckpointError unless the checkpoint holds exactly the model's tensors, same shapes.

    DCP loads only the keys asked for, so a deeper checkpoint would otherwise load silently.
    """
    meta = dcp_reader(step_dir).read_metadata().state_dict_metadata
    saved = {k.removeprefix("model."): m for k, m in meta.items() if k.startswith("model.")}
    expected = ModelState(model).state_dict()  # DTensors report their global shape
    where = f"--checkpoint: {step_dir}"
    if not saved:
        raise CheckpointError(f"{where} holds no model weights")
    for key, tensor in expected.items():
        size = getattr(saved.get(key), "size", None)
        if size is not None and tuple(size) != tuple(tensor.shape):
            raise CheckpointError(
                f"{where} does not fit model.flavor {flavor!r}: {key} is {tuple(size)} "
                f"in the checkpoint, {tuple(tensor.shape)} in the model"
            )
    missing = sorted(set(expected) - set(saved))
    extra = sorted(set(saved) - set(expected))
    if missing or extra:
        first = f"lacks {missing[0]}" if missing else f"has the extra tensor {extra[0]}"
        raise CheckpointError(
            f"{where} does not fit model.flavor {flavor!r}: it {first} "
            f"({len(missing)} missing, {len(extra)} unexpected tensors)"
        )


def load_weights(model: nn.Module, step_dir: str, flavor: str) -> None:
    """Check that the checkpoint fits, then load its model part (resharded to this world)."""
    check_fits(model, step_dir, flavor)
    try:
        with warnings.catch_warnings():
            # DCP warns on every single-process load, which is this tool's normal case.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                {"model": ModelState(model)},
                storage_reader=dcp_reader(step_dir),
                no_dist=not dist.is_initialized(),
            )
    except dcp.CheckpointException as e:  # a BaseException: `except Exception` misses it
        lines = [line for line in str(e).splitlines() if line.strip()]
        reason = lines[-1].strip() if lines else type(e).__name__  # the root cause comes last
        raise CheckpointError(
            f"--checkpoint: cannot load the model from {step_dir}: {reason}"
        ) from e
