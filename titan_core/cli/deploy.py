"""``titan pipeline deploy``: register the deployments of ``deployments/prefect.yaml``.

    titan pipeline deploy [--pool NAME] [--name DEPLOYMENT ...] [--prefect-file FILE]

Checks the pipeline deployments' parameters against the config schema (the old ``module``,
``storage_root``, ``tracking_uri``, ``eval_batches`` and CLI-token ``overrides`` are refused in one
line naming the new key) and that a Prefect server answers at ``PREFECT_API_URL``, creates the
work pool when it is missing (a process pool unless ``--pool-type`` says otherwise), then runs
``prefect deploy`` from the project root so the entrypoints (``flows/*.py:flow``) resolve and
process workers start their flow runs there. Last, it adds to each config deployment's run form
the values its runs start from (``recipe_schema``: each field's help names its value as
deployed, after saying that an empty field keeps the value of the recipe chosen in the form).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import tyro

from titan_core.cli.command import Command, default, run
from titan_core.errors import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # titan_core/cli/deploy.py -> the checkout
DEFAULT_PREFECT_FILE = PROJECT_ROOT / "deployments" / "prefect.yaml"
DEFAULT_POOL = "titan-process"
# Parameters the config flows (pipeline, retrain, sweep, compare) took before they took the typed
# config, and where they went.
LEGACY_PARAMETERS = {
    "module": "recipe (a recipe name, or family/recipe)",
    "storage_root": "config.job.dump_folder",
    "tracking_uri": "config.tracking.uri",
    "eval_batches": "config.evaluate.batches",
}
CONFIG_FLOWS = (":pretrain_pipeline", ":retrain", ":sweep", ":compare")


def _api_url() -> str:
    """The Prefect API URL from the environment or the active profile; an error when unset."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise ConfigError(
            "PREFECT_API_URL: not set; start a server (prefect server start) and export "
            "PREFECT_API_URL=http://127.0.0.1:4200/api so deployments outlive this command"
        )
    return url


def ensure_work_pool(name: str, pool_type: str = "process") -> bool:
    """Create work pool ``name`` of ``pool_type`` unless it exists; True when created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    url = _api_url()
    with get_client(sync_client=True) as client:
        if client.api_healthcheck() is not None:
            raise ConfigError(f"PREFECT_API_URL: no Prefect server answers at {url}")
        try:
            client.read_work_pool(name)
            return False
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type=pool_type))
            return True


def check_parameters(prefect_file: Path) -> None:
    """Check the parameters of the pipeline deployments in ``prefect_file`` against the config
    schema; an old parameter or a bad key is one line naming the deployment and the new key."""
    from titan_core.config.form import flow_values
    from titan_core.config.schema import typed_values

    for entry in _config_deployments(prefect_file, None):
        where = f"{prefect_file.name}: deployment {entry.get('name')!r}"
        params = entry.get("parameters") or {}
        for key in params:
            if key in LEGACY_PARAMETERS:
                raise ConfigError(f"{where}: parameter {key} is gone; use {LEGACY_PARAMETERS[key]}")
        try:
            typed_values(flow_values(params.get("config"), params.get("overrides")))
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None


def deploy(
    prefect_file: str | Path = DEFAULT_PREFECT_FILE,
    pool: str = "",
    names: list[str] | None = None,
    pool_type: str = "process",
    project_dir: str | Path = PROJECT_ROOT,
) -> int:
    """Create the pool if needed and run ``prefect deploy``; returns its exit code."""
    prefect_file = Path(prefect_file).resolve()
    if not prefect_file.is_file():
        raise ConfigError(
            f"--prefect-file: expected a prefect.yaml file, got {str(prefect_file)!r}"
        )
    check_parameters(prefect_file)
    created = ensure_work_pool(pool or DEFAULT_POOL, pool_type)
    if created:
        print(f"created work pool {pool or DEFAULT_POOL!r} ({pool_type})")
    cmd = [sys.executable, "-m", "prefect", "deploy", "--prefect-file", str(prefect_file)]
    cmd += [arg for name in names or [] for arg in ("--name", name)] or ["--all"]
    if pool:
        cmd += ["--pool", pool]
    env = {**os.environ, "PREFECT_CLI_PROMPT": "false"}
    rc = subprocess.run(cmd, cwd=project_dir, env=env, check=False).returncode
    if rc == 0:
        for name in show_recipe_defaults(prefect_file, names):
            print(f"run form of {name}: help gives the values as deployed")
    return rc


def _config_deployments(prefect_file: Path, names: list[str] | None) -> list[dict[str, Any]]:
    """The entries of ``prefect_file`` that run a config flow (restricted to ``names``)."""
    import yaml

    spec = yaml.safe_load(prefect_file.read_text()) or {}
    return [
        entry
        for entry in spec.get("deployments") or []
        if str(entry.get("entrypoint", "")).endswith(CONFIG_FLOWS)
        and (not names or entry.get("name") in names)
    ]


def show_recipe_defaults(prefect_file: Path, names: list[str] | None = None) -> list[str]:
    """Add to the parameter schema of each config deployment of ``prefect_file`` the values of
    the config its runs start from (its recipe, config file, config and overrides): returns the
    deployments' names (``flow/deployment``)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate

    from titan_core.config.form import flow_values, recipe_schema
    from titan_core.resolve import resolve_job

    done = []
    with get_client(sync_client=True) as client:
        for entry in _config_deployments(prefect_file, names):
            params = entry.get("parameters") or {}
            recipe, config_file = params.get("recipe", ""), params.get("config_file", "")
            cfg = resolve_job(
                recipe, config_file, flow_values(params.get("config"), params.get("overrides"))
            )
            label = f"recipe {recipe}" if recipe else "the defaults"
            if config_file:
                label += f" with {config_file}"
            name = f"{entry['entrypoint'].rpartition(':')[2]}/{entry['name']}"
            dep = client.read_deployment_by_name(name)
            schema = recipe_schema(dep.parameter_openapi_schema or {}, cfg, label)
            client.update_deployment(dep.id, DeploymentUpdate(parameter_openapi_schema=schema))
            done.append(name)
    return done


METAVAR_NAME = tyro.conf.arg(metavar="NAME")


@dataclass
class DeployOptions:
    """The options of ``titan pipeline deploy``."""

    prefect_file: Annotated[str, tyro.conf.arg(metavar="FILE")] = str(DEFAULT_PREFECT_FILE)
    """the deployments file"""
    pool: Annotated[str, default(f"the file's, else {DEFAULT_POOL}"), METAVAR_NAME] = ""
    """work pool the deployments run in"""
    pool_type: Annotated[str, tyro.conf.arg(metavar="TYPE")] = "process"
    """type of a pool created here"""
    name: Annotated[list[str], default("all of the file's"), METAVAR_NAME] = field(
        default_factory=list
    )
    """deployments to register (several, or repeat --name)"""


DEPLOY = Command(
    "titan pipeline deploy",
    DeployOptions,
    __doc__ or "",
    takes_config=False,
)


def deploy_command(argv: list[str]) -> int:
    """``titan pipeline deploy`` on ``argv``: parse, then ``deploy``."""
    ns = DEPLOY.parse(argv).options
    return deploy(ns.prefect_file, ns.pool, ns.name, ns.pool_type)


def main(argv: list[str] | None = None) -> int:
    """``titan pipeline deploy``; user errors print one line and return 2."""
    return run(deploy_command, argv)
