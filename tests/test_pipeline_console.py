"""What `titan pipeline run` prints when the input is wrong: one ``error:`` line on the console,
no traceback; the flow run's logs in the Prefect API (the UI) keep the traceback."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import free_port
from pipeline_helpers import flow_logs

ROOT = Path(__file__).resolve().parents[1]
AWS_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")


@pytest.mark.parametrize("case", ["tracking_down", "s3_without_credentials"])
def test_malformed_input_is_one_console_line_without_traceback(
    case: str, prefect_harness: Path, s3_server: Any, tmp_path: Path
) -> None:
    from prefect.settings import PREFECT_API_URL

    env = {k: v for k, v in os.environ.items() if k not in AWS_KEYS}
    env |= {"PREFECT_API_URL": str(PREFECT_API_URL.value()), "PREFECT_HOME": str(prefect_harness)}
    argv = ["--tracking.uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]
    if case == "tracking_down":
        argv = ["--tracking.uri", f"http://127.0.0.1:{free_port()}"]
        argv += ["--job.dump_folder", str(tmp_path / "out")]
        expected = "error: tracking.uri: no MLflow server answers"
    else:  # the S3 server is up, but this process has no credentials for it
        env |= {"AWS_ENDPOINT_URL": s3_server.endpoint_url, "AWS_EC2_METADATA_DISABLED": "true"}
        env |= {"AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
        argv += ["--job.dump_folder", s3_server.url("runs")]
        expected = "error: job.dump_folder:"
    started = datetime.datetime.now(datetime.UTC)
    proc = subprocess.run(
        [sys.executable, "-m", "titan_core.cli", "pipeline", "run", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    console = proc.stdout + proc.stderr
    assert proc.returncode == 2, console[-3000:]
    assert "Traceback" not in console, console[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(expected), console[-3000:]
    assert proc.stderr.rstrip().endswith(errors[0])  # the last thing printed
    if case == "s3_without_credentials":
        assert "NoCredentialsError" in errors[0] and "storage.credentials_block" in errors[0]
    assert any("Traceback" in message for message in flow_logs(_newest_flow_run(started)))


def _newest_flow_run(after: datetime.datetime) -> Any:
    """The id of the newest flow run created after ``after`` (the one the subprocess ran)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterStartTime

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(start_time=FlowRunFilterStartTime(after_=after))
        )
    assert runs, "the pipeline run is not in the Prefect API"
    return max(runs, key=lambda run: run.start_time).id


def test_the_printed_mlflow_ui_is_the_light_one_and_opens_the_training_view(
    tmp_path: Path,
) -> None:
    """The `mlflow ui` line printed after a run starts one web worker and no job runner, and
    its page is the run's experiment on MLflow's training view (not the GenAI one); a tracking
    server gets the page on that server."""
    import shlex
    import time
    import urllib.request

    import psutil

    from titan_core.pipeline.run.tracking import mlflow_ui

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    line = mlflow_ui(uri, {"mlflow_experiment_id": "3"})
    command, page = line.split("  (then open ")
    assert page == "http://127.0.0.1:5000/#/experiments/3?workflowType=machine_learning)"
    server = mlflow_ui("http://mlflow.internal:5000/", {"mlflow_experiment_id": "3"})
    assert server == "http://mlflow.internal:5000/#/experiments/3?workflowType=machine_learning"

    words = shlex.split(command)
    env = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
    argv = [w for w in words if w not in {f"{k}={v}" for k, v in env.items()}]
    port = free_port()
    argv[0] = str(Path(sys.executable).parent / "mlflow")
    proc = subprocess.Popen(
        [*argv, "--port", str(port)], env={**os.environ, **env}, cwd=tmp_path,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, (
                    "mlflow ui did not start"
                )
                time.sleep(0.5)
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        assert len(tree) <= 3, [p.cmdline() for p in tree]  # the default starts 15
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)


def test_rank_lines_reach_prefect_at_the_level_they_read_as() -> None:
    """Torch's warnings and titan's WARNING/ERROR lines stand out in the Prefect UI's log
    filter instead of all reading as INFO."""
    import logging

    from titan_core.pipeline.run.common import relay_line

    seen: list[tuple[int, str]] = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append((record.levelno, record.getMessage()))

    logger = logging.getLogger("relay-test")
    logger.addHandler(Recorder())
    logger.setLevel(logging.DEBUG)
    lines = [
        "[rank0]:[titan] 10:01:09 INFO step:     4  loss:   8.1129",
        "[rank1]:/x/torch/distributed/tensor/_dispatch.py:342: UserWarning: DTensor random ops",
        "[rank0]:[titan] 10:01:09 WARNING health: step 3: nonfinite loss nan -> skip",
        "[rank0]:[titan] 10:01:09 ERROR something failed",
        "[rank0]:[titan] 10:01:09 INFO the WarningCount of a model is not a warning",
    ]
    for line in lines:
        relay_line(logger, line)
    levels = [level for level, _ in seen]
    assert levels == [logging.INFO, logging.WARNING, logging.WARNING, logging.ERROR, logging.INFO]
