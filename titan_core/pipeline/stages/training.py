"""What a pipeline run makes of a training job: the step it reached, and, when it honoured a
stop request (``titan_core.stop_request``), the MLflow tags saying so (a request the job never
honoured is discarded); the step guard's incidents as a table, MLflow tags and an artifact."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

from titan_core import storage
from titan_core.errors import first_line
from titan_core.pipeline.run.common import Logger, redact, titan_logger
from titan_core.pipeline.run.report import counted
from titan_core.pipeline.run.tracking import TrackingContext, client, copy_curves
from titan_core.pipeline.run.transfer import refresh
from titan_core.stop_request import STOP_REQUEST, StopRecord, discard_stop_request

STOPPED_TAG = "titan.stopped_at"  # MLflow tag of a pipeline run whose training was stopped early
REASON_TAG = "titan.stop_reason"  # ... and why (the stop request's text)


def trained_to(
    checkpoint_steps: Sequence[int], steps: int, record: StopRecord | None, where: str
) -> tuple[int, StopRecord | None]:
    """The step a cleanly finished training job reached (its newest complete checkpoint in
    ``where``) and the stop request it honoured there, if any: ``(steps, None)``, or fewer
    steps when the job's ``stopped-early`` record (``record``) is of that very step. Short of
    ``steps`` otherwise it raises (a ``RuntimeError``: the train task retries it, resuming
    from that checkpoint)."""
    done = checkpoint_steps[-1] if checkpoint_steps else None
    if done is not None and done >= steps:
        return done, None
    if done is not None and record is not None and record.step == done:
        return done, record
    raise RuntimeError(
        f"training exited cleanly but the newest complete checkpoint in {where} is "
        f"{'none' if done is None else done}, not step {steps}"
    )


def tag_stopped(tracking: TrackingContext | None, stage_run_id: str, stop: StopRecord) -> None:
    """Tag the pipeline's MLflow run and its train stage run ``titan.stopped_at=<step>`` and
    ``titan.stop_reason=<the request's text>``."""
    if tracking is None:
        return
    mlflow_client = client(tracking.uri)
    for run_id in (tracking.parent_run_id, stage_run_id):
        if run_id:
            mlflow_client.set_tag(run_id, STOPPED_TAG, str(stop.step))
            mlflow_client.set_tag(run_id, REASON_TAG, stop.reason)


def discard_late_stop(dump_folder: str, logger: Logger | None = None) -> None:
    """Delete a stop request the finished job left in ``dump_folder`` (it came after the job's
    last log step, or while the job saved and flushed its metrics), so that the next run in that
    folder (a resume, ``--run-id`` with more steps) trains on instead of stopping at once.
    Logged to ``logger``; a storage error is logged too, not raised (training is over)."""
    logger = logger or titan_logger()
    try:
        discarded = discard_stop_request(dump_folder)
    except Exception as e:  # fsspec backends raise more than OSError (S3 client errors)
        where = redact(storage.join(dump_folder, STOP_REQUEST))
        logger.warning("Could not delete the stop request %s: %s", where, first_line(e))
        return
    if discarded:
        logger.info("A stop request came after training's last log step: discarded")


HEALTH_FILE = "health.jsonl"  # the step guard's incidents, beside metrics.jsonl
HEALTH_TAG = "titan.health"  # MLflow tag: "1 incident, 2 rollbacks[, 3 stragglers]"


