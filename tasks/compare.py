"""``compare_runs``: an experiment's MLflow runs side by side, as Prefect artifacts
(``titan_core.pipeline.compare`` reads and plots them)."""

from __future__ import annotations

from prefect import task

from tasks.common import retry_transient
from titan_core.pipeline.compare import Comparison, compare_experiment


@task(
    retries=2,
    retry_delay_seconds=[2, 10],
    retry_condition_fn=retry_transient,
    task_run_name="compare-{experiment}",
)
def compare_runs(
    experiment: str,
    run_ids: list[str] | None,
    tracking_uri: str,
    max_runs: int = 10,
    log: bool = False,
    parent_run_id: str = "",
) -> Comparison:
    """Compare an experiment's runs (``compare_experiment``) and show the result as Prefect
    table and markdown artifacts (the loss curves embedded in the markdown)."""
    from prefect.artifacts import (
        create_image_artifact,
        create_markdown_artifact,
        create_table_artifact,
    )

    result = compare_experiment(
        experiment, run_ids, tracking_uri, max_runs, log=log, parent_run_id=parent_run_id
    )
    key = "compare-" + "".join(c if c.isalnum() else "-" for c in experiment.lower())
    create_table_artifact(
        key=f"{key}-table", table=result.runs, description=f"Runs of {experiment}"
    )
    create_markdown_artifact(key=key, markdown=result.markdown, description="Run comparison")
    if result.plot_uri.startswith(("http://", "https://")):  # a link a browser can open
        create_image_artifact(
            key=f"{key}-loss", image_url=result.plot_uri, description="Loss curves (MLflow)"
        )
    return result
