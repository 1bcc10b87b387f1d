"""Deployments on a real Prefect server, a process worker, and MLflow as a tracking server.

One stack per module: ``prefect server`` (own PREFECT_HOME), ``mlflow server`` (SQLite backend,
artifacts proxied to the S3 test server), the deployments of ``deployments/prefect.yaml``
registered by ``titan pipeline deploy`` and a process worker running their flow runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import re
import subprocess
import tempfile
import time
import tomllib
import typing
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from form_helpers import form_problems
from pipeline_helpers import task_runs, tiny_overrides, tiny_values
from pipeline_servers import (
    BIN,
    MlflowServer,
    PrefectServer,
    PrefectWorker,
    start_mlflow_server,
    start_prefect_server,
)
from tracking_data import log_pipeline_run

from titan_core.checkpoint.manager import complete_steps
from titan_core.cli.deploy import DEFAULT_POOL
from titan_core.config.form import CHANGE_TAB, KEEP_TAB, RUN_FIELDS
from titan_core.config.job import JobConfig
from titan_core.config.schema import get_value
from titan_core.resolve import resolve_job

ROOT = Path(__file__).resolve().parents[1]
PREFECT_FILE = ROOT / "deployments" / "prefect.yaml"
EXPERIMENT = "deploy-compare"
BASE = ["--module", "llama3", "--config", "llama3_debugmodel_tiny"]

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


@dataclass
class Stack:
    """The running services of this module."""

    prefect: PrefectServer
    mlflow: MlflowServer
    worker: PrefectWorker
    work: Path
    s3: Any
    store: str  # the deployed model line's output root on S3


def _start_servers(work: Path, s3_server: Any) -> tuple[PrefectServer, MlflowServer]:
    """Both servers, started side by side (each takes seconds to boot); none left on failure."""
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(start_prefect_server, work / "prefect"),
            pool.submit(
                start_mlflow_server, work / "mlflow", s3_server.url("mlflow"), s3_server.env()
            ),
        ]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for future in futures:
            if future.exception() is None:
                future.result().stop()
        raise errors[0]
    return futures[0].result(), futures[1].result()


def _deploy(prefect: PrefectServer, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``titan pipeline deploy`` from a folder outside the project."""
    return subprocess.run(
        [str(BIN / "titan"), "pipeline", "deploy"],
        cwd=cwd,
        env=prefect.env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: Any) -> Iterator[Stack]:
    """Servers up, deployments registered, one process worker polling the pool."""
    work = tmp_path_factory.mktemp("deployments")
    for sub in ("prefect", "mlflow", "runs"):
        (work / sub).mkdir()
    prefect, mlflow = _start_servers(work, s3_server)
    worker = None
    try:
        deployed = _deploy(prefect, work)
        assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]
        # MLflow's HTTP retries back off for minutes by default: fail a broken test faster.
        env = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
        # The worker's environment reaches its flow runs: S3 credentials for the output root.
        worker = prefect.start_worker(DEFAULT_POOL, work / "runs", env={**env, **s3_server.env()})
        store = s3_server.url(f"deployed-{uuid.uuid4().hex[:8]}")
        yield Stack(prefect, mlflow, worker, work, s3_server, store)
    finally:
        if worker is not None:
            worker.stop()
        prefect.stop()
        mlflow.stop()


@contextlib.contextmanager
def api(server: PrefectServer) -> Iterator[Any]:
    """A sync Prefect client of ``server`` in this process (settings restored afterwards)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with (
        temporary_settings(updates={PREFECT_API_URL: server.api_url}),
        get_client(sync_client=True) as client,
    ):
        yield client


def _run_deployment(stack: Stack, name: str, params: dict[str, Any]) -> str:
    """``prefect deployment run NAME --watch`` from the CLI; returns the completed run's id."""
    args = ["deployment", "run", name, "--watch", "--watch-timeout", "600"]
    for key, value in params.items():
        args += ["--param", f"{key}={json.dumps(value)}"]
    proc = stack.prefect.cli(*args, timeout=660, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:] + "\nworker:\n" + stack.worker.log()[-4000:]
    match = re.search(r"UUID: ([0-9a-f-]{36})", out)
    assert match, out[-2000:]
    return match.group(1)


