"""The config a run trains with: the default recipe, the user's config placed into its run root
(``titan_core.resolve`` resolves the user's layers), and the tags a run of it carries."""

from __future__ import annotations

import dataclasses

from titan_core.config.job import JobConfig
from titan_core.pipeline.run.paths import RunPaths

DEFAULT_RECIPE = "llama3_debugmodel"
"""The recipe of the pipeline flows and ``titan pipeline run`` when none is given."""


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


def flow_run_tags(cfg: JobConfig, recipe: str = "") -> list[str]:
    """The tags of a flow run of ``cfg``, to filter by in the Prefect UI: experiment, recipe
    (when there is one), model, and ``drill`` for a fault drill (``debug.drill``)."""
    tags = [f"experiment:{cfg.job.experiment}"]
    if recipe:
        tags.append(f"recipe:{recipe}")
    return [*tags, f"model:{cfg.model.name}/{cfg.model.flavor}"] + (
        ["drill"] if cfg.debug.drill else []
    )
