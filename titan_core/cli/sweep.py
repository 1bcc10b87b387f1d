"""``titan sweep``: run the ``sweep`` flow from the command line and print its table.

    titan sweep [--config RECIPE [--module FAMILY]] [--config-file F]
                [--grid KEY=V1,V2 ...] [--random KEY=KIND:ARGS ... --trials N --seed S]
                [--concurrency N] [--metric NAME] [--deployment NAME] [--section.field value ...]
                [--early-stop [--early-stop-min-steps N] [--early-stop-min-trials N] ...]

``--grid optimizer.lr=1e-3,3e-3 --grid training.steps=20,40`` runs the 4 combinations;
``--random optimizer.lr=log_uniform:1e-4,1e-2 --trials 8 --seed 0`` draws 8 (KIND: log_uniform,
uniform, int_uniform LOW,HIGH or choice V1,V2,...). Every trial's config is resolved before
Prefect starts: a bad key or value is one ``error:`` line and nothing runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any

import tyro

from titan_core.cli.command import Command, Parsed, default, run
from titan_core.cli.pipeline import RENAMED_FLAGS, flow_kwargs
from titan_core.errors import ConfigError

NONE = default("none")


@dataclass(kw_only=True)
class SweepOptions:
    """The options of ``titan sweep`` (config arguments aside: shared by every trial)."""

    grid: Annotated[list[str], tyro.conf.arg(metavar="KEY=V1,V2"), NONE] = field(
        default_factory=list
    )
    """grid values of a key (several, or repeat --grid)"""
    random: Annotated[list[str], tyro.conf.arg(metavar="KEY=KIND:ARGS"), NONE] = field(
        default_factory=list
    )
    """random-search distribution of a key (KIND: log_uniform|uniform|int_uniform|choice)"""
    trials: Annotated[int, default("4")] = 0
    """random draws (with --random)"""
    seed: int = 0
    """seed of the random search"""
    concurrency: int = 2
    """trials at the same time"""
    metric: str = "eval/loss"
    """picks the best trial (lowest; highest for an accuracy, eval/NAME/acc*)"""
    deployment: Annotated[str, default("none: trials run in this process")] = ""
    """run trials as runs of this pretrain_pipeline deployment"""
    early_stop: bool = False
    """stop trials whose loss is worse than the others' median at a step (still evaluated)"""
    early_stop_min_steps: int = 10
    """no trial is stopped before this step"""
    early_stop_min_trials: int = 3
    """other trials that must have reached the step"""
    early_stop_window: int = 3
    """logged losses averaged per trial"""
    early_stop_margin: float = 0.0
    """stop only when worse than the median by this fraction"""
    early_stop_metric: str = "train/loss"
    """what early stopping compares: train/loss or an in-loop eval/NAME/METRIC"""


COMMAND = Command("titan sweep", SweepOptions, __doc__ or "", renamed=RENAMED_FLAGS)
EARLY_STOP_SETTINGS = ("min_steps", "min_trials", "window", "margin", "metric")


def early_stop_arg(parsed: Parsed[SweepOptions]) -> dict[str, Any] | None:
    """The ``early_stop`` parameter from ``--early-stop`` and the ``--early-stop-*`` settings
    given (the others keep the flow's defaults)."""
    keys = {n: f"early_stop_{n}" for n in EARLY_STOP_SETTINGS}
    given = {n: parsed.given[key] for n, key in keys.items() if key in parsed.given}
    if given and not parsed.options.early_stop:
        flag = next(iter(given)).replace("_", "-")
        raise ConfigError(f"--early-stop-{flag}: sets early stopping; give --early-stop too")
    return {"enable": True, **given} if parsed.options.early_stop else None


def sweep_kwargs(argv: list[str]) -> dict[str, Any]:
    """The ``sweep`` flow's arguments from ``argv``; every trial's config is resolved here."""
    from titan_core.pipeline.sweep.plan import parse_grid_arg, parse_random_arg, plan_sweep

    parsed = COMMAND.parse(argv)
    ns, pipeline = parsed.options, flow_kwargs(parsed.config)
    grid = dict(parse_grid_arg(arg) for arg in ns.grid)
    random = dict(parse_random_arg(arg) for arg in ns.random)
    given_trials = "trials" in parsed.given
    if given_trials and not random:
        raise ConfigError("--trials: counts random draws; give --random KEY=KIND:ARGS too")
    kwargs = {
        **pipeline,
        "grid": grid,
        "random": random,
        "trials": ns.trials if given_trials else 4,
        "seed": ns.seed,
        "concurrency": ns.concurrency,
        "metric": ns.metric,
        "deployment": ns.deployment,
        "early_stop": early_stop_arg(parsed),
    }
    plan_args = {k: kwargs[k] for k in ("grid", "random", "trials", "seed", "concurrency")}
    try:
        plan_sweep(
            "check",
            kwargs["recipe"],
            kwargs["config_file"],
            kwargs["overrides"],
            metric=ns.metric,
            early_stop=kwargs["early_stop"],
            **plan_args,
        )
    except ConfigError as e:
        raise ConfigError(as_flags(str(e))) from None
    return kwargs