def test_deploy_registers_every_deployment(stack: Stack) -> None:
    spec = yaml.safe_load(PREFECT_FILE.read_text())
    with api(stack.prefect) as client:
        assert client.read_work_pool(DEFAULT_POOL).type == "process"
        deployed = {d.name: d for d in client.read_deployments()}
    assert sorted(deployed) == sorted(entry["name"] for entry in spec["deployments"])
    for entry in spec["deployments"]:
        dep = deployed[entry["name"]]
        assert dep.work_pool_name == DEFAULT_POOL
        assert dep.entrypoint == entry["entrypoint"]
        # Flow runs start in the project root, where the entrypoints resolve.
        assert dep.pull_steps == [
            {"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}
        ]
        crons = sorted(s["cron"] for s in entry.get("schedules") or [])
        assert sorted(s.schedule.cron for s in dep.schedules) == crons
        # A schedule says its timezone (the UI shows "at 03:00 UTC", not a bare time).
        assert all(s.schedule.timezone == "UTC" for s in dep.schedules), dep.schedules


def test_compare_deployment_with_tracking_server(stack: Stack, s3_server: Any) -> None:
    uri = stack.mlflow.uri
    variants = {"lr-high": ["--optimizer.lr", "1e-3"], "lr-low": ["--optimizer.lr", "1e-4"]}
    runs = {
        name: log_pipeline_run(uri, EXPERIMENT, name, [*BASE, "--training.steps", "3", *args])
        for name, args in variants.items()
    }
    config = {"job": {"experiment": EXPERIMENT}, "tracking": {"uri": uri}}
    flow_run_id = _run_deployment(stack, "compare/compare", {"config": config, "log": True})
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with api(stack.prefect) as client:
        assert client.read_flow_run(flow_run_id).state.is_completed()
        flow_runs = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        artifacts = {a.type: a for a in client.read_artifacts(flow_run_filter=flow_runs)}
    assert {"table", "markdown", "image"} <= set(artifacts)
    table = json.loads(artifacts["table"].data)
    assert sorted(row["run_id"] for row in table) == sorted(r[0] for r in runs.values())
    assert "`optimizer.lr`" in artifacts["markdown"].data
    assert "![loss curves](data:image/png;base64," in artifacts["markdown"].data  # renders as is
    # The plot went through the tracking server into S3, and its link serves the PNG.
    with urllib.request.urlopen(artifacts["image"].data, timeout=30) as resp:
        assert resp.read()[:8] == b"\x89PNG\r\n\x1a\n"
    stored = s3_server.filesystem().find(s3_server.url("mlflow"))
    assert any(path.endswith("/loss_curves.png") for path in stored), stored
    # The comparison.md logged to MLflow shows its image in the MLflow UI: an absolute link to
    # the server's get-artifact route (the viewer drops data: and relative images).
    from mlflow import MlflowClient

    mlflow = MlflowClient(tracking_uri=uri)
    (record,) = mlflow.search_runs(
        [mlflow.get_experiment_by_name(EXPERIMENT).experiment_id],
        "tags.`titan.stage` = 'compare'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    with tempfile.TemporaryDirectory() as tmp:
        md = Path(mlflow.download_artifacts(record.info.run_id, "comparison.md", tmp)).read_text()
    link = re.search(r"!\[loss curves\]\((http[^)]+/get-artifact\?[^)]+)\)", md)
    assert link is not None and link.group(1).startswith(uri), md
    with urllib.request.urlopen(link.group(1), timeout=30) as resp:
        assert resp.read()[:8] == b"\x89PNG\r\n\x1a\n"


def test_titan_compare_cli_uses_the_server(stack: Stack) -> None:
    cmd = [str(BIN / "titan"), "compare", "--experiment", EXPERIMENT, "--json"]
    cmd += ["--tracking.uri", stack.mlflow.uri, "--runs", "lr-low", "lr-high"]
    proc = subprocess.run(
        cmd, env=stack.prefect.env, capture_output=True, text=True, timeout=300, cwd=stack.work
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert [r["run"] for r in result["runs"]] == ["lr-low", "lr-high"]
    assert list(result["differing_params"]) == ["optimizer.lr"]


def test_local_export_registers_on_a_tracking_server(stack: Stack, tmp_path: Path) -> None:
    """A tracking server refuses sources outside the run's artifacts: a local export is uploaded
    to them and registered from there, and the version's files download intact."""
    from mlflow.tracking import MlflowClient

    from titan_core.pipeline.run.tracking import TrackingContext
    from titan_core.pipeline.stages.publish import register_version, registrable_source

    export = tmp_path / "hf"
    export.mkdir()
    (export / "config.json").write_text('{"model_type": "llama"}')
    mlflow_client = MlflowClient(tracking_uri=stack.mlflow.uri)
    experiment_id = mlflow_client.create_experiment("local-export")
    run = mlflow_client.create_run(experiment_id)
    tracking = TrackingContext(stack.mlflow.uri, "local-export", experiment_id, run.info.run_id)
    version = register_version(
        tracking, "local-export", registrable_source(tracking, str(export)), {}
    )
    source = mlflow_client.get_model_version("local-export", version).source
    assert source.endswith("/hf") and not source.startswith(str(tmp_path))
    from mlflow.artifacts import download_artifacts

    dst = str(tmp_path / "dl")
    got = Path(download_artifacts(source, dst_path=dst, tracking_uri=stack.mlflow.uri))
    assert (got / "config.json").read_text() == '{"model_type": "llama"}'


# ------------------------------------------------ the pipeline and a scheduled retrain of its line

LINE = "deployline"
STEPS = 2


def _line_config(stack: Stack) -> dict[str, Any]:
    """Where the deployed model line lives (S3 storage, MLflow on the tracking server) and its
    eval, as the flows' typed ``config`` parameter."""
    return {
        "job": {"dump_folder": stack.store, "experiment": LINE},
        "tracking": {"uri": stack.mlflow.uri},
        "evaluate": {"batches": 2},
    }


def _nested(values: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys as the ``config`` form's sections (and nested sections)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        *sections, name = key.split(".")
        table = out
        for section in sections:
            table = table.setdefault(section, {})
        table[name] = value
    return out


def _runs_of(stack: Stack, deployment: str) -> list[Any]:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with api(stack.prefect) as client:
        dep = client.read_deployment_by_name(deployment)
        return client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id]))
        )


