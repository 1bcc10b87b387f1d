"""``titan compare``: run the ``compare`` flow and print its table.

    titan compare [CONFIG ARGUMENTS] [--experiment NAME] [--runs ID_OR_NAME ...] [--max-runs N]
                  [--log | --parent-run-id RUN_ID] [--json]

``COMMAND``'s description (its ``--help``) says where the runs are read and what is recorded.
The store, the experiment and the runs are checked before Prefect is imported, so bad input is
one ``error:`` line; then Prefect's environment is prepared (as for ``titan pipeline``): a
project-local ``PREFECT_HOME`` unless one is set, analytics off.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated

from titan_core.cli.command import Command, default, run
from titan_core.cli.pipeline import RENAMED_FLAGS, flow_kwargs, prepare_prefect_env
from titan_core.errors import ConfigError
from titan_core.pipeline.compare import compare_target, open_experiment, select_runs
from titan_core.pipeline.run.config import DEFAULT_RECIPE


@dataclass(kw_only=True)
class CompareOptions:
    """The options of ``titan compare``."""

    experiment: Annotated[str, default("the config's job.experiment")] = ""
    """alias of --job.experiment: the MLflow experiment"""
    runs: Annotated[list[str], default("the newest --max-runs")] = field(default_factory=list)
    """run ids or names"""
    max_runs: int = 10
    """newest runs compared when --runs is not given"""
    log: bool = False
    """record the comparison as an MLflow run (compare-*)"""
    parent_run_id: Annotated[str, default("none")] = ""
    """record it nested under this MLflow run (implies --log)"""
    json: bool = False
    """print the result as JSON"""


COMMAND = Command(
    "titan compare",
    CompareOptions,
    f"Run the compare flow and print its table. The runs are those a pipeline run of the config "
    f"records (without --config or --config-file the recipe is {DEFAULT_RECIPE}): experiment "
    "job.experiment (--experiment is an alias), in the MLflow store tracking.uri, else "
    "MLFLOW_TRACKING_URI, else <job.dump_folder>/mlflow.db. --log also records the comparison "
    "(loss-curve PNG, markdown with the image embedded, JSON) as an MLflow run of the "
    "experiment, --parent-run-id nests that run under another; without either, MLflow is only "
    "read.",
    aliases={"experiment": "job.experiment"},
    renamed=RENAMED_FLAGS,
)


def main(argv: list[str] | None = None) -> int:
    """``titan compare``: run the compare flow and print its table; user errors print one
    ``error:`` line and return 2."""
    return run(_compare, argv)


def _compare(argv: list[str]) -> int:
    """Resolve the config, check its store has the experiment and the runs, then run the flow."""
    parsed = COMMAND.parse(argv)
    ns = parsed.options
    if ns.max_runs < 1:
        raise ConfigError(f"--max-runs: expected an int >= 1, got {ns.max_runs}")
    kwargs = flow_kwargs(parsed.config)
    kwargs["overrides"] |= COMMAND.alias_values(parsed)
    experiment, uri = compare_target(kwargs["recipe"], kwargs["config_file"], kwargs["overrides"])
    # One line before Prefect starts: no store, no experiment, an unknown run, no runs.
    client, experiment_id = open_experiment(experiment, uri)
    select_runs(client, experiment_id, experiment, ns.runs, ns.max_runs)
    prepare_prefect_env()
    from flows.compare import compare

    result = compare(
        **kwargs,
        runs=ns.runs or None,
        max_runs=ns.max_runs,
        log=ns.log,
        parent_run_id=ns.parent_run_id,
    )
    if ns.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    print(result.table_markdown)  # the image is in the Prefect artifact (and MLflow's, logged)
    if result.compare_run_id:
        print(f"MLflow: run {result.compare_run_id} in {result.tracking_uri}")
    else:
        print("Not recorded in MLflow (--log records it).")
    return 0
