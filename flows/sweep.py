"""The ``sweep`` flow: one recipe, a grid or seeded random search over dotted config keys, each
trial a full ``pretrain_pipeline`` run, all under one MLflow run, compared at the end.

Every trial's config is resolved before the first starts (a bad key is one line, nothing runs).
Trials run at most ``concurrency`` at a time: as ``pretrain_pipeline`` subflows of this process
(each inside a ``trial`` task on a ``ThreadPoolTaskRunner``), or, with ``deployment``, as runs of
that deployment on its work pool. A failed trial is reported in the comparison; the sweep fails
only when every trial did. With ``early_stop``, a monitor thread stops clearly worse trials
(``titan_core.pipeline.sweep.monitor``). ``titan sweep`` (titan_core/cli/sweep.py) runs it from the
command line.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Annotated, Any

from prefect import flow, tags, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture
from prefect.task_runners import ThreadPoolTaskRunner

from tasks.runtime import current_run_id, name_flow_run, run_id_name, run_logger
from tasks.sweep import compare_trials, start_sweep_tracking
from titan_core.config.form import (
    NO_VALUES,
    ConfigParameter,
    FormParameter,
    ValuesParameter,
    flow_values,
)
from titan_core.errors import ConfigError, TitanError, first_line
from titan_core.pipeline.run.config import DEFAULT_RECIPE
from titan_core.pipeline.run.tracking import end_pipeline_run
from titan_core.pipeline.sweep.early_stop import EarlyStopping
from titan_core.pipeline.sweep.monitor import watching
from titan_core.pipeline.sweep.plan import SweepError, SweepPlan, Trial, TrialOutcome, plan_sweep
from titan_core.pipeline.sweep.report import SweepResult, format_table
from titan_core.resolve import resolve_job

PIPELINE_FLOW = "pretrain_pipeline"
EARLY_STOP_FORM = FormParameter(
    keep="off", keep_help="No early stopping; change shows its settings (enable turns it on)."
)
"""``early_stop`` in the run form: folded behind an "off" tab that submits nothing."""


class TrialFailed(TitanError):
    """A trial's deployment run ended in a state other than Completed."""

    exit_code = 1


def _literal(name: str) -> str:
    """``name`` safe as a Prefect run-name template (braces are placeholders there)."""
    return name.replace("{", "{{").replace("}", "}}")


@task(name="trial", cache_policy=NO_CACHE)
def run_trial(params: dict[str, Any], deployment: str = "", labels: list[str] | None = None) -> str:
    """Run one trial: ``pretrain_pipeline`` as a subflow here, or a run of ``deployment`` (the
    task waits for it); returns the trial's run id. Fails when the trial's run failed.

    The pipeline names its flow run ``<experiment>/<run id>``; the trial's name (with its
    values) is this task run's."""
    if not deployment:
        from flows.pipeline import pretrain_pipeline

        pretrain_pipeline(**params)
        return params["run_id"]
    from prefect.deployments import run_deployment

    flow_run = run_deployment(deployment, parameters=params, tags=labels, timeout=None)
    state = flow_run.state
    if state is None or not state.is_completed():
        ended = state.name if state else "without a state"
        message = (state.message or "").strip().split("\n")[0] if state else ""
        raise TrialFailed(f"deployment run {flow_run.name} ended {ended}: {message}".rstrip(": "))
    return params["run_id"]


def deployment_name(deployment: str) -> str:
    """``flow/deployment`` for ``run_deployment``; a bare name is a ``pretrain_pipeline`` one.
    One-line ``ConfigError`` when the Prefect server has no such deployment."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    full = deployment if "/" in deployment else f"{PIPELINE_FLOW}/{deployment}"
    with get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name(full)
        except ObjectNotFound:
            raise ConfigError(
                f"sweep.deployment: no deployment {full!r} on the Prefect server"
            ) from None
    return full


# One line per trial as the sweep collects it, for a console that shows progress and nothing
# else (`titan sweep` prints this logger and silences Prefect's console; the UI has everything).
PROGRESS = logging.getLogger("titan.sweep.progress")
PROGRESS.propagate = False


def _outcome(plan: SweepPlan, trial: Trial, future: PrefectFuture[str]) -> TrialOutcome:
    """Wait for a trial's task; its status and, when it failed, its one-line error."""
    future.wait()
    state = future.state
    done = f"[{trial.index}/{len(plan.trials)}] {plan.name(trial).split('/', 1)[-1]}"
    if state.is_completed():
        PROGRESS.info("%s: completed", done)
        return TrialOutcome(trial.index, plan.run_id(trial), "completed")
    error = state.result(raise_on_failure=False)
    text = first_line(error) if isinstance(error, BaseException) else state.message or state.name
    run_logger().warning("%s failed: %s", plan.name(trial), text)
    refused = isinstance(error, ConfigError)  # an expected refusal (preflight), not a crash
    PROGRESS.info("%s: %s: %s", done, "refused" if refused else "failed", text)
    return TrialOutcome(trial.index, plan.run_id(trial), "failed", text)