def test_pipeline_parameters_are_the_config_form(stack: Stack) -> None:
    """The deployed schema has every section and field of the config, typed, with its
    docstring as help, then what an empty field keeps (the chosen recipe's value) and the value
    as deployed, and no default the form would submit: the run group first, every section
    folded behind two tabs ("recipe's values" submits nothing, "change" opens it), no null
    type, default or class name anywhere (``titan pipeline deploy``'s rewrite); a run from the
    form stores the values given and nothing else."""
    with api(stack.prefect) as client:
        dep = client.read_deployment_by_name("pretrain_pipeline/pretrain")
    assert dep.enforce_parameter_schema
    assert dep.parameters == {"recipe": "llama3_debugmodel", "config": {}, "overrides": {}}
    schema = dep.parameter_openapi_schema
    params = schema["properties"]
    assert list(params) == ["recipe", "config", "overrides", "config_file", "run_id",
                            "parent_run_id"]  # fmt: skip
    assert all(p.get("description") for p in params.values())
    defs = schema["definitions"]
    assert params["config"]["$ref"] == "#/definitions/ConfigForm"
    form = defs["ConfigForm"]
    recipe = resolve_job("llama3_debugmodel")
    as_deployed = "(as deployed, recipe llama3_debugmodel: "

    def check_section(ref: str, cls: type, prefix: str) -> None:
        fields = defs[ref.rsplit("/", 1)[-1]]["properties"]
        hints = typing.get_type_hints(cls)
        names = [
            f.name for f in dataclasses.fields(cls) if f"{prefix}{f.name}" != "job.config_file"
        ]
        assert list(fields) == names, cls.__name__
        for name, field in fields.items():
            assert "default" not in field, name  # nothing the form would submit, switches too
            if dataclasses.is_dataclass(hints[name]):  # a nested section ([launch.slurm])
                check_section(field["$ref"], hints[name], f"{prefix}{name}.")
                continue
            value = get_value(recipe, f"{prefix}{name}")
            shows = ", whatever the switch shows" if field["type"] == "boolean" else ""
            keeps = f"keeps the chosen recipe's value{shows} {as_deployed}{json.dumps(value)})."
            assert field["description"].endswith(keeps), name
            assert field["examples"] == [value] and field["title"] == name, name

    hints = typing.get_type_hints(JobConfig)
    sections = [f.name for f in dataclasses.fields(JobConfig)]
    assert list(form["properties"]) == ["run", *sections]
    for section in sections:
        keep, change = form["properties"][section]["anyOf"]
        assert (keep["title"], keep["properties"], change["title"]) == (KEEP_TAB, {}, CHANGE_TAB)
        check_section(change["$ref"], hints[section], f"{section}.")
    run = defs["RunForm"]["properties"]
    assert [field["title"] for field in run.values()] == list(RUN_FIELDS.values())
    _check_other_config_flows(stack, defs)
    steps = defs["TrainingForm"]["properties"]["steps"]
    assert steps["type"] == "integer" and steps["examples"] == [recipe.training.steps]
    assert steps["description"] == (
        "Optimizer steps to train for (the total, counting steps done before a resume). "
        f"Empty keeps the chosen recipe's value {as_deployed}{recipe.training.steps})."
    )
    name = defs["OptimizerForm"]["properties"]["name"]
    assert name["enum"] == ["AdamW", "Adam"] and name["type"] == "string"
    batches = defs["EvaluateForm"]["properties"]["batches"]
    assert "0 = the whole split" in batches["description"]
    assert batches["examples"] == [recipe.evaluate.batches]
    assert defs["TrainingForm"]["additionalProperties"] is False  # unknown fields: refused
    assert form_problems(schema) == []
    # A run from the form: what the UI submits with two fields set (run.steps, one switch of an
    # opened section; untouched sections and fields are left out) is stored as given, on the
    # deployment's other parameters: no null section, nothing the user did not set.
    from prefect.states import Scheduled

    config = {"run": {"steps": 3}, "checkpoint": {"enable": not recipe.checkpoint.enable}}
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=3650)
    with api(stack.prefect) as client:
        run_id = client.create_flow_run_from_deployment(
            dep.id, parameters={"config": config}, state=Scheduled(scheduled_time=later)
        ).id
        stored = client.read_flow_run(run_id).parameters
        client.delete_flow_run(run_id)
    assert stored == {"recipe": "llama3_debugmodel", "config": config, "overrides": {}}


