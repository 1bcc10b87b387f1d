"""``titan sweep``: run the ``sweep`` flow from the command line and print its table.

    titan sweep [--config RECIPE [--module FAMILY]] [--config-file F]
                [--grid KEY=V1,V2 ...] [--random KEY=KIND:ARGS ... --trials N --seed S]
                [--concurrency N] [--metric NAME] [--deployment NAME] [--section.field value ...]

``--grid optimizer.lr=1e-3,3e-3 --grid training.steps=20,40`` runs the 4 combinations;
``--random optimizer.lr=log_uniform:1e-4,1e-2 --trials 8 --seed 0`` draws 8 (KIND: log_uniform,
uniform, int_uniform LOW,HIGH or choice V1,V2,...). Every trial's config is resolved before
Prefect starts: a bad key or value is one ``error:`` line and nothing runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from flows.cli import OneLineParser, add_config_args, flow_kwargs, report_errors
from titan_core.errors import ConfigError


def build_parser() -> OneLineParser:
    """The ``titan sweep`` parser; unknown ``--section.field`` tokens are shared overrides."""
    parser = OneLineParser(
        prog="titan sweep",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add_config_args(parser)
    parser.add_argument(
        "--grid", action="append", default=[], metavar="KEY=V1,V2", help="grid values of a key"
    )
    parser.add_argument(
        "--random",
        action="append",
        default=[],
        metavar="KEY=KIND:ARGS",
        help="random-search distribution of a key (log_uniform|uniform|int_uniform|choice)",
    )
    parser.add_argument("--trials", type=int, default=0, help="random draws (with --random)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random search")
    parser.add_argument("--concurrency", type=int, default=2, help="trials at the same time")
    parser.add_argument("--metric", default="eval/loss", help="picks the best trial (lowest)")
    parser.add_argument(
        "--deployment", default="", help="run trials as runs of this pretrain_pipeline deployment"
    )
    return parser


def sweep_kwargs(argv: list[str]) -> dict[str, Any]:
    """The ``sweep`` flow's arguments from ``argv``; every trial's config is resolved here."""
    from titan_core.pipeline.sweep import parse_grid_arg, parse_random_arg, plan_sweep

    ns, rest = build_parser().parse_known_args(argv)
    pipeline = flow_kwargs(ns, rest)
    grid = dict(parse_grid_arg(arg) for arg in ns.grid)
    random = dict(parse_random_arg(arg) for arg in ns.random)
    if ns.trials and not random:
        raise ConfigError("--trials: counts random draws; give --random KEY=KIND:ARGS too")
    kwargs = {
        **pipeline,
        "grid": grid,
        "random": random,
        "trials": ns.trials or 4,
        "seed": ns.seed,
        "concurrency": ns.concurrency,
        "metric": ns.metric,
        "deployment": ns.deployment,
    }
    plan_args = {k: kwargs[k] for k in ("grid", "random", "trials", "seed", "concurrency")}
    plan_sweep(
        "check",
        kwargs["recipe"],
        kwargs["config_file"],
        kwargs["overrides"],
        metric=ns.metric,
        **plan_args,
    )
    return kwargs


def _run(argv: list[str]) -> int:
    """Check the sweep, then run it with embedded Prefect (unless PREFECT_API_URL is set)."""
    from flows.cli import prepare_prefect_env

    kwargs = sweep_kwargs(argv)
    prepare_prefect_env()
    from flows.sweep import sweep
    from titan_core.pipeline.sweep_report import format_table

    result = sweep(**kwargs)
    print(format_table(result))
    if result.alias:
        print(
            f"best: {result.best.name if result.best else '-'}: model {result.model_name} "
            f"@{result.alias} (v{result.best.model_version if result.best else '-'})"
        )
    print(f"MLflow: sweep run {result.mlflow_run_id} in {result.tracking_uri}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``titan sweep``; user errors print one ``error:`` line and return 2."""
    return report_errors(_run, sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
    sys.exit(main())
