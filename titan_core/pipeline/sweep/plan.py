"""Hyperparameter sweeps without an orchestrator: trials from a grid or a seeded random search
over dotted config keys, their names, the best trial, and the comparison people read.

The ``sweep`` flow (flows/sweep.py) runs the trials and reads their MLflow runs; everything it
decides (which trials, what they are called, which one won, what the report says) is here.
"""

from __future__ import annotations

import itertools
import math
import random as random_module
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from titan_core.config.job import JobConfig, parse_evaluators
from titan_core.config.metrics import LIVE_METRICS, RUN_METRICS, check_metric
from titan_core.errors import ConfigError, TitanError
from titan_core.pipeline.run.paths import RunPaths, absolute
from titan_core.pipeline.run.tracking import resolve_tracking_uri
from titan_core.pipeline.sweep.early_stop import EarlyStopping, early_stopping

# Keys a sweep cannot vary: every trial must land in the same experiment, tracking store and
# registered model for the trials to nest under one MLflow run and be compared.
FIXED_KEYS = ("job.experiment", "job.dump_folder", "tracking.uri", "tracking.enable")
FIXED_KEYS += ("tracking.registered_model",)
RANDOM_KINDS = ("log_uniform", "uniform", "int_uniform", "choice")
BEST_ALIAS = "sweep-best"  # the registered-model alias of a sweep's best trial
SIGNIFICANT = 4  # digits kept of a drawn float: readable names, no false precision


TRIAL_METRICS = RUN_METRICS
"""Metrics every trial's pipeline run logs, evaluators aside: any of them, or an evaluator's
``eval/<name>/<metric>``, picks the best trial, in its direction (``titan_core.config.metrics``)."""


def check_trial_metrics(cfg: JobConfig, metric: str, rule: EarlyStopping) -> None:
    """One ConfigError line unless every trial (``cfg``) logs the sweep's ``metric`` (at the
    end) and, with early stopping, ``rule.metric`` (while it trains)."""
    evaluators = {e.name: e.kind for e in parse_evaluators(cfg.evaluators.sets)}
    check_metric(metric, "sweep.metric", evaluators)
    if rule.enable:
        check_metric(rule.metric, "sweep.early_stop.metric", evaluators, LIVE_METRICS)


@dataclass(frozen=True)
class Trial:
    """One configuration of a sweep: its 1-based index and the swept keys' values."""

    index: int
    values: tuple[tuple[str, Any], ...]

    @property
    def overrides(self) -> dict[str, Any]:
        """The swept values as dotted-key overrides."""
        return dict(self.values)

    def label(self, keys: Sequence[str] | None = None) -> str:
        """``trial-3 lr=0.003 steps=3``: the trial's name in Prefect, MLflow and tables."""
        shown = short_keys([k for k, _ in self.values] if keys is None else keys)
        parts = [f"{shown[k]}={format_value(v)}" for k, v in self.values]
        return " ".join([f"trial-{self.index}", *parts])


def short_keys(keys: Sequence[str]) -> dict[str, str]:
    """Each key's field name (``optimizer.lr`` -> ``lr``), or the full key where two clash."""
    names = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (n if names.count(n) == 1 else k) for k, n in zip(keys, names)}


