"""A sweep in MLflow, without an orchestrator: its parent run, its trials' runs read back into
the comparison, the report logged to the sweep's run, the best trial's model version aliased.

The trials' pipeline runs nest under the sweep's run (``mlflow.parentRunId``); their numbers are
read with ``titan_core.pipeline.compare``'s readers, the decisions and words come from
``titan_core.pipeline.sweep.plan`` and ``report``. The ``sweep`` flow's tasks
(``tasks/sweep.py``) call these and show the result as Prefect artifacts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
from typing import Any

from titan_core import storage
from titan_core.config.job import JobConfig
from titan_core.pipeline.compare import (
    PLOT_NAME,
    SWEEP_BEST_TAG,
    SWEEP_ID_TAG,
    SWEEP_STAGE,
    TRIAL_TAG,
    RunSummary,
    plot_loss_curves,
    summarize_run,
)
from titan_core.pipeline.run.common import redact
from titan_core.pipeline.run.report import markdown_image, mlflow_image
from titan_core.pipeline.run.tracking import (
    PARENT_STAGE,
    STAGE_TAG,
    TrackingContext,
    artifact_location,
    check_tracking,
    client,
    ensure_experiment,
    log_params,
    resolve_tracking_uri,
)
from titan_core.pipeline.stages.publish import settle_champion
from titan_core.pipeline.stages.training import STOPPED_TAG
from titan_core.pipeline.sweep.plan import BEST_ALIAS, SweepPlan, TrialOutcome
from titan_core.pipeline.sweep.report import (
    SweepResult,
    TrialRow,
    best_trial,
    plot_metric_by_key,
    render_markdown,
)

SWEEP_TAG = SWEEP_ID_TAG


def start_sweep_run(cfg: JobConfig, plan: SweepPlan, flow_run_id: str = "") -> TrackingContext:
    """Create the experiment (if new) and the sweep's parent run (tagged with the sweep id and
    ``flow_run_id``), the sweep's definition as its params."""
    uri = resolve_tracking_uri(cfg)
    check_tracking(uri)
    mlflow_client = client(uri)
    experiment_id = ensure_experiment(mlflow_client, plan.experiment, artifact_location(cfg, uri))
    tags = {STAGE_TAG: SWEEP_STAGE, SWEEP_TAG: plan.sweep_id}
    tags["prefect.flow_run_id"] = flow_run_id
    run = mlflow_client.create_run(experiment_id, run_name=f"sweep-{plan.sweep_id}", tags=tags)
    log_params(mlflow_client, run.info.run_id, plan.definition())
    return TrackingContext(uri, plan.experiment, experiment_id, run.info.run_id)


def find_trial_run(mlflow_client: Any, tracking: TrackingContext, run_id: str) -> Any | None:
    """The pipeline MLflow run of a trial (by its ``titan.run_id`` tag), if it got one."""
    runs = mlflow_client.search_runs(
        [tracking.experiment_id],
        filter_string=f"tags.`titan.run_id` = '{run_id}' and tags.`{STAGE_TAG}` = 'pipeline'",
        max_results=1,
    )
    return runs[0] if runs else None


@dataclasses.dataclass
class TrialProgress:
    """A trial's pipeline run as the sweep's monitor sees it while trials run."""

    index: int
    mlflow_run_id: str  # the trial's pipeline run
    run_root: str  # where its training writes (``SweepPlan.run_root``)
    status: str  # the pipeline run's MLflow status: RUNNING, FINISHED, FAILED, ...
    train_status: str = ""  # its train stage run's status, "" before it has one
    curve: list[tuple[int, float]] = dataclasses.field(default_factory=list)


