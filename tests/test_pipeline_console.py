"""What `titan pipeline run` prints when the input is wrong: one ``error:`` line on the console,
no traceback; the flow run's logs in the Prefect API (the UI) keep the traceback."""

from __future__ import annotations

import datetime
import os
import re
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
    filter instead of all reading as INFO; titan's INFO lines on how a rank set itself up go at
    DEBUG (the pipeline console shows them with -v), those on how training goes at INFO."""
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
        "[g1 rank0]:[titan] 10:01:09 INFO Saved checkpoint outputs/x/checkpoint/step-10 in 0.9s",
        "[rank0]:[titan] 10:01:09 INFO Model llama3 debugmodel_tiny: 393,536 parameters",
        "[rank0]:  if not random._rng_tracker and is_rng_supported_mesh(mesh):",
    ]
    for line in lines:
        relay_line(logger, line)
    levels = [level for level, _ in seen]
    info, debug, warning, error = logging.INFO, logging.DEBUG, logging.WARNING, logging.ERROR
    assert levels == [info, warning, warning, error, debug, info, debug, info]


# What a person at a terminal reads of a run: lines of log records in titan's one format (with
# a rank's tag where a rank said it), then the summary.
_LOG_LINE = re.compile(r"(\[(g\d+ )?rank\d+\]:)?\[titan\] \d\d:\d\d:\d\d (DEBUG|INFO|WARNING) \S")
_SUMMARY = ("pipeline: run ", "  ")
_PROGRESS_BAR = re.compile(r"dcp-to-hf ━+ ")
_BOILERPLATE = (
    "Finished in state",  # Prefect's task and flow states, at INFO
    "Beginning flow run",
    "View at http",
    "anonymous usage data",  # Prefect's telemetry notice, on a terminal's first run
    "Creating initial MLflow database tables",
    "alembic",
    " | INFO ",  # Prefect's own format
)
# Prefect's telemetry is off where these are set (CI): the notice must stay off without them.
_CI_VARIABLES = ("CI", "GITHUB_ACTIONS", "GITLAB_CI", "BUILDKITE", "JENKINS_URL", "CI_NAME")


@pytest.mark.multiprocess
def test_a_pipeline_run_prints_a_short_console_in_one_format(
    prefect_harness: Path, assets: Path
) -> None:
    """A 10-step `titan pipeline run` on a terminal, from a project folder, recorded on a
    Prefect server (``PREFECT_API_URL``, as docs/deployments.md sets it) into a new MLflow
    database: at most 25 rows, none over 160 characters, each a log line in titan's format, a
    progress bar or the closing lines, and no Prefect or MLflow boilerplate; the launch command
    is in the Prefect UI, not on the console."""
    import tempfile

    from prefect.settings import PREFECT_API_URL

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    for name in ("DO_NOT_TRACK", *_CI_VARIABLES):
        env.pop(name, None)
    env |= {"PREFECT_API_URL": str(PREFECT_API_URL.value()), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "titan_core.cli", "pipeline", "run"]
    argv += ["--config", "llama3_debugmodel_tiny", "--training.steps", "10"]
    argv += ["--job.dump_folder", "out", "--evaluate.batches", "2"]
    started = datetime.datetime.now(datetime.UTC)
    # A folder of a length people have (pytest's own are longer than most).
    with tempfile.TemporaryDirectory(prefix="proj-") as project:
        env["PREFECT_HOME"] = f"{project}/prefect"  # a first run: Prefect's notice would show
        code, rows = _run_in_terminal(argv, env, Path(project), timeout=600)
    console = "\n".join(rows)
    assert code == 0, console[-5000:]
    assert len(rows) <= 25 and max(map(len, rows)) <= 160, console
    kinds = (_LOG_LINE.match, _PROGRESS_BAR.match, lambda row: row.startswith(_SUMMARY))
    assert all(any(kind(row) for kind in kinds) for row in rows), console
    assert not [row for row in rows if any(b in row for b in _BOILERPLATE)], console
    assert rows[-1].startswith("  Prefect UI: ") and "Launching (local)" not in console
    assert " step: 10 loss: " in console  # the ranks' progress is there
    logs = flow_logs(_newest_flow_run(started))
    assert [m for m in logs if m.startswith("Launching (local): ")], logs


def test_v_shows_the_stages_debug_lines(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``titan pipeline run -v`` sets the level of the console handler of the stages' lines
    (Prefect's override of an item of titan's logging config) to DEBUG: the launch command."""
    from prefect.logging.configuration import load_logging_config

    from titan_core.cli.pipeline import PIPELINE_RUN, prepare_prefect_env
    from titan_core.pipeline.run.console import LOGGING_CONFIG, VERBOSE_ENV, console_settings

    for name in (VERBOSE_ENV, *console_settings()):
        monkeypatch.delenv(name, raising=False)  # restored after the test
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))

    def console_level() -> str:
        return load_logging_config(LOGGING_CONFIG)["handlers"]["titan_console"]["level"]

    assert not PIPELINE_RUN.parse([]).options.verbose
    prepare_prefect_env(PIPELINE_RUN.parse([]).options.verbose)
    assert console_level() == "INFO"
    assert PIPELINE_RUN.parse(["-v", "--training.steps", "3"]).options.verbose
    prepare_prefect_env(PIPELINE_RUN.parse(["-v"]).options.verbose)
    assert console_level() == "DEBUG"


def _run_in_terminal(
    argv: list[str], env: dict[str, str], cwd: Path, timeout: float
) -> tuple[int, list[str]]:
    """Run ``argv`` on a pseudo-terminal of 160 columns, as a person would; its exit code and
    the rows the terminal shows at the end (``_screen``)."""
    import fcntl
    import pty
    import select
    import struct
    import termios
    import time

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
    env = {**env, "TERM": "xterm-256color", "COLUMNS": "160"}
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break  # ended, and nothing more to read
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: no process holds the terminal any more
                break
            if not chunk:
                break
            chunks.append(chunk)
        else:
            proc.kill()
            pytest.fail(f"{argv} still running after {timeout}s")
        code = proc.wait(timeout=60)
    finally:
        os.close(master)
    return code, _screen(b"".join(chunks).decode(errors="replace"))


def _screen(text: str) -> list[str]:
    """The rows a terminal shows after ``text``: lines, carriage returns, erased lines and the
    cursor moved up (a progress bar redrawn in place) as a terminal does them; colours and other
    control sequences leave no mark."""
    rows, row, col = [""], 0, 0
    for token in re.findall(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b.|\r|\n|[^\x1b\r\n]+", text):
        if token == "\n":
            row, col = row + 1, 0
            rows += [""] * (row == len(rows))
        elif token == "\r":
            col = 0
        elif token.startswith("\x1b["):
            arg, kind = token[2:-1], token[-1]
            if kind == "A":
                row = max(0, row - int(arg or 1))
            elif kind == "K":
                rows[row] = "" if arg == "2" else rows[row][:col]
        elif not token.startswith("\x1b"):
            rows[row] = rows[row][:col].ljust(col) + token + rows[row][col + len(token) :]
            col += len(token)
    while rows and not rows[-1]:
        rows.pop()
    return rows
