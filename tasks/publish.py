"""``publish``: register the Hugging Face export in MLflow and summarise the run in Prefect
(``titan_core.pipeline.stages.publish`` does the work; this task adds the Prefect artifacts)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.common import retry_transient
from tasks.runtime import run_logger
from titan_core.pipeline.run.common import redact
from titan_core.pipeline.run.tracking import TrackingContext, run_page_markdown
from titan_core.pipeline.stages.evaluation import Evaluation
from titan_core.pipeline.stages.publish import (
    Publication,
    locations,
    metric_rows,
    publish_run,
    summary_markdown,
)


@task(name="publish", cache_policy=NO_CACHE, retries=2, retry_condition_fn=retry_transient)
def publish(
    run_root: str,
    checkpoint_url: str,
    hf_url: str,
    evaluation: Evaluation,
    tracking: TrackingContext | None = None,
    registered_model: str = "",
    drill: bool = False,
    champion_metric: str = "eval/loss",
) -> Publication:
    """Register ``hf_url`` as a model version, move ``champion`` if its ``champion_metric``
    improved (never for a ``drill``), summarise the run as Prefect artifacts (summary with the
    step guard's incidents, metrics table, where the run root and export are)."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact
    from prefect.runtime import flow_run  # the recipe is the flow's parameter (retrain: none)

    recipe = str((flow_run.parameters or {}).get("recipe") or "")
    pub = publish_run(
        run_root,
        checkpoint_url,
        hf_url,
        evaluation,
        tracking,
        registered_model,
        recipe,
        drill,
        champion_metric=champion_metric,
    )
    create_markdown_artifact(
        summary_markdown(pub), key="run-summary", description="Pipeline run summary"
    )
    create_table_artifact(
        metric_rows(pub), key="run-metrics", description="Final training and evaluation metrics"
    )
    for key, (markdown, description) in locations(pub).items():
        create_markdown_artifact(markdown, key=key, description=description)
    if tracking is not None:  # the flow run's way to its MLflow run
        create_markdown_artifact(
            run_page_markdown(tracking), key="mlflow-run", description="The run in MLflow"
        )
    outcome = " (new champion)" if pub.champion else " (champion unchanged)"
    registered = f"model {pub.model_name} v{pub.model_version}{outcome}"
    if drill:
        registered = "a drill, not registered"
    run_logger().info(
        "Published %s: %s%s",
        redact(hf_url),
        registered if tracking is not None or drill else "untracked",
        f"; training health: {pub.health_summary}" if pub.health_summary else "",
    )
    return pub
