"""``titan pipeline``: run the Prefect flows from the command line (embedded Prefect, no server).

    titan pipeline run [--config RECIPE [--module FAMILY]] [--config-file F] [--run-id ID] [-v]
                       [--section.field v ...]   # e.g. --job.dump_folder URL --tracking.uri URI
                                                 #      --evaluate.batches N
    titan pipeline deploy [--pool NAME] [--name DEPLOYMENT ...] [--prefect-file FILE]

Without ``PREFECT_API_URL`` Prefect starts a temporary local server whose database lives under
``PREFECT_HOME`` (default ``./outputs/.prefect``); analytics are off. The console shows what the
stages say in one format, without Prefect's and MLflow's boilerplate
(``titan_core.pipeline.run.console``); ``-v`` adds the launch command. ``titan demo`` runs the
pipeline on the debug model with embedded defaults (and continues its model line when rerun).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated, Any

import tyro

from titan_core.cli.command import Command, ConfigArgs, dispatch, run
from titan_core.errors import ConfigError
from titan_core.pipeline.run.config import DEFAULT_RECIPE

DEFAULT_PREFECT_HOME = os.path.join("outputs", ".prefect")
# Flags that became config keys: one spelling per setting, the config's.
RENAMED_FLAGS = {
    "--storage": "--job.dump_folder",
    "--tracking-uri": "--tracking.uri",
    "--eval-batches": "--evaluate.batches",
}


@dataclass
class RunOptions:
    """The options of ``titan pipeline run`` (config arguments aside)."""

    run_id: str = ""
    """reuse a run root (resumes its training)"""
    verbose: Annotated[bool, tyro.conf.arg(aliases=["-v"])] = False
    """show DEBUG lines of the stages on the console too (the launch command)"""


PIPELINE_RUN = Command(
    "titan pipeline run",
    RunOptions,
    f"Run pretrain_pipeline in this process. Without --config or --config-file the recipe is "
    f"{DEFAULT_RECIPE}. Overrides often given: --job.dump_folder URL, --tracking.uri URI, "
    "--evaluate.batches N.",
    renamed=RENAMED_FLAGS,
    short={"-v": "--verbose"},
)


def prepare_prefect_env(verbose: bool = False) -> str:
    """Point Prefect at a project-local home (unless set) with analytics off and the console's
    settings (``console_settings``; ``verbose``: the stages' DEBUG lines too); returns the home.

    Must run before Prefect (or MLflow) is imported: it reads its settings once.
    """
    from titan_core.logging import init_logger
    from titan_core.pipeline.run.console import console_settings

    home = os.path.abspath(os.environ.setdefault("PREFECT_HOME", DEFAULT_PREFECT_HOME))
    os.environ["PREFECT_HOME"] = home
    os.makedirs(home, exist_ok=True)  # Prefect creates only the last path component
    quiet, asked = console_settings(), console_settings(verbose)
    for name, value in asked.items():  # what the user set wins, except what -v asks for
        if name in quiet:
            os.environ.setdefault(name, value)
        else:
            os.environ[name] = value
    # The engine's logger is set up once per process; done now, Prefect's logging config (which
    # sets its level on the console) comes after, not before.
    init_logger()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT", "false")
    # The temporary server migrates a new database on its first start: slow on a busy machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    from tasks.runtime import quiet_user_errors

    quiet_user_errors()  # a user error in a flow: one line on the console, not a traceback
    return home


def flow_kwargs(config: ConfigArgs) -> dict[str, Any]:
    """``pretrain_pipeline`` arguments from the config arguments: the recipe, the file and the
    ``--section.field value`` overrides as typed dotted keys; checks the config resolves first."""
    from titan_core.config.argv import cli_values
    from titan_core.resolve import resolve_job

    if config.module and not config.config:
        raise ConfigError("--module: names the family of --config (e.g. --config llama3_8b)")
    recipe = config.config or ("" if config.config_file else DEFAULT_RECIPE)
    if config.module:
        recipe = f"{config.module}/{recipe}"
    values = cli_values(list(config.overrides))
    # Resolve once here: a bad key is one line now, not a failed flow run.
    resolve_job(recipe, config.config_file, values)
    return {"recipe": recipe, "config_file": config.config_file, "overrides": values}


def where_to_look(result: dict[str, Any], prefect_home: str) -> str:
    """The lines printed after a run: artifacts, the MLflow UI and the Prefect UI commands."""
    from titan_core.pipeline.run.tracking import mlflow_ui

    root = result["run_root"].rstrip("/") + "/"

    def in_run(url: str) -> str:  # a line each stays short: the artifacts relative to the root
        return url.removeprefix(root) if url.startswith(root) else url

    lines = [
        f"pipeline: run {result['run_id']} done; artifacts in {result['run_root']}",
        f"  Hugging Face export: {in_run(result['hf'])}   "
        f"eval report: {in_run(result['eval_report'])}",
    ]
    if result.get("dataset"):
        lines.append(
            f"  prepared dataset: {result['dataset']} ({result['dataset_train_shards']} train "
            f"shards, {result['dataset_train_tokens']:,} train tokens)"
        )
    if result.get("model_version"):
        role = "champion" if result.get("champion") else "not champion"
        gate = result.get("champion_metric") or "eval/loss"
        shown = f"eval loss {result['metrics'].get('eval/loss', float('nan')):.4f}"
        if gate != "eval/loss":  # the number the champion rule compared, too
            shown += f", {gate} {result['metrics'].get(gate, float('nan')):.4f}"
        lines.append(f"  model {result['model_name']} v{result['model_version']} ({role}); {shown}")
    if result.get("drill"):
        lines.append("  drill (debug.drill): no model version registered, no alias moved")
    if result.get("health_summary"):  # the step guard's incidents, one line each
        lines.append(f"  training health: {result['health_summary']}")
        lines += [f"    {line}" for line in result.get("incidents", [])]
    if result.get("tracking_uri"):  # the command, then the page on a line of its own
        command, _, page = mlflow_ui(result["tracking_uri"], result).partition("  (then open ")
        lines.append(f"  MLflow UI:  {command}")
        lines += [f"              then open {page.removesuffix(')')}"] if page else []
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


def _run(argv: list[str]) -> int:
    parsed = PIPELINE_RUN.parse(argv)
    kwargs = flow_kwargs(parsed.config)
    home = prepare_prefect_env(parsed.options.verbose)
    result = run_pipeline(kwargs, parsed.options.run_id)
    print(where_to_look(result, home))
    return 0


def _deploy(argv: list[str]) -> int:
    # No project-local PREFECT_HOME here: the server may be set in the user's Prefect profile.
    from titan_core.cli.deploy import deploy_command

    return deploy_command(argv)


COMMANDS = {
    "run": ("run pretrain_pipeline in this process", _run),
    "deploy": ("register deployments/prefect.yaml on a Prefect server", _deploy),
}


def main(argv: list[str] | None = None) -> int:
    """Run one ``titan pipeline`` command; user errors print one line and return 2."""
    return run(lambda args: dispatch("titan pipeline", __doc__ or "", COMMANDS, args), argv)
