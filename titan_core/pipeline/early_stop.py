"""Early stopping of clearly worse sweep trials: the settings, the median stopping rule, and how a
pipeline run records that its training was stopped early.

The rule (Golovin et al., "Google Vizier", 2017; Optuna's ``MedianPruner``): at a trial's newest
logged step ``s`` (from ``min_steps`` on), compare the running mean of its last ``window`` logged
training losses with the same mean of every other trial that reached ``s`` (running, finished or
stopped); with at least ``min_trials`` of those, stop the trial when it is worse than their median
by more than ``margin`` (relative). Pure functions: no orchestrator, no MLflow, no clock.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from titan_core.errors import ConfigError
from titan_core.pipeline.tracking import TrackingContext, client

Curve = Sequence[tuple[int, float]]  # (step, training loss) at the logged steps, step ascending
STOPPED_TAG = "titan.stopped_at"  # MLflow tag of a pipeline run whose training was stopped early


class EarlyStopping(BaseModel):
    """Stop sweep trials whose training loss is clearly worse than the others' (median rule)."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, strict=True, use_attribute_docstrings=True
    )

    enable: bool = False
    """Stop a trial whose training loss is worse than the median of the other trials' at the
    same step."""
    min_steps: int = Field(default=10, ge=0)
    """Grace period: no trial is stopped before this training step."""
    min_trials: int = Field(default=3, ge=1)
    """Other trials that must have reached the step before a trial is judged against them."""
    window: int = Field(default=3, ge=1)
    """Logged losses averaged per trial (a running mean of the last few log steps)."""
    margin: float = Field(default=0.0, ge=0.0)
    """Stop only when worse than the median by more than this fraction of it (0.1 = 10%)."""
    poll_seconds: float = Field(default=5.0, gt=0.0)
    """How often the sweep reads the running trials' losses from MLflow."""


def early_stopping(value: Any) -> EarlyStopping:
    """The sweep's ``early_stop`` parameter (None, a mapping or an ``EarlyStopping``), checked:
    a bad field is a one-line ``ConfigError`` naming it."""
    if value is None:
        return EarlyStopping()
    try:
        return EarlyStopping.model_validate(value)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in ("sweep.early_stop", *first["loc"]))
        message = first["msg"][:1].lower() + first["msg"][1:]
        raise ConfigError(f"{where}: {message}, got {first['input']!r}") from None


@dataclass(frozen=True)
class StopDecision:
    """Why a trial is stopped: its smoothed loss against the others' median at one step."""

    step: int
    loss: float
    median: float
    num_trials: int

    def reason(self) -> str:
        """One line for logs and the trial's MLflow run."""
        return (
            f"training loss {self.loss:.4f} at step {self.step} is worse than the median "
            f"{self.median:.4f} of {self.num_trials} other trials"
        )


def smoothed(curve: Curve, step: int, window: int) -> float | None:
    """The mean of the last ``window`` losses logged at or before ``step``, or None when the
    curve has not reached ``step``. A non-finite loss (a diverged trial) counts as +inf."""
    if not curve or curve[-1][0] < step:
        return None
    values = [v if math.isfinite(v) else math.inf for s, v in curve if s <= step][-window:]
    return math.fsum(values) / len(values) if values else None


def median_stop(curve: Curve, others: Sequence[Curve], rule: EarlyStopping) -> StopDecision | None:
    """The median stopping rule for one trial at its newest logged step: a decision to stop it,
    or None (in its grace period, too few other trials reached that step, or not worse than
    their median by more than the margin; a tie is never stopped)."""
    if not curve or curve[-1][0] < rule.min_steps:
        return None
    step = curve[-1][0]
    loss = smoothed(curve, step, rule.window)
    peers = [v for c in others if (v := smoothed(c, step, rule.window)) is not None]
    if loss is None or len(peers) < rule.min_trials:
        return None
    median = statistics.median(peers)
    if not math.isfinite(median) or loss <= median + rule.margin * abs(median):
        return None
    return StopDecision(step, loss, median, len(peers))


def trained_to(checkpoint_steps: Sequence[int], steps: int, stopped: bool, where: str) -> int:
    """The step a cleanly finished training job reached (its newest complete checkpoint in
    ``where``): ``steps``, or fewer when it was asked to stop (``stopped``, see
    ``titan_core.stop_request``). Short of ``steps`` without a stop request it raises (a
    ``RuntimeError``: the train task retries it, resuming from that checkpoint)."""
    done = checkpoint_steps[-1] if checkpoint_steps else None
    if done is not None and (done >= steps or stopped):
        return done
    raise RuntimeError(
        f"training exited cleanly but the newest complete checkpoint in {where} is "
        f"{'none' if done is None else done}, not step {steps}"
    )


def tag_stopped(tracking: TrackingContext | None, stage_run_id: str, step: int) -> None:
    """Tag the pipeline's MLflow run and its train stage run ``titan.stopped_at=<step>``."""
    if tracking is None:
        return
    mlflow_client = client(tracking.uri)
    for run_id in (tracking.parent_run_id, stage_run_id):
        if run_id:
            mlflow_client.set_tag(run_id, STOPPED_TAG, str(step))
