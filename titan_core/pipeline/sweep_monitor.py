"""Early stopping while a sweep's trials run: a thread reads the trials' training losses from
MLflow every ``poll_seconds`` and asks each clearly worse running trial to stop
(``early_stop.median_stop``), through the stop-request marker in the trial's run root
(``titan_core.stop_request``): its trainer saves and ends at its next log step.

Both sides go through what a sweep already shares with its trials, MLflow and the storage root,
so trials on a work pool are watched too when their run roots are on shared storage. The
monitor never fails the sweep: a read that fails is logged and tried again at the next poll.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator

from titan_core.errors import first_line
from titan_core.pipeline.common import run_logger
from titan_core.pipeline.early_stop import EarlyStopping, StopDecision, median_stop
from titan_core.pipeline.sweep import SweepPlan
from titan_core.pipeline.sweep_tracking import TrialProgress, trial_progress
from titan_core.pipeline.tracking import TrackingContext, client
from titan_core.stop_request import request_stop

REASON_TAG = "sweep.stop_reason"  # on a stopped trial's pipeline run: why the sweep stopped it
_JOIN_TIMEOUT_S = 60.0  # a poll in flight when the sweep ends (one MLflow read per trial)


class TrialMonitor:
    """Watches a sweep's trials and stops the clearly worse ones; ``stopped`` says which."""

    def __init__(self, tracking: TrackingContext, plan: SweepPlan, rule: EarlyStopping) -> None:
        self.tracking, self.plan, self.rule = tracking, plan, rule
        self.stopped: dict[int, StopDecision] = {}
        self._progress: dict[int, TrialProgress] = {}
        self._last_error = ""
        self._done = threading.Event()

    def poll(self) -> dict[int, StopDecision]:
        """Read every trial once and stop those the rule picks; returns the new decisions."""
        self._progress = trial_progress(self.tracking, self.plan, self._progress)
        decisions = {}
        for index, trial in sorted(self._progress.items()):
            if trial.status != "RUNNING" or index in self.stopped or not trial.run_root:
                continue
            others = [
                p.curve for i, p in self._progress.items() if i != index and p.status != "FAILED"
            ]
            if (decision := median_stop(trial.curve, others, self.rule)) is not None:
                self._stop(trial, decision)
                decisions[index] = decision
        return decisions

    def _stop(self, trial: TrialProgress, decision: StopDecision) -> None:
        """Ask the trial's trainer to stop; record why on its pipeline run."""
        reason = decision.reason()
        request_stop(trial.run_root, reason)
        self.stopped[trial.index] = decision
        client(self.tracking.uri).set_tag(trial.mlflow_run_id, REASON_TAG, reason)
        name = self.plan.name(self.plan.trials[trial.index - 1])
        run_logger().warning("%s: stopping early: %s", name, reason)

    def watch(self) -> None:
        """Poll until ``close``; a failed poll is logged (once per distinct error), never raised."""
        while not self._done.wait(self.rule.poll_seconds):
            try:
                self.poll()
            except Exception as e:  # MLflow or storage hiccups must not end the sweep
                if first_line(e) != self._last_error:
                    self._last_error = first_line(e)
                    run_logger().warning("early stopping: poll failed: %s", self._last_error)

    def close(self) -> None:
        """Stop watching (the poll in flight, if any, finishes first)."""
        self._done.set()


@contextlib.contextmanager
def watching(
    tracking: TrackingContext, plan: SweepPlan, rule: EarlyStopping
) -> Iterator[TrialMonitor | None]:
    """Run a ``TrialMonitor`` on a thread while the block runs (when ``rule.enable``); the
    thread shares this context, so its logs go to the sweep's flow run."""
    if not rule.enable:
        yield None
        return
    monitor = TrialMonitor(tracking, plan, rule)
    context = contextvars.copy_context()
    thread = threading.Thread(
        target=context.run, args=(monitor.watch,), name="sweep-monitor", daemon=True
    )
    thread.start()
    try:
        yield monitor
    finally:
        monitor.close()
        thread.join(timeout=_JOIN_TIMEOUT_S)
