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