def health_rows(side_folder: str) -> list[dict]:
    """The step guard's rows (incidents and rollbacks) of a run, read from its local side
    folder; none when the guard saw nothing."""
    path = os.path.join(side_folder, HEALTH_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@dataclass(frozen=True)
class HealthCounts:
    """What the step guard and the straggler monitor saw in a train run, every attempt of it."""

    incidents: int = 0  # anomalies: non-finite values, spikes, recompute mismatches
    skipped_steps: int = 0  # steps whose update an incident with policy skip dropped
    rollbacks: int = 0
    stragglers: int = 0  # ranks named slow at log steps (reported only)


@dataclass(frozen=True)
class Trained:
    """The train task's result: the final checkpoint and the run's health counts."""

    checkpoint: str
    health: HealthCounts


def health_counts(rows: list[dict]) -> HealthCounts:
    """The counts of a run's ``health.jsonl`` rows."""
    stragglers = [r for r in rows if r.get("kind") == "straggler"]
    rollbacks = [r for r in rows if "quantity" not in r]
    incidents = [
        r for r in rows if "quantity" in r and r.get("kind") not in ("straggler", "replica_groups")
    ]
    skipped = {r["step"] for r in incidents if r["action"] == "skip"}
    return HealthCounts(len(incidents), len(skipped), len(rollbacks), len(stragglers))


def health_cells(r: dict) -> tuple[str, str, str, str, str]:
    """One ``health.jsonl`` row as (step, what, value, ranks, action), for people."""
    if r["action"] == "rollback" and "quantity" not in r:
        skipped = r.get("skipped_samples")
        value = f"samples {skipped[0]}:{skipped[1]} skipped" if skipped else ""
        return str(r["step"]), f"rolled back to step {r['to_step']}", value, "all", "rollback"
    ranks = r["ranks"] if r["ranks"] == "all" else ", ".join(map(str, r["ranks"]))
    what, value = f"{r['kind']} {r['quantity']}", f"{r['value']}"
    if r["kind"] == "spike":
        value += f" (window mean {r['mean']:.4g}, std {r['std']:.3g})"
    elif r["kind"] == "straggler":
        what = f"straggler ({r['quantity'].replace('_', ' ')})"
        value = f"{r['value'] * 1e3:.1f} ms/step (others' median {r['median'] * 1e3:.1f} ms)"
    elif r["kind"] == "replica_groups":
        what, value = "replica groups", r["detail"]
    elif r["kind"] == "sdc":
        what = "recompute differs"
        value = f"{r['differs']}, relative {r['value']:.3g}"
    return str(r["step"]), what, value, ranks, r["action"]


def health_markdown(rows: list[dict]) -> str:
    """The incidents as a Markdown table (the Prefect artifact of the train task)."""
    head = "| step | what | value | ranks | action |\n|---:|---|---|---|---|\n"
    lines = ["| " + " | ".join(health_cells(r)) + " |" for r in rows]
    return "## Training health\n\n" + head + "\n".join(lines) + "\n"


MAX_HEALTH_LINES = 20  # rows a run summary lists; the rest are in health.jsonl


def health_lines(rows: list[dict]) -> list[str]:
    """The rows in one line each (``step 3: nonfinite grad_norm, nan (all ranks) -> rollback``),
    at most ``MAX_HEALTH_LINES``, then a line saying how many more ``health.jsonl`` holds."""
    lines = []
    for r in rows[:MAX_HEALTH_LINES]:
        step, what, value, ranks, action = health_cells(r)
        where = "all ranks" if ranks == "all" else f"ranks {ranks}"
        lines.append(f"step {step}: {what}{', ' + value if value else ''} ({where}) -> {action}")
    if len(rows) > MAX_HEALTH_LINES:
        lines.append(f"... {len(rows) - MAX_HEALTH_LINES} more in {HEALTH_FILE}")
    return lines


def health_summary(counts: HealthCounts) -> str:
    """``1 incident, 1 rollback`` (and ``, 2 stragglers`` when ranks were named): the
    ``titan.health`` tag, and the run summary's health line."""
    summary = f"{counted(counts.incidents, 'incident')}, {counted(counts.rollbacks, 'rollback')}"
    if counts.stragglers:
        summary += f", {counted(counts.stragglers, 'straggler')}"
    return summary


def stored_health_rows(run_root: str) -> list[dict]:
    """The step guard's rows of a run, read from its run root (any URL: the side folder was
    uploaded there); none when the guard saw nothing."""
    path = storage.join(run_root, HEALTH_FILE)
    refresh(path)
    if not storage.exists(path):
        return []
    return [json.loads(line) for line in storage.read_text(path).splitlines() if line.strip()]


def record_health(
    tracking: TrackingContext | None, stage_run_id: str, side_folder: str, rows: list[dict]
) -> None:
    """Tag the pipeline's MLflow run and its train stage run with the guard's counts
    (``titan.health``) and attach ``health.jsonl`` to the train run."""
    if tracking is None or not rows:
        return
    summary = health_summary(health_counts(rows))
    mlflow_client = client(tracking.uri)
    for run_id in (tracking.parent_run_id, stage_run_id):
        if run_id:
            mlflow_client.set_tag(run_id, HEALTH_TAG, summary)
    if stage_run_id:
        mlflow_client.log_artifact(stage_run_id, os.path.join(side_folder, HEALTH_FILE))


CURVES = ("train/loss", "train/grad_norm", "train/lr", "train/tps", "train/mfu_pct")


def record_train_run(
    tracking: TrackingContext | None, stage_run_id: str, side_folder: str, config_url: str
) -> None:
    """What a finished train stage leaves in MLflow besides its metrics: ``metrics.jsonl`` and
    the run's ``config.toml`` (secrets redacted) as artifacts of the train run, and its curves
    (``CURVES``, every logged step) on the pipeline's run."""
    if tracking is None or not stage_run_id:
        return
    mlflow_client = client(tracking.uri)
    with tempfile.TemporaryDirectory(prefix="titan-train-") as tmp:
        sources = {
            "metrics.jsonl": os.path.join(side_folder, "metrics.jsonl"),
            "config.toml": config_url,
        }
        for name, source in sources.items():
            if storage.exists(source):
                storage.write_text(os.path.join(tmp, name), redact(storage.read_text(source)))
        mlflow_client.log_artifacts(stage_run_id, tmp, "train")
    copy_curves(tracking, stage_run_id, CURVES)


def report_health(tracking: TrackingContext | None, stage_run_id: str, side_folder: str) -> str:
    """The step guard's incidents of a train run: recorded in MLflow (``record_health``) and
    returned as the Markdown table for the task's Prefect artifact ("" when there were none)."""
    rows = health_rows(side_folder)
    if not rows:
        return ""
    record_health(tracking, stage_run_id, side_folder, rows)
    return health_markdown(rows)
