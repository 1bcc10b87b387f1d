"""Real Prefect and MLflow servers for deployment and tracking tests.

``start_prefect_server(workdir)`` runs ``prefect server start`` on a free loopback port with its
own ``PREFECT_HOME`` (analytics off, scheduler polling fast) and returns a ``PrefectServer`` whose
``env`` points clients (CLI, workers, flow runs) at it. ``start_worker`` runs a process-pool
``prefect worker``; ``stop()`` sends it the two SIGINTs it needs. ``start_mlflow_server`` runs
``mlflow server`` on SQLite with artifacts proxied to an S3 destination.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from helpers import free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
_READY_TIMEOUT_S = 90.0


def _wait_http(url: str, process: subprocess.Popen[bytes], log: Path, what: str) -> None:
    """Poll ``url`` until it answers 200; fail fast with the log tail if the process died."""
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{what} exited with {process.returncode}; log tail:\n{tail}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as resp:
            if resp.status == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready after {_READY_TIMEOUT_S}s: {url}")


def _stop(process: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 20) -> None:
    """Signal a process group, then kill it if it lingers."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


@dataclass
class PrefectWorker:
    """A running ``prefect worker start`` (its own process group)."""

    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        """Everything the worker (and its flow runs) printed so far."""
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """Two SIGINTs (the first starts a graceful shutdown), then SIGKILL if it lingers."""
        if self.process.poll() is not None:
            return
        for _ in range(2):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=5)
                return
            except subprocess.TimeoutExpired:
                pass
        _stop(self.process, signal.SIGKILL)


@dataclass
class PrefectServer:
    """A running ``prefect server``: its API URL and the environment clients need."""

    api_url: str
    home: Path
    process: subprocess.Popen[bytes]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)

    def cli(
        self, *args: str, timeout: float = 180, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run ``prefect ARGS`` from the project root against this server."""
        proc = subprocess.run(
            [str(BIN / "prefect"), *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"prefect {' '.join(args)} → {proc.returncode}\n{proc.stdout[-3000:]}"
                f"\n{proc.stderr[-3000:]}"
            )
        return proc

    def start_worker(
        self, pool: str, workdir: Path, env: dict[str, str] | None = None
    ) -> PrefectWorker:
        """A process-pool worker polling every second; flow runs inherit ``env``."""
        log_path = workdir / f"worker-{pool}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                [str(BIN / "prefect"), "worker", "start", "--pool", pool, "--type", "process"],
                cwd=workdir,
                env={**self.env, **(env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return PrefectWorker(process, log_path)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL)."""
        _stop(self.process)


def prefect_env(home: Path, api_url: str = "") -> dict[str, str]:
    """Environment for Prefect processes: own home, analytics off, fast polling."""
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_CLI_PROMPT": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_WORKER_PREFETCH_SECONDS": "5",
        "PREFECT_RUNNER_POLL_FREQUENCY": "2",
        "PREFECT_LOGGING_LEVEL": "INFO",
        "OMP_NUM_THREADS": "1",
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    env.pop("PREFECT_PROFILES_PATH", None)
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def start_prefect_server(workdir: Path) -> PrefectServer:
    """``prefect server start`` on a free port under ``workdir``; returns once healthy."""
    home = workdir / "prefect_home"
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = prefect_env(home)
    env.pop("PREFECT_API_URL", None)
    # Pick up new deployments and schedules quickly; the UI is not needed.
    env["PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS"] = "2"
    env["PREFECT_SERVER_SERVICES_SCHEDULER_RECENT_DEPLOYMENTS_LOOP_SECONDS"] = "1"
    env["PREFECT_SERVER_UI_ENABLED"] = "false"
    log_path = workdir / "prefect-server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            cwd=workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = PrefectServer(api_url, home, process, log_path, prefect_env(home, api_url))
    try:
        _wait_http(f"{api_url}/health", process, log_path, "prefect server")
    except BaseException:
        server.stop()
        raise
    return server


@dataclass
class MlflowServer:
    """A running ``mlflow server``: its tracking URI."""

    uri: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def stop(self) -> None:
        """Stop the server and its gunicorn/uvicorn workers."""
        _stop(self.process)


def start_mlflow_server(workdir: Path, artifacts: str, env: dict[str, str]) -> MlflowServer:
    """``mlflow server`` on SQLite with artifacts proxied to ``artifacts`` (e.g. ``s3://b/p``).

    ``env`` carries the S3 endpoint and credentials for the server only: clients talk HTTP.
    """
    port = free_port()
    log_path = workdir / "mlflow-server.log"
    server_env = {
        **os.environ,
        **env,
        "MLFLOW_S3_ENDPOINT_URL": env.get("AWS_ENDPOINT_URL", ""),
        # Without this the server starts a job runner: ~10 processes, ~2.4 GB.
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }
    cmd = [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--backend-store-uri", f"sqlite:///{workdir / 'mlflow.db'}"]
    cmd += ["--artifacts-destination", artifacts, "--workers", "1"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            cmd,
            cwd=workdir,
            env=server_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = MlflowServer(f"http://127.0.0.1:{port}", process, log_path)
    try:
        _wait_http(f"{server.uri}/health", process, log_path, "mlflow server")
    except BaseException:
        server.stop()
        raise
    return server
