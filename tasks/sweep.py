"""Tasks of the ``sweep`` flow: its MLflow parent run, and the comparison of its trials.

The trials' pipeline runs nest under the sweep's run (``mlflow.parentRunId``); the comparison
reads them back with ``tasks.compare``'s readers, decides with ``titan_core.pipeline.sweep`` and
logs ``comparison.md`` (images embedded), ``comparison.json`` and the PNGs to the sweep's run and
as Prefect artifacts. The best trial's registered model version gets the ``sweep-best`` alias.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.common import redact, retry_transient, run_logger
from tasks.compare import PLOT_NAME, plot_loss_curves, summarize_run
from tasks.tracking import (
    STAGE_TAG,
    TrackingContext,
    _artifact_location,
    check_tracking,
    client,
    ensure_experiment,
    log_params,
    resolve_tracking_uri,
)
from titan_core.config.job import JobConfig
from titan_core.pipeline.report import markdown_image
from titan_core.pipeline.sweep import BEST_ALIAS, SweepPlan, TrialOutcome
from titan_core.pipeline.sweep_report import (
    SweepResult,
    TrialRow,
    best_trial,
    plot_metric_by_key,
    render_markdown,
)

SWEEP_STAGE = "sweep"
SWEEP_TAG = "titan.sweep_id"


@task(name="start_sweep_tracking", cache_policy=NO_CACHE)
def start_sweep_tracking(cfg: JobConfig, plan: SweepPlan) -> TrackingContext:
    """Create the experiment (if new) and the sweep's parent run, its definition as params."""
    from prefect.runtime import flow_run

    uri = resolve_tracking_uri(cfg)
    check_tracking(uri)
    mlflow_client = client(uri)
    experiment_id = ensure_experiment(mlflow_client, plan.experiment, _artifact_location(cfg, uri))
    tags = {STAGE_TAG: SWEEP_STAGE, SWEEP_TAG: plan.sweep_id}
    tags["prefect.flow_run_id"] = str(flow_run.id or "")
    run = mlflow_client.create_run(experiment_id, run_name=f"sweep-{plan.sweep_id}", tags=tags)
    log_params(mlflow_client, run.info.run_id, plan.definition())
    run_logger().info(
        "MLflow: sweep run %s in experiment %r at %s", run.info.run_id, plan.experiment, redact(uri)
    )
    return TrackingContext(uri, plan.experiment, experiment_id, run.info.run_id)


def _find_trial_run(mlflow_client: Any, tracking: TrackingContext, run_id: str) -> Any | None:
    """The pipeline MLflow run of a trial (by its ``titan.run_id`` tag), if it got one."""
    runs = mlflow_client.search_runs(
        [tracking.experiment_id],
        filter_string=f"tags.`titan.run_id` = '{run_id}' and tags.`{STAGE_TAG}` = 'pipeline'",
        max_results=1,
    )
    return runs[0] if runs else None


def _model_version(mlflow_client: Any, model_name: str, mlflow_run_id: str) -> str:
    """The version of ``model_name`` registered from ``mlflow_run_id``, or ""."""
    found = mlflow_client.search_model_versions(
        f"name = '{model_name}' and run_id = '{mlflow_run_id}'"
    )
    return str(found[0].version) if found else ""


def trial_rows(
    tracking: TrackingContext, plan: SweepPlan, outcomes: list[TrialOutcome]
) -> tuple[list[TrialRow], list[Any]]:
    """Each trial's row (status and error from ``outcomes``, numbers from MLflow) and the
    ``RunSummary`` of those with a run (their loss curves, labelled by trial)."""
    mlflow_client = client(tracking.uri)
    by_index = {o.index: o for o in outcomes}
    rows, summaries = [], []
    for trial in plan.trials:
        outcome = by_index[trial.index]
        name = trial.label(plan.keys)
        row = TrialRow(
            trial.index, name, outcome.run_id, outcome.status, trial.values, error=outcome.error
        )
        run = _find_trial_run(mlflow_client, tracking, outcome.run_id)
        if run is not None:
            summary = dataclasses.replace(summarize_run(mlflow_client, run), name=name)
            summaries.append(summary)
            metric = run.data.metrics.get(plan.metric)
            row = dataclasses.replace(
                row,
                final_loss=summary.final_loss,
                steps=summary.steps,
                metric=metric if outcome.status == "completed" else None,
                mlflow_run_id=run.info.run_id,
                model_version=_model_version(mlflow_client, plan.model_name, run.info.run_id),
            )
            mlflow_client.set_tag(run.info.run_id, SWEEP_TAG, plan.sweep_id)
            mlflow_client.set_tag(run.info.run_id, "titan.trial", name)
        rows.append(row)
    return rows, summaries


