"""Early stopping of clearly worse sweep trials: the settings and the median stopping rule.

The rule (Golovin et al., "Google Vizier", 2017; Optuna's ``MedianPruner``): at a step ``s`` (from
``min_steps`` on), compare the running mean of a trial's last ``window`` training losses logged
up to ``s`` with the same mean of every other trial that reached ``s`` (running, finished or
stopped); with at least ``min_trials`` of those, stop the trial when it is worse than their median
by more than ``margin`` (relative). ``s`` is the trial's newest logged step, or the newest step
that ``min_trials`` others reached when it is ahead of them (trials running side by side are
judged as they go, the leader too). The rule reads ``metric`` (default ``train/loss``; an
in-loop evaluator's ``eval/<name>/<metric>`` too), lower or higher being better as
``titan_core.config.metrics`` says. Pure functions: no orchestrator, no MLflow, no clock; the
sweep's monitor (``sweep_monitor``) reads the curves and asks trials to stop.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from titan_core.config.metrics import higher_is_better
from titan_core.errors import ConfigError

Curve = Sequence[tuple[int, float]]  # (step, value) at the logged steps, step ascending


class EarlyStopping(BaseModel):
    """Stop sweep trials whose training loss is clearly worse than the others' (median rule)."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        strict=True,
        use_attribute_docstrings=True,
        title="early stopping",  # the sweep's run form shows it: a name, not the class's
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
    metric: str = "train/loss"
    """What the rule compares: train/loss, or an in-loop evaluator's eval/NAME/METRIC (an
    accuracy: higher is better)."""
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
    loss: float  # the trial's smoothed value of ``metric``
    median: float
    num_trials: int
    metric: str = "train/loss"

    def reason(self) -> str:
        """One line for logs and the trial's MLflow run."""
        what = "training loss" if self.metric == "train/loss" else self.metric
        return (
            f"{what} {self.loss:.4f} at step {self.step} is worse than the median "
            f"{self.median:.4f} of {self.num_trials} other trials"
        )


def smoothed(curve: Curve, step: int, window: int) -> float | None:
    """The mean of the last ``window`` losses logged at or before ``step``, or None when the
    curve has not reached ``step``. A non-finite loss (a diverged trial) counts as +inf."""
    if not curve or curve[-1][0] < step:
        return None
    values = [v if math.isfinite(v) else math.inf for s, v in curve if s <= step][-window:]
    return math.fsum(values) / len(values) if values else None


def judged_step(curve: Curve, others: Sequence[Curve], min_trials: int) -> int | None:
    """The step a trial is judged at: its newest logged step, or, when fewer than
    ``min_trials`` others reached that, the newest step that ``min_trials`` others reached
    (None when fewer than ``min_trials`` others logged anything)."""
    reached = sorted((c[-1][0] for c in others if c), reverse=True)
    if not curve or len(reached) < min_trials:
        return None
    return min(curve[-1][0], reached[min_trials - 1])


def median_stop(curve: Curve, others: Sequence[Curve], rule: EarlyStopping) -> StopDecision | None:
    """The median stopping rule for one trial at its ``judged_step``: a decision to stop it,
    or None (in its grace period, too few other trials reached that step, or not worse than
    their median by more than the margin; a tie is never stopped)."""
    if higher_is_better(rule.metric):  # judged as lower-is-better on the negated values
        flipped = EarlyStopping.model_validate(rule.model_dump() | {"metric": "train/loss"})
        found = median_stop(_negated(curve), [_negated(c) for c in others], flipped)
        return (
            None
            if found is None
            else StopDecision(found.step, -found.loss, -found.median, found.num_trials, rule.metric)
        )
    step = judged_step(curve, others, rule.min_trials)
    if step is None or step < rule.min_steps:
        return None
    loss = smoothed(curve, step, rule.window)
    peers = [v for c in others if (v := smoothed(c, step, rule.window)) is not None]
    if loss is None or len(peers) < rule.min_trials:
        return None
    median = statistics.median(peers)
    if not math.isfinite(median) or loss <= median + rule.margin * abs(median):
        return None
    return StopDecision(step, loss, median, len(peers), rule.metric)


def _negated(curve: Curve) -> list[tuple[int, float]]:
    """``curve`` with its values negated; a NaN (diverged) stays NaN, the worst either way."""
    return [(s, -v) for s, v in curve]