def format_value(value: Any) -> str:
    """A swept value as written in names and tables (floats in ``%g``)."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def check_keys(keys: Sequence[str], where: str) -> None:
    """One-line ``ConfigError`` for a key the config does not have or a sweep cannot vary."""
    from titan_core.config.schema import did_you_mean, schema

    specs = schema()
    for key in (k.replace("-", "_") for k in keys):
        if key not in specs:
            hint = did_you_mean(key, specs, "")
            raise ConfigError(f"{where}: unknown config key {key!r}{hint}")
        if key in FIXED_KEYS:
            raise ConfigError(
                f"{where}: {key} cannot be swept (every trial shares the experiment, tracking "
                "and storage of the sweep); set it in the base config"
            )


def grid_cells(grid: Mapping[str, Sequence[Any]]) -> list[tuple[tuple[str, Any], ...]]:
    """The cartesian product of the grid, the first key varying slowest."""
    for key, values in grid.items():
        if isinstance(values, str | bytes) or not isinstance(values, Sequence) or not values:
            raise ConfigError(f"sweep.grid.{key}: expected a non-empty list of values")
    keys = list(grid)
    return [tuple(zip(keys, combo)) for combo in itertools.product(*grid.values())]


def _check_spec(key: str, spec: Any) -> tuple[str, list[Any]]:
    """The (kind, arguments) of a random-search spec, or a one-line ``ConfigError``."""
    where = f"sweep.random.{key}"
    expected = (
        f"{where}: expected one of {{{', '.join(k + ': [...]' for k in RANDOM_KINDS)}}}"
        " (e.g. {'log_uniform': [1e-4, 1e-2]})"
    )
    if not isinstance(spec, Mapping) or len(spec) != 1:
        raise ConfigError(f"{expected}, got {spec!r}")
    kind, args = next(iter(spec.items()))
    if kind not in RANDOM_KINDS or not isinstance(args, Sequence) or isinstance(args, str):
        raise ConfigError(f"{expected}, got {spec!r}")
    args = list(args)
    if kind == "choice":
        if not args:
            raise ConfigError(f"{where}: choice needs at least one value")
        return kind, args
    numbers = all(isinstance(a, int | float) and not isinstance(a, bool) for a in args)
    if len(args) != 2 or not numbers or not args[0] < args[1]:
        raise ConfigError(f"{where}: {kind} expected [low, high] with low < high, got {args!r}")
    if kind == "log_uniform" and args[0] <= 0:
        raise ConfigError(f"{where}: log_uniform expected low > 0, got {args[0]!r}")
    if kind == "int_uniform" and not all(isinstance(a, int) for a in args):
        raise ConfigError(f"{where}: int_uniform expected int bounds, got {args!r}")
    return kind, args


def _draw(rng: random_module.Random, kind: str, args: list[Any]) -> Any:
    """One value of a checked spec."""
    if kind == "choice":
        return rng.choice(args)
    if kind == "int_uniform":
        return rng.randint(args[0], args[1])
    if kind == "uniform":
        value = rng.uniform(args[0], args[1])
    else:
        value = math.exp(rng.uniform(math.log(args[0]), math.log(args[1])))
    return float(f"{value:.{SIGNIFICANT}g}")


def random_draws(
    space: Mapping[str, Any], trials: int, seed: int
) -> list[tuple[tuple[str, Any], ...]]:
    """``trials`` seeded draws from ``space``: the same seed gives the same draws."""
    if trials < 1:
        raise ConfigError(f"sweep.trials: expected an int >= 1 with random, got {trials!r}")
    specs = {key: _check_spec(key, spec) for key, spec in sorted(space.items())}
    rng = random_module.Random(seed)
    return [
        tuple((key, _draw(rng, kind, args)) for key, (kind, args) in specs.items())
        for _ in range(trials)
    ]


def expand(
    grid: Mapping[str, Sequence[Any]] | None = None,
    random: Mapping[str, Any] | None = None,
    trials: int = 4,
    seed: int = 0,
) -> list[Trial]:
    """The sweep's trials: every grid cell, or ``trials`` random draws, or (both given) every
    cell combined with every draw. Keys are checked first: one line, nothing run."""
    grid, random = dict(grid or {}), dict(random or {})
    if not grid and not random:
        raise ConfigError("sweep: nothing to sweep; give a grid or a random search space")
    both = sorted(set(grid) & set(random))
    if both:
        raise ConfigError(f"sweep: {', '.join(both)} is both in the grid and the random space")
    check_keys(list(grid), "sweep.grid")
    check_keys(list(random), "sweep.random")
    cells = grid_cells(grid) if grid else [()]
    draws = random_draws(random, trials, seed) if random else [()]
    combos = [cell + draw for draw in draws for cell in cells]
    return [Trial(index=i, values=values) for i, values in enumerate(combos, start=1)]


def parse_text(key: str, text: str) -> Any:
    """One CLI value for ``key`` in the field's type (``1e-3`` -> 0.001 for a float field)."""
    from titan_core.config.schema import from_text, schema

    spec = schema()[key]
    try:
        if spec.kind == "bool":
            return {"true": True, "false": False}[text.lower()]
        if spec.kind == "list":
            raise ValueError(text)  # commas separate the swept values
        return from_text(spec, text)
    except (KeyError, ValueError):
        raise ConfigError(f"{key}: expected {spec.describe()}, got {text!r}") from None