def _check_other_config_flows(stack: Stack, pretrain_defs: dict[str, Any]) -> None:
    """The retrain and compare deployments take the config as pretrain does: the recipe (which
    locates the pretrain deployment's line and store, nothing hard-coded), the same typed form."""
    expected = {
        "retrain/nightly": ["steps", "recipe", "experiment", "config", "overrides", "config_file",
                            "parent_run_id"],
        "compare/compare": ["recipe", "experiment", "config", "overrides", "config_file", "runs",
                            "max_runs", "log", "parent_run_id"],
    }  # fmt: skip
    with api(stack.prefect) as client:
        deps = {name: client.read_deployment_by_name(name) for name in expected}
    assert deps["retrain/nightly"].parameters == {
        "steps": 100, "recipe": "llama3_debugmodel", "config": {}, "overrides": {}
    }  # fmt: skip
    assert deps["compare/compare"].parameters == {
        "recipe": "llama3_debugmodel", "config": {}, "overrides": {}, "max_runs": 10
    }  # fmt: skip
    for name, dep in deps.items():
        schema = dep.parameter_openapi_schema
        params = schema["properties"]
        assert dep.enforce_parameter_schema and list(params) == expected[name], name
        assert all(p.get("description") for p in params.values()), name
        assert params["config"]["$ref"].endswith("/ConfigForm"), name
        defs = schema["definitions"]
        assert {k: defs[k] for k in pretrain_defs} == pretrain_defs, name
    # Every deployment's run form: no "| None" switch, null type or default, no class name.
    with api(stack.prefect) as client:
        deps["sweep/sweep"] = client.read_deployment_by_name("sweep/sweep")
    problems = [p for n, d in deps.items() for p in form_problems(d.parameter_openapi_schema, n)]
    assert problems == []
    early_stop = deps["sweep/sweep"].parameter_openapi_schema["properties"]["early_stop"]
    assert [choice["title"] for choice in early_stop["anyOf"]] == ["off", CHANGE_TAB]


