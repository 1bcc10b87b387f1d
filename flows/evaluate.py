"""``evaluate``: held-out metrics and samples of a checkpoint, as a flow of its own."""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks import evaluate as eval_tasks
from titan_core.pipeline.run.paths import absolute
from titan_core.pipeline.stages.evaluation import Evaluation


@flow(name="evaluate")
def evaluate(
    checkpoint: str,
    config_file: str = "",
    output: str = "",
    overrides: dict[str, Any] | None = None,
) -> Evaluation:
    """Evaluate ``checkpoint`` (step dir, checkpoint folder or run folder) as the job config's
    ``[evaluate]`` section says and write its report to ``<output or run>/eval/``; the config
    defaults to the run's ``config.toml``, ``overrides`` (dotted keys, e.g.
    ``{"evaluate.batches": 2}``) apply on top. Returns the metrics, the evaluated step and
    checkpoint, and the report's URL."""
    from titan_core.resolve import resolve_job

    job = resolve_job("", config_file) if config_file else None  # None: the run's config.toml
    return eval_tasks.evaluate(
        checkpoint, job, output=absolute(output) if output else "", overrides=overrides
    )
