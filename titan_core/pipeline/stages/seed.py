"""The seed checkpoint: the initial weights every run of a model config starts from.

Written once per (model shape, vocabulary, seed, export dtype, output root) with every
parallel degree at 1, so that runs with any layout start from identical weights; later runs with
the same identity get the cached URL and load it through ``checkpoint.initial_load_path``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from titan_core import storage
from titan_core.checkpoint.manager import read_marker
from titan_core.config.job import (
    ActivationCheckpoint,
    Compile,
    FaultTolerance,
    JobConfig,
    Parallelism,
)
from titan_core.pipeline.run.paths import SEED_DIR, storage_identity
from titan_core.pipeline.run.transfer import refresh


def seed_identity(cfg: JobConfig, model_args: dict[str, Any], root: str) -> dict[str, Any]:
    """What the seed's weights depend on: model shape (vocabulary included), seed, dtype, and
    where: the output ``root`` its runs share (not ``cfg``'s dump_folder, a run's own folder)."""
    return {
        "model": cfg.model.name,
        "model_args": model_args,
        "seed": cfg.debug.seed,
        "export_dtype": cfg.checkpoint.export_dtype,
        "storage": storage_identity(root),
    }


def seed_cache_key(identity: dict[str, Any]) -> str:
    """The cache key of a seed checkpoint: a hash of its ``seed_identity``."""
    blob = json.dumps(identity, sort_keys=True, default=str)
    return "seed-" + hashlib.sha256(blob.encode()).hexdigest()[:32]


def seed_config(cfg: JobConfig) -> JobConfig:
    """``cfg`` for writing the seed: one process, no compile/AC/validation, seed mode on."""
    return dataclasses.replace(
        cfg,
        checkpoint=dataclasses.replace(cfg.checkpoint, enable=True, create_seed_checkpoint=True),
        parallelism=Parallelism(),
        fault_tolerance=FaultTolerance(),  # one process (or world), no replica groups
        compile=Compile(enable=False),
        activation_checkpoint=ActivationCheckpoint(mode="none"),
        validation=dataclasses.replace(cfg.validation, enable=False),
    )


def write_seed_checkpoint(job: JobConfig) -> str:
    """Write ``<run>/checkpoint/seed`` for the run's config (one process); its URL."""
    from titan_core.train import run

    cfg = seed_config(job)
    seed_url = storage.join(cfg.job.dump_folder, SEED_DIR)
    run(cfg)
    refresh(seed_url)
    if read_marker(seed_url) is None:  # the manager commits only after a complete save
        raise RuntimeError(f"seed checkpoint {seed_url} has no commit marker after saving")
    return seed_url


def is_complete(url: str) -> bool:
    """Whether ``url`` is a committed checkpoint (a cached URL may have been deleted since)."""
    try:
        refresh(url)
        return read_marker(url) is not None
    except OSError:
        return False