def test_server_refuses_invalid_parameters_before_a_flow_run(stack: Stack) -> None:
    """A wrong type, an unknown field and the old parameter shapes (a recipe name in
    ``config``, CLI tokens in ``overrides``, a null section as the old form stored) are refused
    by the server: no flow run starts."""
    from prefect.exceptions import PrefectHTTPStatusError

    before = _runs_of(stack, "pretrain_pipeline/pretrain")
    bad = {
        "config.training.steps": {"config": {"training": {"steps": "many"}}},
        "config.training": {"config": {"training": {"stepz": 4}}},
        "config.checkpoint": {"config": {"checkpoint": None}},
        "config.optimizer.name": {"config": {"optimizer": {"name": "SGD"}}},
        "config": {"config": "llama3_debugmodel_tiny"},
        "overrides": {"overrides": ["--training.steps", "4"]},
    }
    with api(stack.prefect) as client:
        dep = client.read_deployment_by_name("pretrain_pipeline/pretrain")
        for field, params in bad.items():
            with pytest.raises(PrefectHTTPStatusError) as refused:
                client.create_flow_run_from_deployment(dep.id, parameters=params)
            message = refused.value.response.json()["detail"]
            assert refused.value.response.status_code == 409, message
            assert f"Validation failed for field '{field}'" in message, message
    assert len(_runs_of(stack, "pretrain_pipeline/pretrain")) == len(before)