def trial_progress(
    tracking: TrackingContext, plan: SweepPlan, known: dict[int, TrialProgress]
) -> dict[int, TrialProgress]:
    """Every trial with a pipeline run so far, its train stage run's status and the curve of
    the early-stopping metric (``plan.early_stop.metric``, default the training loss) read
    live. ``known`` (the previous answer) spares reading runs that have ended."""
    mlflow_client = client(tracking.uri)
    trial_of = {plan.run_id(t): t for t in plan.trials}
    runs = mlflow_client.search_runs(
        [tracking.experiment_id],
        filter_string=(
            f"tags.mlflow.parentRunId = '{tracking.parent_run_id}' "
            f"and tags.`{STAGE_TAG}` = '{PARENT_STAGE}'"
        ),
    )
    progress = {}
    for run in runs:
        planned = trial_of.get(run.data.tags.get("titan.run_id", ""))
        if planned is None:
            continue
        index = planned.index
        seen = known.get(index)
        if seen is not None and seen.status != "RUNNING":
            progress[index] = seen  # ended when last read: its curve is final
            continue
        trial = TrialProgress(index, run.info.run_id, plan.run_root(planned), run.info.status)
        if (train := _train_run(mlflow_client, tracking, run.info.run_id)) is not None:
            trial.train_status = train.info.status
            history = mlflow_client.get_metric_history(train.info.run_id, plan.early_stop.metric)
            trial.curve = sorted((m.step, m.value) for m in history)
        progress[index] = trial
    return progress


def _train_run(mlflow_client: Any, tracking: TrackingContext, pipeline_run_id: str) -> Any | None:
    """A pipeline run's train stage run (read afresh: its status changes), if it has one."""
    runs = mlflow_client.search_runs(
        [tracking.experiment_id],
        filter_string=(
            f"tags.mlflow.parentRunId = '{pipeline_run_id}' and tags.`{STAGE_TAG}` = 'train'"
        ),
        max_results=1,
    )
    return runs[0] if runs else None


def model_version(mlflow_client: Any, model_name: str, mlflow_run_id: str) -> str:
    """The version of ``model_name`` registered from ``mlflow_run_id``, or ""."""
    found = mlflow_client.search_model_versions(
        f"name = '{model_name}' and run_id = '{mlflow_run_id}'"
    )
    return str(found[0].version) if found else ""


def trial_rows(
    tracking: TrackingContext, plan: SweepPlan, outcomes: list[TrialOutcome]
) -> tuple[list[TrialRow], list[RunSummary]]:
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
        run = find_trial_run(mlflow_client, tracking, outcome.run_id)
        if run is not None:
            summary = dataclasses.replace(summarize_run(mlflow_client, run), name=name)
            summaries.append(summary)
            metric = run.data.metrics.get(plan.metric)
            stopped_at = run.data.tags.get(STOPPED_TAG)
            row = dataclasses.replace(
                row,
                status="stopped" if stopped_at and outcome.status == "completed" else row.status,
                stopped_at=int(stopped_at) if stopped_at else None,
                final_loss=summary.final_loss,
                steps=summary.steps,
                metric=metric if outcome.status == "completed" else None,
                mlflow_run_id=run.info.run_id,
                model_version=model_version(mlflow_client, plan.model_name, run.info.run_id),
            )
            mlflow_client.set_tag(run.info.run_id, SWEEP_TAG, plan.sweep_id)
            mlflow_client.set_tag(run.info.run_id, TRIAL_TAG, name)
            # Named by what differs first: the run ids share the sweep's id as a long prefix,
            # which MLflow's run list cuts to the same visible text for every trial.
            mlflow_client.update_run(run.info.run_id, name=f"{name} · {plan.sweep_id}")
        rows.append(row)
    return rows, summaries