def run_trials(plan: SweepPlan, parent_run_id: str, deployment: str) -> list[TrialOutcome]:
    """Every trial, at most ``plan.concurrency`` at a time, in trial order; waits for all."""
    with ThreadPoolTaskRunner(max_workers=plan.concurrency) as runner:
        futures = []
        for trial in plan.trials:
            params = {
                "recipe": plan.recipe,
                "config": {},  # replaces a deployment's config: the overrides say it all
                "overrides": plan.overrides(trial),
                "config_file": plan.config_file,
                "run_id": plan.run_id(trial),
                "parent_run_id": parent_run_id,
            }
            labels = [f"sweep:{plan.sweep_id}", f"trial:{trial.index}"]
            task_fn = run_trial.with_options(task_run_name=_literal(plan.name(trial)))
            with tags(*labels):  # the submission's context: the trial's subflow gets them too
                future = runner.submit(
                    task_fn, {"params": params, "deployment": deployment, "labels": labels}
                )
            futures.append(future)
        return [_outcome(plan, t, f) for t, f in zip(plan.trials, futures)]


@flow(name="sweep", flow_run_name=run_id_name, validate_parameters=False)
def sweep(
    recipe: str = DEFAULT_RECIPE,
    config: ConfigParameter = NO_VALUES,
    overrides: ValuesParameter = NO_VALUES,
    grid: Annotated[Mapping[str, list[Any]] | None, FormParameter()] = NO_VALUES,
    random: Annotated[Mapping[str, Mapping[str, list[Any]]] | None, FormParameter()] = NO_VALUES,
    trials: int = 4,
    seed: int = 0,
    concurrency: int = 2,
    metric: str = "eval/loss",
    deployment: str = "",
    config_file: str = "",
    early_stop: Annotated[EarlyStopping | Mapping[str, Any] | None, EARLY_STOP_FORM] = NO_VALUES,
) -> SweepResult:
    """Train one recipe once per trial and compare the trials; the best one's model version
    gets the ``sweep-best`` alias.

    Args:
        recipe: Registry recipe every trial starts from (e.g. llama3_debugmodel).
        config: Settings every trial shares, section by section (empty fields keep the recipe's).
        overrides: Dotted config keys to values every trial shares, applied after config.
        grid: Dotted config keys to lists of values; every combination is a trial,
            e.g. {"optimizer.lr": [0.001, 0.003], "training.steps": [20, 40]}.
        random: Dotted config keys to distributions for a seeded random search:
            {"log_uniform": [low, high]}, {"uniform": [low, high]}, {"int_uniform": [low, high]}
            or {"choice": [values]}; with a grid, every cell is combined with every draw.
        trials: Number of random draws (with random).
        seed: Seed of the random search: the same seed draws the same trials.
        concurrency: Trials running at the same time.
        metric: Metric of the trials' pipeline runs that picks the best one (the lowest, or
            the highest for an accuracy such as eval/NAME/acc).
        deployment: A pretrain_pipeline deployment to run each trial on its work pool
            (name or flow/name); empty runs the trials as subflows of this flow run.
        config_file: TOML job config applied onto the recipe for every trial.
        early_stop: Early stopping (off by default): with enable, a trial still training whose
            training loss is worse than the median of the other trials' at the same step
            (from min_steps on, once min_trials others reached it) is stopped at its next log
            step; it still exports and evaluates what it trained, and is reported as stopped.
    """
    plan = plan_sweep(
        current_run_id(),
        recipe,
        config_file,
        flow_values(config, overrides),
        grid=grid,
        random=random,
        trials=trials,
        seed=seed,
        concurrency=concurrency,
        metric=metric,
        early_stop=early_stop,
    )
    target = deployment_name(deployment) if deployment else ""
    name_flow_run(
        f"sweep-{plan.sweep_id}",
        [f"experiment:{plan.experiment}", f"recipe:{recipe}", f"sweep:{plan.sweep_id}"],
    )
    base = resolve_job(recipe, config_file, dict(plan.base))
    tracking = start_sweep_tracking(base, plan)
    try:
        with watching(tracking, plan, plan.early_stop, run_logger()):
            outcomes = run_trials(plan, tracking.parent_run_id, target)
        result = compare_trials(tracking, plan, outcomes)
    except BaseException:
        end_pipeline_run(tracking, "FAILED")
        raise
    end_pipeline_run(tracking, "FAILED" if len(result.failed) == len(result.trials) else "FINISHED")
    run_logger().info("%s", format_table(result))
    if len(result.failed) == len(result.trials):
        raise SweepError(
            f"sweep: all {len(result.trials)} trials failed; trial-1: {result.trials[0].error}"
        )
    return result
