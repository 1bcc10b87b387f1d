"""``titan pipeline``: run the Prefect flows from the command line (embedded Prefect, no server).

    titan pipeline run [--config RECIPE [--module FAMILY]] [--config-file F] [--run-id ID]
                       [--section.field v ...]   # e.g. --storage.root URL --tracking.uri URI
                                                 #      --evaluate.batches N
    titan pipeline deploy [--pool NAME] [--name DEPLOYMENT ...] [--prefect-file FILE]

Without ``PREFECT_API_URL`` Prefect starts a temporary local server whose database lives under
``PREFECT_HOME`` (default ``./outputs/.prefect``); analytics are off. ``titan demo`` runs the
pipeline on the debug model with embedded defaults (and continues its model line when rerun).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn

from titan_core.errors import ConfigError, TitanError

DEFAULT_PREFECT_HOME = os.path.join("outputs", ".prefect")


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one-line ConfigErrors."""

    def error(self, message: str) -> NoReturn:
        """Raise instead of printing usage and exiting."""
        raise ConfigError(f"{self.prog}: {message}")


def prepare_prefect_env() -> str:
    """Point Prefect at a project-local home (unless set) with analytics off; returns the home.

    Must run before Prefect is imported: it reads its settings once.
    """
    home = os.path.abspath(os.environ.setdefault("PREFECT_HOME", DEFAULT_PREFECT_HOME))
    os.environ["PREFECT_HOME"] = home
    os.makedirs(home, exist_ok=True)  # Prefect creates only the last path component
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT", "false")
    # The temporary server migrates a new database on its first start: slow on a busy machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    from flows.console import quiet_user_errors

    quiet_user_errors()  # a user error in a flow: one line on the console, not a traceback
    return home


def build_parser() -> OneLineParser:
    """The ``titan pipeline`` parser; unknown ``--section.field`` tokens are config overrides."""
    parser = OneLineParser(
        prog="titan pipeline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="run pretrain_pipeline locally",
        description="Run pretrain_pipeline in this process. Every other --section.field VALUE is "
        "a config override, e.g. --storage.root URL, --tracking.uri URI, --evaluate.batches N "
        "(titan config --help lists them all).",
        allow_abbrev=False,
    )
    add_config_args(run)
    run.add_argument("--run-id", default="", help="reuse a run root (resumes its training)")
    from flows.deploy import add_arguments as add_deploy_arguments

    deploy = sub.add_parser(
        "deploy", help="register deployments/prefect.yaml on a Prefect server", allow_abbrev=False
    )
    add_deploy_arguments(deploy)
    return parser


# Flags that became config keys: one spelling per setting, the config's.
RENAMED_FLAGS = {
    "--storage": "--storage.root",
    "--tracking-uri": "--tracking.uri",
    "--eval-batches": "--evaluate.batches",
}


class _Renamed(argparse.Action):
    """A flag that became a config key: refused in one line naming the key."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: str | None = None) -> None:
        """Raise the one-line error."""
        new = RENAMED_FLAGS[str(option)]
        raise ConfigError(f"{option}: now the config key {new}; use {new} VALUE")


def add_renamed_flags(parser: argparse.ArgumentParser) -> None:
    """Refuse the old spellings of config keys (hidden from --help)."""
    for old in RENAMED_FLAGS:
        parser.add_argument(old, action=_Renamed, nargs="?", help=argparse.SUPPRESS)


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """The config-selection flags shared by the pipeline commands."""
    parser.add_argument(
        "--config", default="", help="registry recipe (default llama3_debugmodel without a file)"
    )
    parser.add_argument(
        "--module", default="", help="model family of --config (optional: recipe names are unique)"
    )
    parser.add_argument("--config-file", default="", help="TOML job config")
    add_renamed_flags(parser)


def flow_kwargs(ns: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    """``pretrain_pipeline`` arguments from parsed flags: the recipe, the file and the
    ``--section.field value`` overrides as typed dotted keys; checks the config resolves first."""
    from titan_core.config.resolve import cli_values, resolve_job

    if ns.module and not ns.config:
        raise ConfigError("--module: names the family of --config (e.g. --config llama3_8b)")
    recipe = ns.config or ("" if ns.config_file else "llama3_debugmodel")
    if ns.module:
        recipe = f"{ns.module}/{recipe}"
    values = cli_values(overrides)
    # Resolve once here: a bad key is one line now, not a failed flow run.
    resolve_job(recipe, ns.config_file, values)
    return {"recipe": recipe, "config_file": ns.config_file, "overrides": values}


def where_to_look(result: dict[str, Any], prefect_home: str) -> str:
    """The lines printed after a run: artifacts, the MLflow UI and the Prefect UI commands."""
    lines = [
        f"pipeline: run {result['run_id']} done; artifacts in {result['run_root']}",
        f"  Hugging Face export: {result['hf']}   eval report: {result['eval_report']}",
    ]
    if result.get("dataset"):
        lines.append(
            f"  prepared dataset: {result['dataset']} ({result['dataset_train_shards']} train "
            f"shards, {result['dataset_train_tokens']:,} train tokens)"
        )
    if result.get("model_version"):
        role = "champion" if result.get("champion") else "not champion"
        lines.append(
            f"  model {result['model_name']} v{result['model_version']} ({role}); "
            f"eval loss {result['metrics'].get('eval/loss', float('nan')):.4f}"
        )
    if result.get("tracking_uri"):
        uri = result["tracking_uri"]
        lines.append(f"  MLflow UI:  mlflow ui --backend-store-uri {uri}")
    if os.environ.get("PREFECT_API_URL"):
        lines.append(f"  Prefect UI: {os.environ['PREFECT_API_URL'].removesuffix('/api')}")
    else:
        lines.append(
            f"  Prefect UI: PREFECT_HOME={prefect_home} prefect server start  "
            "(then open http://127.0.0.1:4200)"
        )
    return "\n".join(lines)


def run_pipeline(kwargs: dict[str, Any], run_id: str = "") -> dict[str, Any]:
    """Run ``pretrain_pipeline`` in this process."""
    from flows.pipeline import pretrain_pipeline

    return pretrain_pipeline(**kwargs, run_id=run_id)


def report_errors(fn: Any, *args: Any) -> int:
    """Call ``fn``; print a user error or a failed launch as one ``error:`` line."""
    from titan_core.launch import LaunchError

    try:
        return fn(*args)
    except TitanError as e:
        print("error: " + str(e).replace("\n", " "), file=sys.stderr)
        return 2
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _run(ns: argparse.Namespace, overrides: list[str]) -> int:
    home = prepare_prefect_env()
    result = run_pipeline(flow_kwargs(ns, overrides), ns.run_id)
    print(where_to_look(result, home))
    return 0


def _deploy(ns: argparse.Namespace, rest: list[str]) -> int:
    # No project-local PREFECT_HOME here: the server may be set in the user's Prefect profile.
    if rest:
        raise ConfigError(f"titan pipeline deploy: unrecognized arguments: {' '.join(rest)}")
    from flows.deploy import deploy

    return deploy(ns.prefect_file, ns.pool, ns.names, ns.pool_type)


COMMANDS = {"run": _run, "deploy": _deploy}


def main(argv: list[str] | None = None) -> int:
    """Run one ``titan pipeline`` command; user errors print one line and return 2."""

    def dispatch() -> int:
        """Parse and run the subcommand."""
        ns, rest = build_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
        return COMMANDS[ns.command](ns, rest)

    return report_errors(dispatch)


if __name__ == "__main__":
    sys.exit(main())
