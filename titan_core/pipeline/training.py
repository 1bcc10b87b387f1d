"""What a pipeline run makes of a training job that exited cleanly: the step it reached, and,
when it honoured a stop request (``titan_core.stop_request``), the MLflow tags saying so."""

from __future__ import annotations

from collections.abc import Sequence

from titan_core.pipeline.tracking import TrackingContext, client
from titan_core.stop_request import StopRecord

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
