"""What a pipeline run makes of a training job that exited cleanly: the step it reached, and,
when it honoured a stop request (``titan_core.stop_request``), the MLflow tags saying so; a
request the job never honoured is discarded."""

from __future__ import annotations

from collections.abc import Sequence

from titan_core import storage
from titan_core.errors import first_line
from titan_core.pipeline.run.common import Logger, redact, titan_logger
from titan_core.pipeline.run.tracking import TrackingContext, client
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