def _split_assignment(arg: str, flag: str, example: str) -> tuple[str, str]:
    """``KEY=REST`` of a CLI argument, the key checked."""
    key, eq, rest = arg.partition("=")
    if not eq or not key or not rest:
        raise ConfigError(f"{flag} {arg!r}: expected KEY=VALUES, e.g. {flag} {example}")
    check_keys([key], flag)
    return key, rest


def parse_grid_arg(arg: str) -> tuple[str, list[Any]]:
    """``--grid optimizer.lr=1e-3,3e-3`` -> ``("optimizer.lr", [0.001, 0.003])``."""
    key, rest = _split_assignment(arg, "--grid", "optimizer.lr=1e-3,3e-3")
    return key, [parse_text(key, text) for text in rest.split(",")]


def parse_random_arg(arg: str) -> tuple[str, dict[str, list[Any]]]:
    """``--random optimizer.lr=log_uniform:1e-4,1e-2`` -> ``("optimizer.lr", {...})``."""
    key, rest = _split_assignment(arg, "--random", "optimizer.lr=log_uniform:1e-4,1e-2")
    kind, colon, args = rest.partition(":")
    if not colon or kind not in RANDOM_KINDS:
        raise ConfigError(
            f"--random {arg!r}: expected KEY=KIND:ARGS with KIND one of {', '.join(RANDOM_KINDS)}"
        )
    texts = args.split(",")
    if kind == "choice":
        return key, {kind: [parse_text(key, t) for t in texts]}
    try:
        bounds = [int(t) if kind == "int_uniform" else float(t) for t in texts]
    except ValueError:
        raise ConfigError(f"--random {arg!r}: {kind} expected numeric LOW,HIGH") from None
    spec = {kind: bounds}
    _check_spec(key, spec)
    return key, spec


class SweepError(TitanError):
    """Every trial of a sweep failed: one line with the first trial's error."""

    exit_code = 1


@dataclass(frozen=True)
class TrialOutcome:
    """How a trial's run ended, as the orchestrator saw it."""

    index: int
    run_id: str
    status: str  # "completed" or "failed" (a trial stopped early completes its pipeline)
    error: str = ""