def _slug(key: str) -> str:
    """A file-name-safe form of a metric or config key."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key)


def write_report(
    folder: str,
    plan: SweepPlan,
    rows: list[TrialRow],
    summaries: list[RunSummary],
    tracking: TrackingContext,
) -> tuple[str, dict[str, Any]]:
    """Write the PNGs, ``comparison.md`` and ``comparison.json`` into ``folder`` (artifacts of
    the sweep's MLflow run); returns the markdown with the images embedded (for Prefect) and the
    JSON document. The ``comparison.md`` file links the PNGs as MLflow's UI serves them."""
    best = best_trial(rows, plan.metric)
    curves = plot_loss_curves(
        summaries, os.path.join(folder, PLOT_NAME), f"sweep {plan.sweep_id}: training loss"
    )
    pngs = {"training loss of every trial": curves}
    for key in plan.keys:
        png = os.path.join(folder, f"{_slug(plan.metric)}_by_{_slug(key)}.png")
        pngs[f"{plan.metric} by {key}"] = plot_metric_by_key(rows, key, plan.metric, png)
    embedded = [markdown_image(alt, png) for alt, png in pngs.items()]
    linked = [
        mlflow_image(alt, tracking.parent_run_id, os.path.basename(png), tracking.uri)
        for alt, png in pngs.items()
    ]
    markdown = render_markdown(plan.sweep_id, rows, plan.keys, plan.metric, best, embedded)
    for_mlflow = render_markdown(plan.sweep_id, rows, plan.keys, plan.metric, best, linked)
    document = {
        "sweep_id": plan.sweep_id,
        "experiment": plan.experiment,
        "metric": plan.metric,
        "keys": list(plan.keys),
        "best": best.index if best else None,
        "model_name": plan.model_name,
        "trials": [r.as_dict(plan.metric) for r in rows],
    }
    storage.write_text(os.path.join(folder, "comparison.md"), for_mlflow)
    storage.write_text(os.path.join(folder, "comparison.json"), json.dumps(document, indent=2))
    return markdown, document


def alias_best(tracking: TrackingContext, plan: SweepPlan, best: TrialRow | None) -> str:
    """Point ``sweep-best`` at the best trial's model version (tagged with the sweep id and its
    metric); returns the alias, or "" when no trial registered a version. The model's other
    alias, ``champion``, is moved by the trials' own publish stages (the champion rule) and
    settled once they are all done (``settle_champion``)."""
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


NOTE_TAG = "mlflow.note.content"  # what MLflow's UI shows as a run's description (markdown)
NOTE_LIMIT = 8000  # characters of a tag value (mlflow.utils.validation.MAX_TAG_VAL_LENGTH)


def record_comparison(
    tracking: TrackingContext, plan: SweepPlan, outcomes: list[TrialOutcome]
) -> SweepResult:
    """Compare the trials, log the report (``comparison.md``/``.json``, the PNGs) and the best
    metric to the sweep's run, alias the best trial's model version; returns the result."""
    rows, summaries = trial_rows(tracking, plan, outcomes)
    best = best_trial(rows, plan.metric)
    with tempfile.TemporaryDirectory(prefix="titan-sweep-") as tmp:
        markdown, _ = write_report(tmp, plan, rows, summaries, tracking)
        client(tracking.uri).log_artifacts(tracking.parent_run_id, tmp)
        with open(os.path.join(tmp, "comparison.md")) as f:  # the run's description, too
            note = f.read()
        if len(note) > NOTE_LIMIT:  # MLflow's limit on a tag value
            note = note[: NOTE_LIMIT - 60].rsplit("\n", 1)[0] + "\n\n… (the rest: comparison.md)\n"
        client(tracking.uri).set_tag(tracking.parent_run_id, NOTE_TAG, note)
    if best is not None and best.mlflow_run_id:  # what `titan compare` marks (best)
        client(tracking.uri).set_tag(best.mlflow_run_id, SWEEP_BEST_TAG, "true")
    alias = alias_best(tracking, plan, best)
    # The trials published at once, each moving @champion by the value it read: replay the rule.
    settle_champion(tracking, plan.model_name, plan.champion_metric)
    if best is not None and best.metric is not None:
        client(tracking.uri).log_metric(tracking.parent_run_id, f"best/{plan.metric}", best.metric)
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
