"""``titan compare``: run the ``compare`` flow and print its table.

    titan compare [CONFIG ARGUMENTS] [--experiment NAME] [--runs ID_OR_NAME ...] [--max-runs N]
                  [--log | --parent-run-id RUN_ID] [--json]

``COMMAND``'s description (its ``--help``) says where the runs are read and what is recorded.
The store, the experiment and the runs are checked before Prefect is imported, so bad input is
one ``error:`` line; then Prefect's environment is prepared (as for ``titan pipeline``): a
project-local ``PREFECT_HOME`` unless one is set, analytics off.

The comparison is printed as ``rich`` tables that fit the terminal (``TEXT_WIDTH`` columns when
the output is no terminal): columns that do not fit go to a further table, long values are cut
in the middle. The loss curves are in the flow run's Prefect artifact.
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

from titan_core.cli.command import Command, default, run
from titan_core.cli.pipeline import RENAMED_FLAGS, flow_kwargs, prepare_prefect_env
from titan_core.errors import ConfigError
from titan_core.logging import logs_to_stderr
from titan_core.pipeline.compare import (
    Comparison,
    compare_target,
    open_experiment,
    select_runs,
)
from titan_core.pipeline.compare_view import (
    COLUMNS,
    EVALUATORS_NOTE,
    STATISTICS_NOTE,
    VALUE_WIDTH,
    collapse,
    evaluator_keys,
    fmt,
    short_names,
)
from titan_core.pipeline.run.config import DEFAULT_RECIPE

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

TEXT_WIDTH = 120  # columns of the tables when the output is no terminal (a file, a pipe, a test)
MIN_COLUMN = 9  # characters of a column at the least ("/runs/ab…" is still a hint)
LABEL_WIDTH = 32  # characters of a table's first column (run names, keys) at the most: they wrap


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

    with logs_to_stderr() if ns.json else contextlib.nullcontext():  # stdout: the JSON alone
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
    print_comparison(result)
    if result.compare_run_id:
        print(f"MLflow: run {result.compare_run_id} in {result.tracking_uri}")
    else:
        print("Not recorded in MLflow (--log records it).")
    return 0


def print_comparison(result: Comparison, console: Console | None = None) -> None:
    """The comparison as tables that fit the terminal: a row per run with its numbers, the
    config keys that differ, what differs by construction, and what the numbers are. The loss
    curves are in the Prefect artifact (and MLflow's, logged)."""
    from rich.console import Console

    console = console or Console(width=None if sys.stdout.isatty() else TEXT_WIDTH)
    group, names = short_names([row["run"] for row in result.runs])
    title = f"Comparison of {len(result.runs)} runs in {result.experiment}"
    title += f", the trials of {group}" if group else ""
    tables = _stacked(title, COLUMNS["run"], names, _number_columns(result), console.width)
    if evals := evaluator_keys(result.runs):
        columns = _evaluator_columns(result, evals)
        tables += _stacked(EVALUATORS_TITLE, COLUMNS["run"], names, columns, console.width)
    if result.differing_params:
        tables += _keys_tables(names, result, console.width)
    for table in tables:
        console.print(table)
    if not result.differing_params:
        console.print("Config keys that differ: none, every run has the same config.")
    if result.run_specific_keys:
        named = ", ".join(result.run_specific_keys)
        console.print(
            f"Also different, by construction (a run's own folder, where it is recorded): {named}."
        )
    console.print(STATISTICS_NOTE.replace("`", ""), highlight=False)
    if evals:
        console.print(EVALUATORS_NOTE.replace("`", ""), highlight=False, markup=False)


# A column of a terminal table: its heading, a cell per row, its width, its justification.
Column = tuple[str, list[str], int, str]


def _number_columns(result: Comparison) -> list[Column]:
    """The run id and the ``COLUMNS`` numbers of each run, a column each, as wide as its longest
    cell or heading word (the headings wrap; the numbers have no spaces)."""
    columns = []
    for key in list(COLUMNS)[1:]:
        cells = [row["run_id"][:8] if key == "run_id" else fmt(row[key]) for row in result.runs]
        width = max([*map(len, COLUMNS[key].split()), *map(len, cells)])
        columns.append(
            (COLUMNS[key], cells, width, "left" if key in ("run_id", "status") else "right")
        )
    return columns


EVALUATORS_TITLE = "Evaluators on the final checkpoint (eval/<name>/<metric>)"


def _evaluator_columns(result: Comparison, keys: list[str]) -> list[Column]:
    """A column per ``eval/<name>/<metric>``, headed ``eval/<name>/`` over ``<metric>`` (a
    heading wraps at its space), a cell per run ("—" where it has none)."""
    columns = []
    for key in keys:
        head = key.rpartition("/")[0] + "/ " + key.rpartition("/")[2]
        cells = [fmt(row.get("evals", {}).get(key)) for row in result.runs]
        columns.append((head, cells, max([*map(len, head.split()), *map(len, cells)]), "right"))
    return columns


def _keys_tables(names: list[str], result: Comparison, width: int) -> list[Table]:
    """The config keys that differ and each run's value (long ones cut in the middle), the
    fewer of keys and runs across."""
    diff = result.differing_params
    values = [
        [
            fmt(v if (v := diff[key].get(row["run_id"])) is None else collapse(v))
            for row in result.runs
        ]
        for key in diff
    ]  # values[key][run]

    def column(head: str, cells: list[str]) -> Column:
        return head, cells, min(max(map(len, [head, *cells])), VALUE_WIDTH), "left"

    title = "Config keys that differ"
    if len(diff) <= len(names):  # a row per run, a column per key
        columns = [column(key, cells) for key, cells in zip(diff, values, strict=True)]
        return _stacked(title, COLUMNS["run"], names, columns, width)
    columns = [column(name, [cells[i] for cells in values]) for i, name in enumerate(names)]
    return _stacked(title, "key", list(diff), columns, width)


def _stacked(
    title: str, corner: str, labels: list[str], columns: list[Column], width: int
) -> list[Table]:
    """Tables of ``labels`` (a row each, under ``corner``) and ``columns``, as many columns per
    table as fit in ``width`` characters: rich would squeeze a table wider than the terminal
    until it drops columns."""
    from rich import box
    from rich.table import Table

    label = min(max(map(len, [corner, *labels])), LABEL_WIDTH)
    room = max(MIN_COLUMN + 3, width - 4 - label)  # a column costs its width and 3 characters
    chunks: list[list[Column]] = [[]]
    used = 0
    for col in columns:
        cost = min(col[2], room - 3) + 3
        if chunks[-1] and used + cost > room:
            chunks.append([])
            used = 0
        chunks[-1].append(col)
        used += cost
    tables = []
    for i, chunk in enumerate(chunks):
        table = Table(title=title if i == 0 else None, box=box.SIMPLE)
        table.add_column(corner, width=label)
        for head, _, col_width, justify in chunk:
            table.add_column(
                head, width=min(col_width, room - 3), justify=justify, overflow="ellipsis"
            )  # type: ignore[arg-type]
        for row, text in enumerate(labels):
            table.add_row(text, *(cells[row] for _, cells, _, _ in chunk))
        tables.append(table)
    return tables
