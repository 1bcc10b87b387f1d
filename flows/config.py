"""The config a flow runs with, placed into its run root (``titan_core.config.resolve`` resolves
the user's layers)."""

from __future__ import annotations

import dataclasses

from titan_core.config.job import JobConfig
from titan_core.pipeline.storage import RunPaths, absolute


def run_config(cfg: JobConfig, paths: RunPaths, tokenizer_url: str) -> JobConfig:
    """``cfg`` as the run trains it: its run root, stored tokenizer, checkpoints on, run layout."""
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
        storage=dataclasses.replace(cfg.storage, root=absolute(cfg.storage.root)),
    )
