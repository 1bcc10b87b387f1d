"""The ``local`` backend: one ``torchrun`` agent on this host, output streamed line by line."""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from titan_core.errors import ConfigError
from titan_core.launch import LaunchResult, LaunchSpec, LineCallback
from titan_core.launch.failures import LaunchError, describe_failure

_TAIL_LINES = 400  # enough to hold torchrun's failure report and the rank's last error
_TERM_GRACE_S = 10.0


class LocalLauncher:
    """Runs ``python -m torch.distributed.run`` with the spec's processes on this host."""

    def command(self, spec: LaunchSpec) -> list[str]:
        """The torchrun command line for ``spec``."""
        launch = spec.launch
        if launch.nnodes != 1:
            raise ConfigError(
                f"launch.nnodes: the local backend runs one node, expected 1, got {launch.nnodes}"
            )
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            f"--nproc_per_node={launch.nproc_per_node}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={launch.rdzv_endpoint or '127.0.0.1:0'}",
            f"--max_restarts={launch.max_restarts}",
            "--role=rank",
            "--tee=3",
        ]
        if launch.log_ranks != "all":
            cmd.append(f"--local-ranks-filter={launch.log_ranks}")
        if spec.log_dir:
            cmd.append(f"--log-dir={spec.log_dir}")
        return [*cmd, "-m", spec.module, *spec.args]

    def environment(self, spec: LaunchSpec) -> dict[str, str]:
        """This process's environment (less ``env_unset``) plus the spec's, threads, unbuffered."""
        env = {k: v for k, v in os.environ.items() if k not in spec.env_unset}
        env.update(spec.env, PYTHONUNBUFFERED="1")
        if spec.launch.omp_num_threads > 0:
            env["OMP_NUM_THREADS"] = str(spec.launch.omp_num_threads)
        return env

    def run(self, spec: LaunchSpec, on_line: LineCallback) -> LaunchResult:
        """Start torchrun, stream every output line to ``on_line``, map failures to errors."""
        cmd = self.command(spec)
        if spec.log_dir:
            os.makedirs(spec.log_dir, exist_ok=True)
        start = time.monotonic()
        tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            bufsize=1,
            env=self.environment(spec),
            cwd=spec.cwd,
            start_new_session=True,  # one process group: the agent and its workers
        )
        stack = contextlib.ExitStack()
        timed_out = threading.Event()
        timer = None
        if spec.timeout_s is not None:
            timer = threading.Timer(spec.timeout_s, _expire, (proc.pid, timed_out))
            timer.daemon = True
            timer.start()
        num_lines = 0
        try:
            stack.enter_context(_terminate_on_sigterm(proc))
            assert proc.stdout is not None
            for raw in proc.stdout:
                line = raw.rstrip("\n")
                tail.append(line)
                num_lines += 1
                on_line(line)
            returncode = proc.wait()
        except BaseException:
            _terminate(proc)
            raise
        finally:
            stack.close()
            if timer is not None:
                timer.cancel()
            _kill_group(proc.pid)  # no worker outlives its agent
            if proc.stdout is not None:
                proc.stdout.close()
        if timed_out.is_set():
            raise LaunchError(
                f"training: killed after the launch timeout of {spec.timeout_s:.0f}s",
                returncode=returncode,
                retryable=False,
            )
        if returncode != 0:
            raise describe_failure(returncode, list(tail))
        return LaunchResult(
            command=cmd,
            returncode=returncode,
            elapsed_s=time.monotonic() - start,
            num_lines=num_lines,
        )


@contextlib.contextmanager
def _terminate_on_sigterm(proc: subprocess.Popen[str]) -> Iterator[None]:
    """While the job runs, SIGTERM to this process (a cancelled flow run) ends the job first.

    The job runs in its own session, so the signal would not reach it otherwise.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may install handlers; the caller's cleanup still applies
        return
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: Any) -> None:
        _terminate(proc)
        if callable(previous):
            previous(signum, frame)
        else:
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminate(proc: subprocess.Popen[str]) -> None:
    """SIGTERM the job's process group, then SIGKILL it if it lingers."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=_TERM_GRACE_S)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        proc.wait()


def _expire(pgid: int, flag: threading.Event) -> None:
    flag.set()
    _kill_group(pgid)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