def test_deploy_refuses_old_pipeline_parameters_in_one_line(stack: Stack) -> None:
    """A prefect.yaml written for the old parameters names the new key, and deploys nothing."""
    old = yaml.safe_load(PREFECT_FILE.read_text())
    entries = {d["name"]: d for d in old["deployments"]}
    cases = {
        "pretrain": ({"config": "llama3_debugmodel", "storage_root": "s3://bucket/runs"},
                     "parameter storage_root is gone; use config.job.dump_folder"),
        "compare": ({"experiment": "titan", "tracking_uri": "sqlite:///outputs/mlflow.db"},
                    "parameter tracking_uri is gone; use config.tracking.uri"),
    }  # fmt: skip
    for name, (params, expected) in cases.items():
        entry = {**entries[name], "name": f"{name}-old", "parameters": params}
        path = stack.work / "old-prefect.yaml"
        path.write_text(yaml.safe_dump({**old, "deployments": [entry]}))
        cmd = [str(BIN / "titan"), "pipeline", "deploy", "--prefect-file", str(path)]
        proc = subprocess.run(
            cmd, cwd=stack.work, env=stack.prefect.env, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr == f"error: old-prefect.yaml: deployment '{name}-old': {expected}\n"
    with api(stack.prefect) as client:
        deployed = {d.name for d in client.read_deployments()}
    assert not {"pretrain-old", "compare-old"} & deployed


@pytest.fixture(scope="module")
def pretrained(stack: Stack) -> dict[str, Any]:
    """The pipeline deployment, triggered from the CLI with typed parameters only: a 2-step run
    of the tiny model (whose recipe trains 20 steps)."""
    config = _nested(tiny_values(steps=STEPS, nproc=1))
    for section, fields in _line_config(stack).items():
        config.setdefault(section, {}).update(fields)
    params = {"recipe": "llama3_debugmodel_tiny", "config": config}
    flow_run_id = _run_deployment(stack, "pretrain_pipeline/pretrain", params)
    (run_root,) = _line_runs(stack)
    return {"flow_run_id": flow_run_id, "run_root": run_root}


def _line_runs(stack: Stack) -> list[str]:
    """URLs of the model line's run roots on S3."""
    fs = stack.s3.filesystem()
    return sorted("s3://" + p for p in fs.ls(f"{stack.store}/{LINE}".removeprefix("s3://")))


def _newest_step(stack: Stack, run_root: str) -> int:
    """The newest complete checkpoint step of a run, read through the project's storage seam."""
    with pytest.MonkeyPatch.context() as mp:
        stack.s3.set_env(mp)
        return complete_steps(f"{run_root}/checkpoint")[-1]


def test_pipeline_deployment_runs_to_completion(stack: Stack, pretrained: dict) -> None:
    from mlflow import MlflowClient
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with api(stack.prefect) as client:
        assert client.read_flow_run(pretrained["flow_run_id"]).state.is_completed()
        flow_runs = FlowRunFilter(id=FlowRunFilterId(any_=[pretrained["flow_run_id"]]))
        tasks = client.read_task_runs(flow_run_filter=flow_runs)
    names = {t.name.rsplit("-", 1)[0] for t in tasks}
    assert {"train", "convert_to_hf", "evaluate", "publish"} <= names
    assert all(t.state.is_completed() for t in tasks), [(t.name, t.state.name) for t in tasks]
    # The typed training.steps (the recipe says 20) and evaluate.batches ran.
    assert _newest_step(stack, pretrained["run_root"]) == STEPS
    toml = stack.s3.filesystem().cat(f"{pretrained['run_root']}/config.toml").decode()
    config = tomllib.loads(toml)
    assert config["training"]["steps"] == STEPS and config["evaluate"]["batches"] == 2
    # One output root: the saved config's job.dump_folder is the run's folder, no storage.root.
    assert config["job"]["dump_folder"] == pretrained["run_root"]
    assert "root" not in config["storage"]
    # Tracked on the server: a finished parent run and a registered model version.
    mlflow = MlflowClient(stack.mlflow.uri)
    exp = mlflow.get_experiment_by_name(LINE)
    parents = mlflow.search_runs([exp.experiment_id], "tags.`titan.stage` = 'pipeline'")
    assert [r.info.status for r in parents] == ["FINISHED"]
    assert mlflow.search_model_versions(f"name = '{LINE}'")


def test_a_cli_run_gets_the_cache_of_a_deployment_run(
    stack: Stack, pretrained: dict, tmp_path: Path
) -> None:
    """The tokenizer and seed checkpoint a worker's run made are `Cached` for `titan pipeline
    run` on the same output root: the cache lives there, not under each process's PREFECT_HOME
    (the CLI's ./outputs/.prefect here, the worker's its own). Another experiment, untracked and
    unevaluated, so that the line's later tests see only their own runs."""
    cmd = [str(BIN / "titan"), "pipeline", "run", "--config", "llama3_debugmodel_tiny"]
    cmd += [*tiny_overrides(steps=STEPS, nproc=1), "--job.dump_folder", stack.store]
    cmd += ["--job.experiment", f"{LINE}-cli", "--tracking.no_enable"]
    cmd += ["--evaluate.batches", "1", "--evaluate.prompts"]
    env = {k: v for k, v in stack.prefect.env.items() if k != "PREFECT_HOME"} | stack.s3.env()
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    done = re.search(r"pipeline: run (\S+) done", proc.stdout)
    assert done, proc.stdout[-3000:]
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with api(stack.prefect) as client:
        name = FlowRunFilterName(any_=[f"{LINE}-cli/{done.group(1)}"])
        (cli_run,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=name))
        runs = task_runs(cli_run.id)
    for stage in ("download_tokenizer", "create_seed_checkpoint"):
        assert [r.state.name for r in runs[stage]] == ["Cached"], stage
    results = stack.s3.filesystem().ls(f"{stack.store}/.prefect-results".removeprefix("s3://"))
    assert sorted(p.rsplit("/", 1)[-1].split("-")[0] for p in results) == ["seed", "tokenizer"]
    assert (tmp_path / "outputs" / ".prefect").is_dir()  # the CLI's own PREFECT_HOME


