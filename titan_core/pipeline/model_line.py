"""A model line: every run of one experiment under ``<storage.root>/<experiment>/``, and the
newest complete checkpoint among them (what ``retrain`` and ``make demo`` continue from)."""

from __future__ import annotations

from dataclasses import dataclass

from titan_core import storage
from titan_core.checkpoint.manager import complete_steps, read_marker
from titan_core.pipeline.storage import refresh


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


def latest_checkpoint(root: str, experiment: str) -> CheckpointInfo | None:
    """The newest complete checkpoint of any run under ``<root>/<experiment>/`` (by commit
    time, then step), or None."""
    line = storage.join(root, experiment)
    refresh(line)
    candidates = [
        c for run in storage.list_dirs(line) for c in complete_checkpoints(storage.join(line, run))
    ]
    return max(candidates, key=lambda c: (c.time, c.step)) if candidates else None