def as_flags(message: str) -> str:
    """``message`` with the sweep's own settings named by the flags that set them:
    ``sweep.concurrency`` is ``--concurrency``, ``sweep.early_stop.min_trials`` is
    ``--early-stop-min-trials`` (the flow's parameter names are for its callers)."""
    own = {f.name for f in dataclasses.fields(SweepOptions)}

    def flag(match: re.Match[str]) -> str:
        name = match.group(1).replace(".", "_")
        return "--" + name.replace("_", "-") if name in own else match.group(0)

    return re.sub(r"\bsweep\.((?:early_stop\.)?\w+)\b(?!\.)", flag, message)


def _run(argv: list[str]) -> int:
    """Check the sweep, then run it with embedded Prefect (unless PREFECT_API_URL is set)."""
    from titan_core.cli.pipeline import prepare_prefect_env

    kwargs = sweep_kwargs(argv)
    prepare_prefect_env()
    from flows.sweep import PROGRESS, sweep
    from titan_core.pipeline.sweep.report import format_table

    # Concurrent trials' progress bars would interleave: off unless asked for.
    kwargs["overrides"].setdefault("storage.progress", False)
    print(f"sweep: {sweep_summary(kwargs)}; every log line is in the Prefect UI")
    with quiet_console(PROGRESS):
        result = sweep(**kwargs)
    print(format_table(result))
    if result.alias:
        print(
            f"best: {result.best.name if result.best else '-'}: model {result.model_name} "
            f"@{result.alias} (v{result.best.model_version if result.best else '-'})"
        )
    print(f"MLflow: sweep run {result.mlflow_run_id} in {result.tracking_uri}")
    return 0


@contextlib.contextmanager
def quiet_console(progress: logging.Logger) -> Iterator[None]:
    """The console of a sweep: its progress lines (``progress``), warnings of this process, and
    the final table; not the trials' interleaved log lines (Prefect's console handlers and the
    in-process stages' ``titan`` logger are quiet meanwhile; the Prefect UI keeps every line).
    Everything is put back after."""
    from prefect.logging.handlers import PrefectConsoleHandler

    from titan_core.logging import init_logger, logger

    init_logger()
    consoles = [
        handler
        for owner in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
        for handler in getattr(owner, "handlers", [])
        if isinstance(handler, PrefectConsoleHandler)
    ]
    mlflow_logger = logging.getLogger("mlflow")
    saved = [h.level for h in consoles], logger.level, mlflow_logger.level
    env = os.environ.get("MLFLOW_LOGGING_LEVEL")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("sweep: %(message)s"))
    try:
        for h in consoles:
            h.setLevel(logging.CRITICAL + 1)
        logger.setLevel(logging.WARNING)
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # "Creating initial tables"
        mlflow_logger.setLevel(logging.WARNING)  # in case MLflow is imported already
        progress.handlers[:] = [handler]
        progress.setLevel(logging.INFO)
        yield
    finally:
        progress.handlers[:] = []
        for h, level in zip(consoles, saved[0], strict=True):
            h.setLevel(level)
        logger.setLevel(saved[1])
        mlflow_logger.setLevel(saved[2])
        if env is None:
            os.environ.pop("MLFLOW_LOGGING_LEVEL", None)


def sweep_summary(kwargs: dict[str, Any]) -> str:
    """What is about to run, in one line."""
    space = " x ".join(f"{k} ({len(v)})" for k, v in (kwargs.get("grid") or {}).items())
    if kwargs.get("random"):
        draws = f"{kwargs['trials']} random draws of {', '.join(kwargs['random'])}"
        space = f"{space}, {draws}" if space else draws
    return f"{space or 'one trial'}, {kwargs['concurrency']} at a time"


def main(argv: list[str] | None = None) -> int:
    """``titan sweep``; user errors print one ``error:`` line and return 2."""
    return run(_run, argv)
