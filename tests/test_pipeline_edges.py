"""The pipeline's edges: bad input stops at the first stage that needs it, an upload survives an
S3 restart, the MLflow sink, the documented commands, and `titan demo` with embedded Prefect."""

from __future__ import annotations

import os
import secrets
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from helpers import free_port
from pipeline_helpers import run_flow, task_runs, tiny_overrides, tiny_values

from titan_core.checkpoint.manager import complete_steps
from titan_core.errors import ConfigError

# ------------------------------------------------------------------ storage faults, bad input


def test_upload_is_retried_across_an_s3_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from titan_core.pipeline.run.transfer import upload_folder
    from titan_core.testing.s3 import start_s3_server

    s3 = start_s3_server(tmp_path / "s3", bucket="restart-test")  # its own: it is killed
    try:
        s3.set_env(monkeypatch)
        local = tmp_path / "side"
        payloads = {f"part-{i}.bin": os.urandom(200_000) for i in range(5)}
        for name, data in payloads.items():
            (local / "logs").mkdir(parents=True, exist_ok=True)
            (local / "logs" / name).write_bytes(data)
        first_pid = s3.process.pid
        restarts: list[threading.Thread] = []

        def restart_after_first_file(url: str) -> None:
            if not restarts:  # kill the server mid-upload; it comes back on its own
                s3.stop()
                restarts.append(threading.Thread(target=s3.restart))
                restarts[0].start()

        urls = upload_folder(str(local), s3.url("run"), on_file=restart_after_first_file)
        restarts[0].join()
        assert s3.process.pid != first_pid
        assert len(urls) == len(payloads)
        fs = s3.filesystem()
        for name, data in payloads.items():
            assert fs.cat(f"{s3.bucket}/run/logs/{name}") == data
    finally:
        s3.stop()


@pytest.mark.parametrize("case", ["unreachable_storage", "bad_credentials", "unknown_tokenizer",
                                  "device_too_small", "tracking_down"])  # fmt: skip