@pytest.fixture(scope="module")
def retrained(stack: Stack, pretrained: dict) -> Any:
    """A short interval schedule on the retrain deployment fires once and completes."""
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.schedules import IntervalSchedule

    # What the line's pretrain run was given: the recipe, and where its root and store are.
    params = {"steps": STEPS, "recipe": "llama3_debugmodel_tiny", "config": _line_config(stack)}
    # Anchored so that its first occurrence is seconds away, not a whole interval.
    interval = datetime.timedelta(seconds=60)
    anchor = datetime.datetime.now(datetime.UTC) - interval + datetime.timedelta(seconds=5)
    schedule = IntervalSchedule(interval=interval, anchor_date=anchor)
    with api(stack.prefect) as client:
        dep = client.read_deployment_by_name("retrain/nightly")
        (created,) = client.create_deployment_schedules(
            dep.id, [DeploymentScheduleCreate(schedule=schedule, active=True, parameters=params)]
        )
    started = lambda r: r.state.is_running() or r.state.is_final()  # noqa: E731
    run = _wait_for_run(stack, "retrain/nightly", started, 300)
    with api(stack.prefect) as client:  # fire once: no second interval while this one runs
        client.update_deployment_schedule(dep.id, created.id, active=False)
        # A slow start lets the worker take the next interval's run before the pause (it waits
        # for the concurrency slot, then would retrain the line again): remove it.
        for extra in _runs_of(stack, "retrain/nightly"):
            tiny = extra.parameters.get("recipe") == params["recipe"]
            if tiny and extra.id != run.id and not extra.state.is_final():
                client.delete_flow_run(extra.id)
    return _wait_for_run(stack, "retrain/nightly", lambda r: r.state.is_final(), 600, run.id)


def _wait_for_run(
    stack: Stack, deployment: str, done: Any, timeout_s: float, run_id: Any = None
) -> Any:
    """Poll the deployment's flow runs until one (or ``run_id``) satisfies ``done``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        runs = [r for r in _runs_of(stack, deployment) if run_id in (None, r.id)]
        for run in runs:
            if done(run):
                return run
        time.sleep(1)
    raise AssertionError(
        f"no {deployment} run reached the expected state in {timeout_s}s: "
        f"{[(r.name, r.state.name) for r in runs]}\nworker:\n{stack.worker.log()[-4000:]}"
    )


def test_retrain_schedule_fires_and_continues_the_line(
    stack: Stack, pretrained: dict, retrained: Any
) -> None:
    assert retrained.state.is_completed(), stack.worker.log()[-4000:]
    assert retrained.auto_scheduled and retrained.parameters["recipe"] == "llama3_debugmodel_tiny"
    # It fired once, then its schedule was paused (the nightly cron's runs wait for 03:00).
    started = [r for r in _runs_of(stack, "retrain/nightly") if not r.state.is_scheduled()]
    assert [r.id for r in started] == [retrained.id]
    (new_root,) = [p for p in _line_runs(stack) if p != pretrained["run_root"]]
    # Continued from the pipeline's newest checkpoint: STEPS more steps on top of it.
    assert _newest_step(stack, new_root) == 2 * STEPS
    config = tomllib.loads(stack.s3.filesystem().cat(f"{new_root}/config.toml").decode())
    step_dir = f"{pretrained['run_root']}/checkpoint/step-{STEPS}"
    assert config["checkpoint"]["initial_load_path"] == step_dir


def test_compare_deployment_on_the_line(stack: Stack, pretrained: dict, retrained: Any) -> None:
    # Given what the line's pretrain run was given, as retrain was: its experiment and store.
    params = {"recipe": "llama3_debugmodel_tiny", "config": _line_config(stack)}
    flow_run_id = _run_deployment(stack, "compare/compare", params)
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with api(stack.prefect) as client:
        flow_runs = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        (table,) = [
            a for a in client.read_artifacts(flow_run_filter=flow_runs) if a.type == "table"
        ]
    rows = json.loads(table.data)
    assert len(rows) == 2 and all(r["final_loss"] and r["eval_perplexity"] for r in rows)
    assert [r["steps"] for r in rows] == [STEPS, 2 * STEPS]
