"""The config a flow runs with, placed into its run root (``titan_core.config.resolve`` resolves
the user's layers)."""

from __future__ import annotations

import dataclasses

from titan_core.config.job import JobConfig
from titan_core.pipeline.storage import RunPaths


def run_config(cfg: JobConfig, paths: RunPaths, tokenizer_url: str) -> JobConfig:
    """``cfg`` as the run trains it: ``job.dump_folder`` the run root (what its ranks write,
    config.toml saves and MLflow shows; ``titan train --job.config_file <run>/config.toml``
    resumes the run in place), its stored tokenizer, checkpoints on, the run layout. What runs
    share (data, MLflow store, caches) is derived from ``paths.root``, never from this config."""
    return dataclasses.replace(
        cfg,
        job=dataclasses.replace(cfg.job, dump_folder=paths.run_root, config_file=""),
        tokenizer=dataclasses.replace(cfg.tokenizer, path=tokenizer_url),
        checkpoint=dataclasses.replace(
            cfg.checkpoint, enable=True, folder="checkpoint", create_seed_checkpoint=False
        ),
        profiling=dataclasses.replace(
            cfg.profiling,
            save_traces_folder="profile",
            save_memory_snapshot_folder="memory_snapshot",
        ),
    )
