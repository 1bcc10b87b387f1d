"""The ``compare`` flow: MLflow runs of one experiment side by side (``titan compare`` runs it).

The comparison (final loss, eval perplexity, tokens/s, MFU, differing config keys, the loss curves
embedded) is shown as table and markdown artifacts of the flow run. It is logged to MLflow only
when asked: ``log`` records a ``compare-*`` run in the experiment, ``parent_run_id`` nests that
run under another (e.g. a sweep's), so comparing does not clutter the experiment by default.
"""

from __future__ import annotations

from prefect import flow

from tasks.compare import compare_runs
from titan_core.pipeline.compare import Comparison


@flow(name="compare", log_prints=True)
def compare(
    experiment: str,
    runs: list[str] | None = None,
    tracking_uri: str = "",
    max_runs: int = 10,
    log: bool = False,
    parent_run_id: str = "",
) -> Comparison:
    """Compare runs of ``experiment`` (chosen ids/names, else the newest ``max_runs``).

    Args:
        experiment: MLflow experiment (the config's job.experiment).
        runs: Run ids or run names to compare, in this order; empty: the newest top-level runs.
        tracking_uri: MLflow tracking URI; empty: MLFLOW_TRACKING_URI, else ./outputs/mlflow.db.
        max_runs: How many of the newest runs when no runs are named.
        log: Also record the comparison as an MLflow run of the experiment (tag
            titan.stage=compare).
        parent_run_id: Record it nested under this MLflow run instead (implies log).
    """
    return compare_runs(experiment, runs, tracking_uri, max_runs, log, parent_run_id)
