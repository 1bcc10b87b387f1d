"""Tasks of the ``sweep`` flow: its MLflow parent run, and the comparison of its trials as MLflow
and Prefect artifacts (``titan_core.pipeline.sweep.tracking`` does the MLflow work)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.common import retry_transient
from tasks.runtime import run_logger
from titan_core.config.job import JobConfig
from titan_core.pipeline.run.common import redact
from titan_core.pipeline.run.tracking import TrackingContext
from titan_core.pipeline.sweep.plan import SweepPlan, TrialOutcome
from titan_core.pipeline.sweep.report import SweepResult
from titan_core.pipeline.sweep.tracking import record_comparison, start_sweep_run


@task(name="start_sweep_tracking", cache_policy=NO_CACHE)
def start_sweep_tracking(cfg: JobConfig, plan: SweepPlan) -> TrackingContext:
    """Create the experiment (if new) and the sweep's parent run, its definition as params."""
    from prefect.runtime import flow_run

    tracking = start_sweep_run(cfg, plan, str(flow_run.id or ""))
    run_logger().info(
        "MLflow: sweep run %s in experiment %r at %s",
        tracking.parent_run_id,
        plan.experiment,
        redact(tracking.uri),
    )
    return tracking


@task(name="compare_trials", cache_policy=NO_CACHE, retries=2, retry_condition_fn=retry_transient)
def compare_trials(
    tracking: TrackingContext, plan: SweepPlan, outcomes: list[TrialOutcome]
) -> SweepResult:
    """Compare the trials in MLflow and Prefect, alias the best; returns the sweep's result."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    result = record_comparison(tracking, plan, outcomes)
    create_table_artifact(
        [t.as_dict(plan.metric) for t in result.trials],
        key="sweep-trials",
        description=f"Trials of sweep {plan.sweep_id}",
    )
    create_markdown_artifact(
        result.markdown, key="sweep-comparison", description=f"Comparison of sweep {plan.sweep_id}"
    )
    return result
