"""The config a flow runs with: the user's layers resolved, then placed into a run root."""

from __future__ import annotations

import dataclasses

from tasks.storage import RunPaths, absolute
from titan_core.config.job import JobConfig


def resolve_job(
    module: str = "",
    config: str = "",
    config_file: str = "",
    overrides: list[str] | None = None,
    storage: str = "",
    tracking_uri: str = "",
) -> JobConfig:
    """Resolve registry function < TOML file < overrides, then ``--storage``/``--tracking-uri``.

    A one-line ``ConfigError`` names the bad key, before anything runs.
    """
    from titan_core.config.manager import parse_args

    argv: list[str] = []
    if module or config:
        argv += ["--module", module, "--config", config]
    if config_file:
        argv += ["--job.config_file", config_file]
    argv += list(overrides or [])
    if storage:
        argv += ["--storage.root", storage]
    if tracking_uri:
        argv += ["--tracking.uri", tracking_uri]
    return parse_args(argv)


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
