"""Preflight: everything that can reject a run, checked before any process is launched.

The resolved config is validated (types, ranges, degrees against the world size, the launcher's
own constraints), a fake-backend dry run builds, parallelizes and steps the model for the target
world size in this process (``comm.mode=fake_backend``), and the estimated per-rank peak is held
against ``launch.device_memory_gib`` (or the GPU's capacity). Only then is the run's
``config.toml`` written. The pipeline's ``preflight`` task (``tasks/preflight.py``) runs
``run_preflight``; so can any launcher.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from titan_core import storage
from titan_core.config.job import JobConfig
from titan_core.errors import ConfigError
from titan_core.pipeline.run.common import Logger, titan_logger

_GIB = 2**30


@dataclass(frozen=True)
class Preflight:
    """What preflight found out about a run at its world size."""

    config_url: str
    """The stored config, auto values resolved: the one the ranks load."""
    world_size: int
    """Ranks the run launches (``launch.nnodes * launch.nproc_per_node``)."""
    num_params: int
    """Parameters of the model."""
    vocab_size: int
    """The model's vocabulary size (resolved from the tokenizer)."""
    peak_memory_gib: float
    """Estimated peak memory per rank, GiB."""
    flops_per_step: int
    """Estimated training FLOPs of one step on one rank."""
    model_args: dict[str, Any]
    """The model's arguments as plain data: what the seed checkpoint's weights depend on."""
    config: JobConfig = field(repr=False, compare=False)
    """The config the ranks run, auto values resolved (stored at ``config_url``): the later
    stages take it from here instead of reading ``config_url`` back."""

    def summary(self) -> dict[str, Any]:
        """What preflight found, as plain data (the config aside: it is at ``config_url``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.repr}


def device_memory_bytes(cfg: JobConfig) -> int:
    """The per-device budget: ``launch.device_memory_gib``, else the GPU's, else 0 (no check)."""
    if cfg.launch.device_memory_gib > 0:
        return int(cfg.launch.device_memory_gib * _GIB)
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return 0


def dry_run(cfg: JobConfig, world_size: int, logger: Logger | None = None) -> Any:
    """A fake-backend dry run at ``world_size`` in this process: the model built and
    parallelized on fake process groups, one training step on fake tensors (a real data batch
    included), reported to ``logger``; returns the memory/FLOPs estimate of that layout."""
    from titan_core.comm_mode import dry_run as fake_backend_dry_run
    from titan_core.estimate import estimate

    what = ""
    if cfg.fault_tolerance.enable:  # each replica group is a job of its own: run one
        groups = cfg.parallelism.data_parallel_replicate_degree
        cfg = dataclasses.replace(
            cfg,
            parallelism=dataclasses.replace(cfg.parallelism, data_parallel_replicate_degree=1),
            fault_tolerance=dataclasses.replace(cfg.fault_tolerance, enable=False, semi_sync="off"),
        )
        world_size //= groups
        what = f" (one of {groups} replica groups)"
    fake = dataclasses.replace(
        cfg, comm=dataclasses.replace(cfg.comm, mode="fake_backend", fake_world_size=world_size)
    )
    report = fake_backend_dry_run(fake)
    (logger or titan_logger()).info(
        "Fake-backend dry run at world size %d%s: one step in %.2fs, rank 0 holds %s parameters",
        world_size,
        what,
        report.step_seconds,
        f"{report.step.num_params:,}",
    )
    return report.estimate if report.estimate is not None else estimate(cfg, world_size)


def check_memory(cfg: JobConfig, est: Any) -> None:
    """``ConfigError`` when the estimated per-rank peak exceeds the device budget."""
    from titan_core.estimate import fits

    budget = device_memory_bytes(cfg)
    if budget and not fits(est.memory, budget):
        raise ConfigError(
            f"launch.device_memory_gib: the estimated peak of {_size(est.memory.peak)} per rank "
            f"does not fit in {_size(budget)}; lower training.local_batch_size, enable "
            "activation_checkpoint.mode or use more ranks"
        )


def _size(num_bytes: float) -> str:
    """Bytes for people: GiB from 1 GiB on, MiB below (0.02 GiB hides what differs)."""
    if num_bytes >= _GIB:
        return f"{num_bytes / _GIB:.2f} GiB"
    return f"{num_bytes / 2**20:.1f} MiB"


def preflight_checks(parsed: JobConfig, logger: Logger | None = None) -> tuple[JobConfig, Any]:
    """Every check preflight makes on a parsed config, before anything is launched or written:
    the launcher's settings and tools, the config at its world size, a fake-backend dry run and
    the memory budget (the dry run reported to ``logger``). Returns the config with its auto
    values resolved (``titan_core.build.resolve_auto``, what the ranks will run) and the
    estimate. ``titan launch`` runs these too."""
    from titan_core.build import resolve_auto
    from titan_core.launch import job_launcher

    world_size = parsed.launch.nnodes * parsed.launch.nproc_per_node
    job_launcher(parsed).probe()  # backend settings, and its tools on this machine
    cfg = resolve_auto(parsed, world_size)  # what the ranks will run: no "auto" -1 left
    est = dry_run(cfg, world_size, logger)
    check_memory(cfg, est)
    return cfg, est


def run_preflight(job: JobConfig, config_url: str, logger: Logger | None = None) -> Preflight:
    """Validate the run's config at its world size (every field and section again, then
    ``preflight_checks``, reporting to ``logger``), then store it at ``config_url`` with its
    auto values resolved: the config the ranks load, returned as ``Preflight.config``."""
    from titan_core.config.schema import to_toml, validate

    validate(job)  # the run's settings were set with dataclasses.replace: check them all
    parsed = job
    world_size = parsed.launch.nnodes * parsed.launch.nproc_per_node
    cfg, est = preflight_checks(parsed, logger)
    if cfg.dataloader.dataset == "titan_corpus":
        from titan_core.data import ensure_assets

        ensure_assets()  # the bundled corpus, on a fresh machine too (seconds, then cached)
    storage.write_text(config_url, to_toml(cfg))
    return Preflight(
        config_url=config_url,
        world_size=world_size,
        num_params=est.layout.num_params,
        vocab_size=est.layout.model_args.vocab_size,
        peak_memory_gib=est.memory.peak / _GIB,
        flops_per_step=est.flops.total_flops,
        model_args=dataclasses.asdict(est.layout.model_args),
        config=cfg,
    )