def test_bad_input_fails_at_the_first_stage_that_needs_it(
    case: str,
    prefect_harness: Path,
    s3_server: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flows.pipeline import pretrain_pipeline

    storage, tracking = str(tmp_path / "out"), f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = tiny_values(steps=2, nproc=1)
    if case == "unreachable_storage":
        s3_server.set_env(monkeypatch)
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
        storage, stage, expected = s3_server.url("bad"), "prepare_storage", "cannot reach"
    elif case == "bad_credentials":
        s3_server.set_env(monkeypatch, secret_key="wrong-" + secrets.token_hex(8))
        storage, stage, expected = s3_server.url("bad"), "prepare_storage", "denied"
    elif case == "unknown_tokenizer":
        overrides["tokenizer.path"] = "nosuch://tokenizers/bpe.tiktoken"
        stage, expected = "download_tokenizer", "tokenizer.path: unknown source"
    elif case == "device_too_small":
        overrides["launch.device_memory_gib"] = 0.0001
        stage, expected = "preflight", "launch.device_memory_gib: the estimated peak"
    else:
        tracking = f"http://127.0.0.1:{free_port()}"
        stage, expected = "start_tracking", "tracking.uri: no MLflow server answers"
    state, flow_run_id = run_flow(
        pretrain_pipeline,
        recipe="llama3_debugmodel_tiny",
        overrides=overrides | {"job.dump_folder": storage, "tracking.uri": tracking},
    )
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert expected in str(error) and "\n" not in str(error)
    runs = task_runs(flow_run_id)
    assert list(runs)[-1] == stage and runs[stage][-1].state.is_failed()
    assert "create_seed_checkpoint" not in runs and "train" not in runs


# ------------------------------------------------------------------ MLflow sink, CLI and docs


def test_mlflow_sink_streams_metrics_without_blocking(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from titan_core.components.metrics import MetricsSink
    from titan_core.components.mlflow_sink import MlflowSink

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("sink")).info.run_id
    sink = MlflowSink(run_id, uri)
    assert isinstance(sink, MetricsSink)
    for step in (1, 2, 3):
        sink.log(step, {"loss": 10.0 - step, "memory/rss_gib": 0.5})
    sink.close()
    assert sink.num_logged == 3 and sink.num_failed == 0
    # One naming scheme on MLflow: the trainer's own metrics under train/, namespaced ones kept.
    assert set(client.get_run(run_id).data.metrics) == {"train/loss", "memory/rss_gib"}
    history = client.get_metric_history(run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(1, 9.0), (2, 8.0), (3, 7.0)]
    assert client.get_metric_history(run_id, "memory/rss_gib")[0].value == 0.5


ROOT = Path(__file__).resolve().parents[1]


def _doc_commands(doc: str, prefix: str) -> list[str]:
    import re

    text = (ROOT / "docs" / doc).read_text()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith(prefix):
                lines.append(line)
    return lines


def test_documented_pipeline_commands_resolve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shlex

    from titan_core.cli.demo import DEMO, DEMO_OVERRIDES, DEMO_RECIPE
    from titan_core.cli.pipeline import PIPELINE_RUN, flow_kwargs
    from titan_core.config.argv import cli_values
    from titan_core.resolve import resolve_job

    monkeypatch.chdir(tmp_path)
    Path("my_job.toml").write_text("[training]\nsteps = 5\n")
    commands = _doc_commands("pipeline.md", "titan pipeline run")
    assert len(commands) >= 3
    for line in commands:
        kwargs = flow_kwargs(PIPELINE_RUN.parse(shlex.split(line)[3:]).config)  # a bad key fails
        assert kwargs["recipe"] or kwargs["config_file"], line
    demos = _doc_commands("pipeline.md", "titan demo")
    assert demos
    for line in demos:
        overrides = DEMO.parse(shlex.split(line)[2:]).config.overrides
        resolve_job(DEMO_RECIPE, "", cli_values([*DEMO_OVERRIDES, *overrides]))


def test_pipeline_cli_spells_settings_as_config_keys(capsys: pytest.CaptureFixture) -> None:
    """Settings are config keys, passed to the flow as typed dotted keys; the old flags and a
    bad key are one line, before Prefect starts."""
    from titan_core.cli.demo import main as demo_main
    from titan_core.cli.pipeline import PIPELINE_RUN, flow_kwargs
    from titan_core.cli.pipeline import main as pipeline_main

    argv = ["--config", "qwen3_debugmodel_tiny", "--job.dump_folder", "s3://b/runs"]
    argv += ["--tracking.uri", "http://mlflow:5000", "--evaluate.batches", "0"]
    assert flow_kwargs(PIPELINE_RUN.parse(argv).config) == {
        "recipe": "qwen3_debugmodel_tiny",
        "config_file": "",
        "overrides": {
            "job.dump_folder": "s3://b/runs",
            "tracking.uri": "http://mlflow:5000",
            "evaluate.batches": 0,
        },
    }
    config = PIPELINE_RUN.parse(["--storage.root", "s3://b/runs"]).config
    with pytest.raises(ConfigError) as err:
        flow_kwargs(config)
    assert str(err.value) == (
        "unknown option --storage.root; it moved to --job.dump_folder (the one output root)"
    )
    config = PIPELINE_RUN.parse(["--module", "llama3", "--config", "x"]).config
    with pytest.raises(ConfigError, match=r"^recipe 'llama3/x': no such registry recipe"):
        flow_kwargs(config)
    cases = {
        ("run", "--storage", "/tmp/x"): "--storage: now the config key --job.dump_folder; use "
        "--job.dump_folder VALUE",
        ("run", "--tracking-uri=http://x"): "--tracking-uri: now the config key --tracking.uri; "
        "use --tracking.uri VALUE",
        ("run", "--eval-batches", "3"): "--eval-batches: now the config key --evaluate.batches; "
        "use --evaluate.batches VALUE",
    }
    for args, expected in cases.items():  # refused while parsing: Prefect is not set up
        assert pipeline_main(list(args)) == 2
        assert capsys.readouterr().err == f"error: {expected}\n"
    config = PIPELINE_RUN.parse(["--evaluate.batches", "-1"]).config
    with pytest.raises(ConfigError) as err:
        flow_kwargs(config)
    assert str(err.value) == "evaluate.batches: expected an int >= 0 (0 = all), got -1"
    assert demo_main(["--storage", "/tmp/x"]) == 2
    assert capsys.readouterr().err == f"error: {cases[('run', '--storage', '/tmp/x')]}\n"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_titan_demo_runs_the_pipeline_with_embedded_prefect(tmp_path: Path, assets: Path) -> None:
    import subprocess

    services = ("PREFECT_", "AWS_", "HF_", "MLFLOW_")  # the demo needs none: all embedded
    env = {k: v for k, v in os.environ.items() if not k.startswith(services)}
    env.update(OMP_NUM_THREADS="1", PREFECT_HOME=str(tmp_path / "prefect"))
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "titan_core.cli", "demo", "--steps", "2"]
    argv += ["--job.dump_folder", str(out)]
    argv += ["--model.flavor", "debugmodel_tiny", "--launch.nproc_per_node", "1"]
    argv += [*tiny_overrides(steps=2, nproc=1), "--lr_scheduler.warmup_steps", "1"]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "demo: pre-training llama3_debugmodel for 2 steps" in proc.stdout
    assert f"mlflow ui --backend-store-uri sqlite:///{out}/mlflow.db" in proc.stdout
    assert f"PREFECT_HOME={tmp_path / 'prefect'} prefect server start" in proc.stdout
    (run_root,) = (out / "demo").iterdir()
    assert f"artifacts in {run_root}" in proc.stdout
    assert (run_root / "hf" / "model.safetensors.index.json").exists()
    assert complete_steps(str(run_root / "checkpoint")) == [2]
    assert (tmp_path / "prefect" / "prefect.db").exists()  # the embedded server's database
    # The bundled corpus was prepared as a stage of its own and trained on from the shards.
    (dataset,) = (out / "data").iterdir()
    assert (dataset / "manifest.json").exists()
    assert f"prepared dataset: {dataset} (8 train shards" in proc.stdout
    assert f'dataset = "{dataset}"' in (run_root / "config.toml").read_text()
    # The demo's evaluators have curves in its MLflow store: two held-out sets and a task,
    # before the first step and at the last, in the run that trained.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    experiment = client.get_experiment_by_name("demo")
    names = ("eval/plays/loss", "eval/python/loss", "eval/lc/acc")
    curves = [
        {
            name: sorted(m.step for m in client.get_metric_history(run.info.run_id, name))
            for name in names
        }
        for run in client.search_runs([experiment.experiment_id])
    ]  # the train stage's run has the curves; the evaluate stage's the final values
    assert {name: [0, 2] for name in names} in curves, curves


def test_s3_credentials_from_a_prefect_secret_block(
    prefect_harness: Path, s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from prefect.blocks.system import Secret

    from tasks.runtime import load_secret
    from titan_core.pipeline.run.common import redact
    from titan_core.pipeline.run.transfer import StorageError, check_storage, configure_credentials

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", s3_server.region)
    creds = {
        "aws_access_key_id": s3_server.access_key,
        "aws_secret_access_key": s3_server.secret_key,
        "endpoint_url": s3_server.endpoint_url,
    }
    Secret(value=json.dumps(creds)).save("titan-s3-test", overwrite=True)
    configure_credentials("titan-s3-test", load_secret)
    check_storage(s3_server.url("from-block"))  # reachable with the block's credentials only
    assert redact(f"key={s3_server.secret_key}") == "key=***"
    with pytest.raises(StorageError, match=r"^storage.credentials_block: cannot load 'nope'"):
        configure_credentials("nope", load_secret)
