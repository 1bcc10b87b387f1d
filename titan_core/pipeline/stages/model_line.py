"""A model line: every run of one experiment under ``<job.dump_folder>/<experiment>/`` (fault drills
aside), the newest complete checkpoint among them (what ``retrain`` and ``make demo`` continue
from), and the policy of continuing it: the config of the next run (``continued_config``,
``reresolve_autos``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from titan_core import storage
from titan_core.checkpoint.manager import complete_steps, is_unhealthy, read_marker
from titan_core.config.job import JobConfig
from titan_core.pipeline.run.transfer import refresh


@dataclass(frozen=True)
class CheckpointInfo:
    """One complete checkpoint of a run in a model line."""

    step_dir: str
    """The checkpoint's folder, ``<run>/checkpoint/step-N``."""
    run_root: str
    """The run it belongs to."""
    step: int
    """The training step it was saved at."""
    model_only: bool
    """Weights only (an export-style checkpoint): no optimizer or data position to resume."""
    time: float
    """When it was committed (seconds since the epoch, from its commit marker)."""
    config_url: str
    """The run's stored ``config.toml``."""


def complete_checkpoints(run_root: str) -> list[CheckpointInfo]:
    """The complete checkpoints of one run, by step."""
    folder = storage.join(run_root, "checkpoint")
    found = []
    for step in complete_steps(folder):
        step_dir = storage.join(folder, f"step-{step}")
        marker = read_marker(step_dir) or {}
        if is_unhealthy(marker):  # a line never continues from non-finite weights
            continue
        found.append(
            CheckpointInfo(
                step_dir=step_dir,
                run_root=run_root,
                step=step,
                model_only=bool(marker.get("model_only", False)),
                time=float(marker.get("time", 0.0)),
                config_url=storage.join(run_root, "config.toml"),
            )
        )
    return found


def is_drill(run_root: str) -> bool:
    """Whether the run was a fault drill (``debug.drill`` in its ``config.toml``)."""
    import tomllib

    config = storage.join(run_root, "config.toml")
    if not storage.exists(config):
        return False
    return bool(tomllib.loads(storage.read_text(config)).get("debug", {}).get("drill", False))


def latest_checkpoint(root: str, experiment: str) -> CheckpointInfo | None:
    """The newest complete checkpoint of any run under ``<root>/<experiment>/`` (by commit
    time, then step), or None. Fault drills are not part of the line: a rehearsal's weights
    are never continued."""
    line = storage.join(root, experiment)
    refresh(line)
    runs = [storage.join(line, run) for run in storage.list_dirs(line)]
    candidates = [c for run in runs if not is_drill(run) for c in complete_checkpoints(run)]
    return max(candidates, key=lambda c: (c.time, c.step)) if candidates else None


def continued_config(
    cfg: JobConfig,
    latest: CheckpointInfo,
    previous: JobConfig,
    steps: int,
    *,
    new_data: bool = False,
) -> JobConfig:
    """``cfg`` loading ``latest`` and training ``steps`` steps past it (``new_data``: the same
    prepared dataset grew since, so training continues on all of it)."""
    model_only = latest.model_only
    excluded = list(cfg.checkpoint.exclude_from_loading)
    changed = new_data or cfg.dataloader.dataset != previous.dataloader.dataset
    if changed and "dataloader" not in excluded:
        excluded.append("dataloader")  # new data: its position in the old data means nothing
    return dataclasses.replace(
        cfg,
        training=dataclasses.replace(
            cfg.training, steps=(0 if model_only else latest.step) + steps
        ),
        checkpoint=dataclasses.replace(
            cfg.checkpoint,
            initial_load_path=latest.step_dir,
            initial_load_model_only=model_only,
            exclude_from_loading=excluded,
        ),
    )


# Auto values the previous run's saved config holds as it resolved them, and what each follows:
# a new run re-resolves one when what it follows may change (and it is not given itself).
REFOLLOWED = {
    "parallelism.data_parallel_shard_degree": None,  # the world size: launch.* may change
    "model.max_seq_len": "training.seq_len",
    "validation.local_batch_size": "training.local_batch_size",
}


def reresolve_autos(cfg: JobConfig, values: dict[str, Any]) -> JobConfig:
    """``cfg`` (a saved config plus ``values``) with the auto values of ``REFOLLOWED`` set back
    to -1 where the new run may change what they follow, unless ``values`` sets them."""
    reset: dict[str, dict[str, Any]] = {}
    for key, follows in REFOLLOWED.items():
        if key not in values and (follows is None or follows in values):
            section, name = key.split(".")
            reset.setdefault(section, {})[name] = -1
    sections = {s: dataclasses.replace(getattr(cfg, s), **kw) for s, kw in reset.items()}
    return dataclasses.replace(cfg, **sections)
