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

from titan_core.errors import ConfigError, TitanError


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
    """``titan compare``: run the compare flow and print its table."""
    from flows.cli import OneLineParser, add_renamed_flags

    parser = OneLineParser(
        prog="titan compare",
        description="Compare MLflow runs of one experiment.",
        allow_abbrev=False,
    )
    parser.add_argument("--experiment", required=True, help="MLflow experiment (job.experiment)")
    parser.add_argument("--runs", nargs="+", default=[], help="run ids or names (default: newest)")
    parser.add_argument(
        "--tracking.uri",
        dest="tracking_uri",
        default="",
        help="MLflow URI (default: $MLFLOW_TRACKING_URI, else ./outputs)",
    )
    add_renamed_flags(parser)  # --tracking-uri: one line naming --tracking.uri
    parser.add_argument("--max-runs", type=int, default=10, help="newest runs when --runs absent")
    parser.add_argument(
        "--log", action="store_true", help="record the comparison as an MLflow run (compare-*)"
    )
    parser.add_argument(
        "--parent-run-id", default="", help="record it nested under this MLflow run (implies --log)"
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    try:
        ns = parser.parse_args(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from flows.cli import prepare_prefect_env

    prepare_prefect_env()
    from titan_core.pipeline.compare import default_tracking_uri

    uri = ns.tracking_uri or default_tracking_uri()
    try:
        if ns.max_runs < 1:
            raise ConfigError(f"compare.max_runs: expected an int >= 1, got {ns.max_runs}")
        _preflight(ns.experiment, uri)
        from flows.compare import compare

        result = compare(ns.experiment, ns.runs or None, uri, ns.max_runs, ns.log, ns.parent_run_id)
    except TitanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
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
