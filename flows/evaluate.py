"""``evaluate``: held-out metrics and samples of a checkpoint, as a flow of its own."""

from __future__ import annotations

from prefect import flow

from tasks import evaluate as eval_tasks
from titan_core.pipeline.evaluation import Evaluation
from titan_core.pipeline.storage import absolute


@flow(name="evaluate")
def evaluate(
    checkpoint: str, config_file: str = "", output: str = "", max_batches: int = 0
) -> Evaluation:
    """Evaluate ``checkpoint`` (step dir, checkpoint folder or run folder) and write its report
    to ``<output or run>/eval/``; the job config defaults to the run's ``config.toml``.
    Returns the metrics, the evaluated step and checkpoint, and the report's URL."""
    return eval_tasks.evaluate(
        checkpoint, config_file, output=absolute(output) if output else "", max_batches=max_batches
    )