def _slug(key: str) -> str:
    """A file-name-safe form of a metric or config key."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key)


def _write_report(
    folder: str, plan: SweepPlan, rows: list[TrialRow], summaries: list[Any]
) -> tuple[str, dict[str, Any]]:
    """Write the PNGs, ``comparison.md`` and ``comparison.json`` into ``folder``; returns the
    markdown and the JSON document."""
    best = best_trial(rows)
    curves = plot_loss_curves(
        summaries, os.path.join(folder, PLOT_NAME), f"sweep {plan.sweep_id}: training loss"
    )
    images = [markdown_image("training loss of every trial", curves)]
    for key in plan.keys:
        png = os.path.join(folder, f"{_slug(plan.metric)}_by_{_slug(key)}.png")
        images.append(
            markdown_image(
                f"{plan.metric} by {key}", plot_metric_by_key(rows, key, plan.metric, png)
            )
        )
    markdown = render_markdown(plan.sweep_id, rows, plan.keys, plan.metric, best, images)
    document = {
        "sweep_id": plan.sweep_id,
        "experiment": plan.experiment,
        "metric": plan.metric,
        "keys": list(plan.keys),
        "best": best.index if best else None,
        "model_name": plan.model_name,
        "trials": [r.as_dict(plan.metric) for r in rows],
    }
    with open(os.path.join(folder, "comparison.md"), "w") as f:
        f.write(markdown)
    with open(os.path.join(folder, "comparison.json"), "w") as f:
        json.dump(document, f, indent=2)
    return markdown, document


def alias_best(tracking: TrackingContext, plan: SweepPlan, best: TrialRow | None) -> str:
    """Point ``sweep-best`` at the best trial's model version (tagged with the sweep id and its
    metric); returns the alias, or "" when no trial registered a version."""
    if best is None or not best.model_version:
        return ""
    mlflow_client = client(tracking.uri)
    mlflow_client.set_registered_model_alias(plan.model_name, BEST_ALIAS, best.model_version)
    mlflow_client.set_model_version_tag(
        plan.model_name, best.model_version, SWEEP_TAG, plan.sweep_id
    )
    mlflow_client.set_model_version_tag(
        plan.model_name, best.model_version, "sweep_metric", f"{plan.metric}={best.metric:.4f}"
    )
    return BEST_ALIAS


@task(name="compare_trials", cache_policy=NO_CACHE, retries=2, retry_condition_fn=retry_transient)
def compare_trials(
    tracking: TrackingContext, plan: SweepPlan, outcomes: list[TrialOutcome]
) -> SweepResult:
    """Compare the trials in MLflow and Prefect, alias the best; returns the sweep's result."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    rows, summaries = trial_rows(tracking, plan, outcomes)
    best = best_trial(rows)
    with tempfile.TemporaryDirectory(prefix="titan-sweep-") as tmp:
        markdown, document = _write_report(tmp, plan, rows, summaries)
        client(tracking.uri).log_artifacts(tracking.parent_run_id, tmp)
    alias = alias_best(tracking, plan, best)
    if best is not None and best.metric is not None:
        client(tracking.uri).log_metric(tracking.parent_run_id, f"best/{plan.metric}", best.metric)
    create_table_artifact(
        document["trials"], key="sweep-trials", description=f"Trials of sweep {plan.sweep_id}"
    )
    create_markdown_artifact(
        markdown, key="sweep-comparison", description=f"Comparison of sweep {plan.sweep_id}"
    )
    return SweepResult(
        sweep_id=plan.sweep_id,
        experiment=plan.experiment,
        metric=plan.metric,
        keys=plan.keys,
        trials=tuple(rows),
        best=best,
        mlflow_run_id=tracking.parent_run_id,
        tracking_uri=redact(tracking.uri),
        model_name=plan.model_name,
        alias=alias,
        markdown=markdown,
    )
