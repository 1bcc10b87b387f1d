"""The ``compare`` flow: MLflow runs of one experiment side by side (``titan compare`` runs it).

The comparison (final loss, eval perplexity, tokens/s, MFU, differing config keys) and the
loss-curve plot are logged to a ``compare-*`` MLflow run of the same experiment and shown as
table, markdown and image artifacts of the flow run.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks.compare import compare_runs


@flow(name="compare", log_prints=True)
def compare(
    experiment: str, runs: list[str] | None = None, tracking_uri: str = "", max_runs: int = 10
) -> dict[str, Any]:
    """Compare runs of ``experiment`` (chosen ids/names, else the newest ``max_runs``)."""
    return compare_runs(experiment, runs, tracking_uri, max_runs)
