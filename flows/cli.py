"""``titan pipeline``: run the Prefect flows from the command line (embedded Prefect, no server).

    titan pipeline run [--module M --config C | --config-file F] [--storage URL]
                       [--tracking-uri URI] [--run-id ID] [--eval-batches N] [--section.field v ...]
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
    run = sub.add_parser("run", help="run pretrain_pipeline locally", allow_abbrev=False)
    add_config_args(run)
    run.add_argument("--run-id", default="", help="reuse a run root (resumes its training)")
    from flows.deploy import add_arguments as add_deploy_arguments

    deploy = sub.add_parser(
        "deploy", help="register deployments/prefect.yaml on a Prefect server", allow_abbrev=False
    )
    add_deploy_arguments(deploy)
    return parser


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """The config-selection flags shared by the pipeline commands."""
    parser.add_argument("--module", default="", help="config registry module (with --config)")
    parser.add_argument("--config", default="", help="config registry function (with --module)")
    parser.add_argument("--config-file", default="", help="TOML job config")
    parser.add_argument("--storage", default="", help="run root: a folder or s3://bucket/prefix")
    parser.add_argument("--tracking-uri", default="", help="MLflow tracking URI")
    parser.add_argument("--eval-batches", type=int, default=20, help="eval batches; 0 = all")


def flow_kwargs(ns: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    """``pretrain_pipeline`` arguments from parsed flags; checks the config resolves first."""
    from flows.config import resolve_job

    if bool(ns.module) != bool(ns.config):
        raise ConfigError("--module and --config go together (e.g. --module llama3 --config X)")
    if not ns.module and not ns.config_file:
        ns.module, ns.config = "llama3", "llama3_debugmodel"
    if ns.eval_batches < 0:
        raise ConfigError(f"--eval-batches: expected an int >= 0, got {ns.eval_batches}")
    # Resolve once here: a bad key is one line now, not a failed flow run.
    resolve_job(ns.module, ns.config, ns.config_file, overrides, ns.storage, ns.tracking_uri)
    return {
        "module": ns.module,
        "config": ns.config,
        "config_file": ns.config_file,
        "overrides": overrides,
        "storage_root": ns.storage,
        "tracking_uri": ns.tracking_uri,
        "eval_batches": ns.eval_batches,
    }


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