@dataclass(frozen=True)
class SweepPlan:
    """A sweep checked and expanded: every trial's config has resolved before any runs."""

    sweep_id: str
    recipe: str
    config_file: str
    base: tuple[tuple[str, Any], ...]  # dotted-key overrides every trial shares
    trials: tuple[Trial, ...]
    keys: tuple[str, ...]
    experiment: str
    model_name: str
    metric: str
    concurrency: int
    root: str  # the output root every trial writes under, absolute (job.dump_folder)
    pinned: tuple[tuple[str, Any], ...]  # where trials record: the same for every trial
    early_stop: EarlyStopping = field(default_factory=EarlyStopping)
    champion_metric: str = "eval/loss"  # the trials' champion rule (tracking.champion_metric)

    def overrides(self, trial: Trial) -> dict[str, Any]:
        """The trial's overrides: the base's, the sweep's pinned root, tracking store and
        registered model (a trial on a work pool resolves nothing relative to its worker), the
        swept values."""
        return {**dict(self.base), **dict(self.pinned), **trial.overrides}

    def run_root(self, trial: Trial) -> str:
        """Where the trial's run writes: ``<root>/<experiment>/<run id>``."""
        return RunPaths(self.root, self.experiment, self.run_id(trial)).run_root

    def run_id(self, trial: Trial) -> str:
        """The trial's run id (its run root and MLflow run name): ``<sweep id>-t<index>``."""
        return f"{self.sweep_id}-t{trial.index}"

    def name(self, trial: Trial) -> str:
        """The trial's Prefect name: ``sweep-<id>/trial-3 lr=0.003 steps=3``."""
        return f"sweep-{self.sweep_id}/{trial.label(self.keys)}"

    def definition(self) -> dict[str, str]:
        """The sweep as MLflow params of its parent run."""
        params = {"sweep.recipe": self.recipe, "sweep.trials": str(len(self.trials))}
        params |= {"sweep.metric": self.metric, "sweep.concurrency": str(self.concurrency)}
        if self.early_stop.enable:
            rule = self.early_stop.model_dump(exclude={"enable"})
            params["sweep.early_stop"] = " ".join(f"{k}={v}" for k, v in rule.items())
        if self.config_file:
            params["sweep.config_file"] = self.config_file
        for key in self.keys:
            seen = dict.fromkeys(format_value(t.overrides[key]) for t in self.trials)
            params[f"sweep.values.{key}"] = ",".join(seen)[:500]  # MLflow's param value limit
        params |= {f"sweep.base.{k}": str(v)[:500] for k, v in self.base}
        return params


def plan_sweep(
    sweep_id: str,
    recipe: str,
    config_file: str,
    base: Mapping[str, Any],
    *,
    grid: Mapping[str, Sequence[Any]] | None = None,
    random: Mapping[str, Any] | None = None,
    trials: int = 4,
    seed: int = 0,
    concurrency: int = 2,
    metric: str = "eval/loss",
    early_stop: Any = None,
) -> SweepPlan:
    """Expand the sweep and resolve every trial's config: a bad key, value or combination is a
    one-line ``ConfigError`` (naming the trial) before anything runs. ``early_stop``: None, a
    mapping or ``EarlyStopping`` (the median stopping rule; off by default)."""
    from titan_core.resolve import resolve_job

    if concurrency < 1:
        raise ConfigError(f"sweep.concurrency: expected an int >= 1, got {concurrency!r}")
    rule = early_stopping(early_stop)
    expanded = expand(grid, random, trials, seed)
    cfg = resolve_job(recipe, config_file, dict(base))
    check_trial_metrics(cfg, metric, rule)
    if not cfg.tracking.enable:
        raise ConfigError("tracking.enable: a sweep compares its trials in MLflow; expected true")
    keys = tuple(k for k, _ in expanded[0].values)
    root = absolute(cfg.job.dump_folder)
    model_name = f"{cfg.tracking.registered_model or cfg.job.experiment}-sweep"
    pinned = {"job.dump_folder": root, "tracking.registered_model": model_name}
    uri = resolve_tracking_uri(cfg)
    if uri.startswith("sqlite:///"):  # a file next to the root; a server URI may hold credentials
        pinned["tracking.uri"] = uri
    plan = SweepPlan(
        sweep_id=sweep_id,
        recipe=recipe,
        config_file=config_file,
        base=tuple(base.items()),
        trials=tuple(expanded),
        keys=keys,
        experiment=cfg.job.experiment,
        # Trials register into a model of their own: never the production model's versions and
        # champion alias (each trial's publish stage runs the champion rule in its model).
        model_name=model_name,
        metric=metric,
        concurrency=concurrency,
        root=root,
        pinned=tuple(pinned.items()),
        early_stop=rule,
        champion_metric=cfg.tracking.champion_metric,
    )
    for trial in plan.trials:
        try:
            trial_cfg = resolve_job(recipe, config_file, plan.overrides(trial))
            check_trial_metrics(trial_cfg, metric, rule)
        except ConfigError as e:
            raise ConfigError(f"{trial.label(keys)}: {e}") from None
    return plan
