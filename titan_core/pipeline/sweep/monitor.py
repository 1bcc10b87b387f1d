"""Early stopping while a sweep's trials run: a thread reads the trials' training losses from
MLflow every ``poll_seconds`` and asks each clearly worse trial that is still training to stop
(``early_stop.median_stop``), through the stop request in the trial's run root
(``titan_core.stop_request``): its trainer saves and ends at its next log step, and its train
task tags its pipeline run as stopped (and discards a request that came too late).

Both sides go through what a sweep already shares with its trials, MLflow and the storage root,
so trials on a work pool are watched too when their run roots are on shared storage. The
monitor never fails the sweep: a read that fails is logged (to the logger the flow hands it)
and tried again at the next poll.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator

from titan_core.errors import first_line
from titan_core.pipeline.run.common import Logger, titan_logger
from titan_core.pipeline.run.tracking import TrackingContext
from titan_core.pipeline.sweep.early_stop import EarlyStopping, StopDecision, median_stop
from titan_core.pipeline.sweep.plan import SweepPlan
from titan_core.pipeline.sweep.tracking import TrialProgress, trial_progress
from titan_core.stop_request import request_stop

_JOIN_TIMEOUT_S = 60.0  # a poll in flight when the sweep ends (one MLflow read per trial)


def trial_steps(plan: SweepPlan) -> dict[int, tuple[int, int]]:
    """Each trial's ``training.steps`` and ``metrics.log_freq`` (by trial index), as its config
    resolves."""
    from titan_core.resolve import resolve_job

    jobs = {
        t.index: resolve_job(plan.recipe, plan.config_file, plan.overrides(t)) for t in plan.trials
    }
    return {index: (job.training.steps, job.metrics.log_freq) for index, job in jobs.items()}


class TrialMonitor:
    """Watches a sweep's trials and asks the clearly worse ones to stop, each once."""

    def __init__(
        self,
        tracking: TrackingContext,
        plan: SweepPlan,
        rule: EarlyStopping,
        logger: Logger | None = None,
    ) -> None:
        self.tracking, self.plan, self.rule = tracking, plan, rule
        self.logger = logger or titan_logger()
        self._steps = trial_steps(plan)
        self._asked: set[int] = set()  # trials asked to stop
        self._progress: dict[int, TrialProgress] = {}
        self._last_error = ""
        self._done = threading.Event()

    def poll(self) -> None:
        """Read every trial once and ask those the rule picks to stop. A trial is judged only
        while it trains (its train stage run is RUNNING) and its trainer has a log step left
        before its last step (where it looks for requests): a request to a trial past that
        would come too late to stop it."""
        self._progress = trial_progress(self.tracking, self.plan, self._progress)
        for index, trial in sorted(self._progress.items()):
            if index in self._asked or not self._training(trial):
                continue
            others = [
                p.curve for i, p in self._progress.items() if i != index and p.status != "FAILED"
            ]
            if (decision := median_stop(trial.curve, others, self.rule)) is not None:
                self._stop(trial, decision)

    def _training(self, trial: TrialProgress) -> bool:
        """Whether ``trial`` is training and a stop can still act: the log step after its newest
        logged one comes before its last step (the trainer looks for requests there only)."""
        if trial.train_status != "RUNNING" or not trial.curve:
            return False
        steps, log_freq = self._steps[trial.index]
        return (trial.curve[-1][0] // log_freq + 1) * log_freq < steps

    def _stop(self, trial: TrialProgress, decision: StopDecision) -> None:
        """Ask the trial's trainer to stop at its next log step. Its train task tags its
        pipeline run when the trainer did (``titan_core.pipeline.stages.training``)."""
        reason = decision.reason()
        request_stop(trial.run_root, reason)
        self._asked.add(trial.index)
        name = self.plan.name(self.plan.trials[trial.index - 1])
        self.logger.warning("%s: asked to stop early: %s", name, reason)

    def watch(self) -> None:
        """Poll until ``close``; a failed poll is logged (once per distinct error), never raised."""
        while not self._done.wait(self.rule.poll_seconds):
            try:
                self.poll()
            except Exception as e:  # MLflow or storage hiccups must not end the sweep
                if first_line(e) != self._last_error:
                    self._last_error = first_line(e)
                    self.logger.warning("early stopping: poll failed: %s", self._last_error)

    def close(self) -> None:
        """Stop watching (the poll in flight, if any, finishes first)."""
        self._done.set()


@contextlib.contextmanager
def watching(
    tracking: TrackingContext, plan: SweepPlan, rule: EarlyStopping, logger: Logger | None = None
) -> Iterator[None]:
    """Run a ``TrialMonitor`` logging to ``logger`` on a thread while the block runs (when
    ``rule.enable``); the thread shares this context (the sweep's flow run)."""
    if not rule.enable:
        yield
        return
    monitor = TrialMonitor(tracking, plan, rule, logger)
    context = contextvars.copy_context()
    thread = threading.Thread(
        target=context.run, args=(monitor.watch,), name="sweep-monitor", daemon=True
    )
    thread.start()
    try:
        yield
    finally:
        monitor.close()
        thread.join(timeout=_JOIN_TIMEOUT_S)
