"""``titan compare``: run the ``compare`` flow and print its table.

    titan compare --experiment NAME [--runs ID_OR_NAME ...] [--tracking.uri URI] [--max-runs N]
                  [--log | --parent-run-id RUN_ID] [--json]

It prints the table; ``--log`` also records the comparison (loss-curve PNG, markdown with the
image embedded, JSON) as an MLflow run of the experiment, ``--parent-run-id`` nests that run
under another. Without either, MLflow is only read.

Prefect is imported only after its environment is prepared (as for ``titan pipeline``): a
project-local ``PREFECT_HOME`` unless one is set, analytics off.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Annotated

from flows.cli import RENAMED_FLAGS
from titan_core.config.command import Command, default, run
from titan_core.errors import ConfigError


@dataclass
class Tracking:
    """Where the runs are tracked."""

    uri: Annotated[str, default("$MLFLOW_TRACKING_URI, else ./outputs")] = ""
    """MLflow tracking URI"""


@dataclass(kw_only=True)
class CompareOptions:
    """The options of ``titan compare``."""

    experiment: str
    """MLflow experiment (a run's job.experiment)"""
    runs: Annotated[list[str], default("the newest --max-runs")] = field(default_factory=list)
    """run ids or names"""
    tracking: Tracking = field(default_factory=Tracking)
    max_runs: int = 10
    """newest runs compared when --runs is not given"""
    log: bool = False
    """record the comparison as an MLflow run (compare-*)"""
    parent_run_id: Annotated[str, default("none")] = ""
    """record it nested under this MLflow run (implies --log)"""
    json: bool = False
    """print the result as JSON"""


COMMAND = Command(
    "titan compare", CompareOptions, __doc__ or "", takes_config=False, renamed=RENAMED_FLAGS
)


def _preflight(experiment: str, tracking_uri: str) -> None:
    """One-line errors before Prefect starts: the server answers, the experiment exists."""
    from mlflow import MlflowClient

    from titan_core.pipeline.tracking import check_tracking

    check_tracking(tracking_uri)
    if MlflowClient(tracking_uri=tracking_uri).get_experiment_by_name(experiment) is None:
        raise ConfigError(
            f"compare.experiment: no MLflow experiment named {experiment!r} at {tracking_uri}"
        )


def main(argv: list[str] | None = None) -> int:
    """``titan compare``: run the compare flow and print its table; user errors print one
    ``error:`` line and return 2."""
    return run(_compare, argv)


def _compare(argv: list[str]) -> int:
    ns = COMMAND.parse(argv).options
    if ns.max_runs < 1:
        raise ConfigError(f"--max-runs: expected an int >= 1, got {ns.max_runs}")
    from flows.cli import prepare_prefect_env

    prepare_prefect_env()
    from titan_core.pipeline.compare import default_tracking_uri

    uri = ns.tracking.uri or default_tracking_uri()
    _preflight(ns.experiment, uri)
    from flows.compare import compare

    result = compare(ns.experiment, ns.runs or None, uri, ns.max_runs, ns.log, ns.parent_run_id)
    if ns.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    print(result.table_markdown)  # the image is in the Prefect artifact (and MLflow's, logged)
    if result.compare_run_id:
        print(f"MLflow: run {result.compare_run_id} in {result.tracking_uri}")
    else:
        print("Not recorded in MLflow (--log records it).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
