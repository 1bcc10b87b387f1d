"""Backends on this host: ``local`` (one torchrun agent) and ``local_multinode`` (``nnodes``
torchrun agents on loopback joined by a c10d rendezvous, as separate nodes would be).

Output of every agent is streamed line by line; a failure of any agent ends the others and
becomes one ``LaunchError``.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from titan_core.config.job import Launch
from titan_core.errors import ConfigError
from titan_core.launch.failures import LaunchError, describe_failure
from titan_core.launch.spec import LaunchResult, LaunchSpec, LineCallback

TAIL_LINES = 400  # enough to hold torchrun's failure report and the rank's last error
_TERM_GRACE_S = 10.0
_PEER_GRACE_S = 30.0  # after one agent fails, the others get this long to notice and exit
# torchrun prefixes tee'd lines with the local rank unless told otherwise: global ranks, so that
# lines from several nodes stay apart and ``launch.log_ranks`` can pick them.
PREFIX_TEMPLATE_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
PREFIX_TEMPLATE = "[${role_name}${rank}]:"


def torchrun_args(
    launch: Launch,
    *,
    nnodes: int,
    endpoint: str,
    rdzv_id: str = "",
    log_dir: str = "",
    local_ranks_filter: bool = True,
) -> list[str]:
    """torchrun's options for ``launch`` (without the interpreter and the module).

    ``local_ranks_filter``: pass ``launch.log_ranks`` to torchrun (one node: local = global
    ranks); with several nodes every rank is tee'd and ``rank_filter`` picks lines instead.
    """
    args = [
        f"--nnodes={nnodes}",
        f"--nproc_per_node={launch.nproc_per_node}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={endpoint}",
    ]
    if rdzv_id:
        args.append(f"--rdzv_id={rdzv_id}")
    args += [f"--max_restarts={launch.max_restarts}", "--role=rank", "--tee=3"]
    if local_ranks_filter and launch.log_ranks != "all":
        args.append(f"--local-ranks-filter={launch.log_ranks}")
    if log_dir:
        args.append(f"--log-dir={log_dir}")
    return args


def rank_filter(log_ranks: str) -> Callable[[str], bool]:
    """Whether to stream a line: torchrun prefixes rank output ``[rankN]:``; other lines (the
    agents' own) always pass."""
    if log_ranks == "all":
        return lambda line: True
    keep = {int(r) for r in log_ranks.split(",")}

    def accept(line: str) -> bool:
        if not line.startswith("[rank"):
            return True
        head = line[5 : line.find("]")]
        return not head.isdigit() or int(head) in keep

    return accept


def launcher_variables(launch: Launch) -> dict[str, str]:
    """The variables every backend sets for its job (threads, unbuffered output, rank tags)."""
    env = {"PYTHONUNBUFFERED": "1", PREFIX_TEMPLATE_ENV: PREFIX_TEMPLATE}
    if launch.omp_num_threads > 0:
        env["OMP_NUM_THREADS"] = str(launch.omp_num_threads)
    return env


def job_environment(spec: LaunchSpec) -> dict[str, str]:
    """This process's environment (less ``env_unset``) plus the spec's and the launcher's."""
    env = {k: v for k, v in os.environ.items() if k not in spec.env_unset}
    env.update(spec.env)
    env.update(launcher_variables(spec.launch))
    return env


def shell_lines(cmds: list[list[str]], spec: LaunchSpec, background: bool = False) -> str:
    """``cmds`` as pasteable shell lines with the environment changes the launcher makes; the
    spec's own variables are named in a comment, never shown (they may hold credentials)."""
    unset = [f"-u {shlex.quote(k)}" for k in sorted(spec.env_unset)]
    sets = [f"{k}={shlex.quote(v)}" for k, v in launcher_variables(spec.launch).items()]
    lines = [f"# plus from the caller's environment: {' '.join(sorted(spec.env))}"] * bool(spec.env)
    for cmd in cmds:
        lines.append(" ".join(["env", *unset, *sets, shlex.join(cmd)]) + " &" * background)
    return "\n".join(lines + ["wait"] * background)


class LocalLauncher:
    """``local``: ``python -m torch.distributed.run`` with the spec's processes on this host."""

    def check(self, launch: Launch) -> None:
        """``ConfigError`` for settings this backend cannot run."""
        if launch.nnodes != 1:
            raise ConfigError(
                f"launch.nnodes: the local backend runs one node, expected 1, got {launch.nnodes} "
                "(launch.backend = local_multinode or slurm run several)"
            )

    def probe(self) -> None:
        """Nothing to check: torchrun comes with torch."""

    def command(self, spec: LaunchSpec) -> list[str]:
        """The torchrun command line for ``spec``."""
        self.check(spec.launch)
        opts = torchrun_args(
            spec.launch,
            nnodes=1,
            endpoint=spec.launch.rdzv_endpoint or "127.0.0.1:0",
            log_dir=spec.log_dir or "",
        )
        return [sys.executable, "-m", "torch.distributed.run", *opts, "-m", spec.module, *spec.args]

    def render(self, spec: LaunchSpec) -> str:
        """The exact command line, shell-quoted, with the environment the launcher sets."""
        return shell_lines([self.command(spec)], spec)

    def run(self, spec: LaunchSpec, on_line: LineCallback) -> LaunchResult:
        """Start torchrun, stream every output line to ``on_line``, map failures to errors."""
        cmd = self.command(spec)
        return run_agents([cmd], spec, on_line, accept=lambda line: True)


class LocalMultinodeLauncher:
    """``local_multinode``: ``launch.nnodes`` torchrun agents on loopback, one c10d rendezvous.

    Each agent stands for a node (as under Slurm or Kubernetes): the job exercises multi-node
    rendezvous, rank assignment and teardown without a cluster.
    """

    def check(self, launch: Launch) -> None:
        """Any node count works; the rendezvous endpoint must be on this host."""
        host = launch.rdzv_endpoint.rpartition(":")[0]
        if host and host not in ("127.0.0.1", "localhost", socket.gethostname()):
            raise ConfigError(
                f"launch.rdzv_endpoint: local_multinode rendezvous on this host, expected "
                f"127.0.0.1:PORT or empty, got {launch.rdzv_endpoint!r}"
            )

    def probe(self) -> None:
        """Nothing to check: torchrun comes with torch."""

    def commands(self, spec: LaunchSpec, endpoint: str = "", rdzv_id: str = "") -> list[list[str]]:
        """One torchrun command per agent (same rendezvous endpoint and id)."""
        self.check(spec.launch)
        launch = spec.launch
        endpoint = endpoint or launch.rdzv_endpoint or f"127.0.0.1:{_free_port()}"
        rdzv_id = rdzv_id or f"titan-{uuid.uuid4().hex[:12]}"
        cmds = []
        for node in range(launch.nnodes):
            opts = torchrun_args(
                launch,
                nnodes=launch.nnodes,
                endpoint=endpoint,
                rdzv_id=rdzv_id,
                log_dir=os.path.join(spec.log_dir, f"agent{node}") if spec.log_dir else "",
                local_ranks_filter=False,
            )
            torchrun = [sys.executable, "-m", "torch.distributed.run", *opts]
            cmds.append([*torchrun, "-m", spec.module, *spec.args])
        return cmds

    def render(self, spec: LaunchSpec) -> str:
        """The agents' command lines, one per line (the port is picked now)."""
        return shell_lines(self.commands(spec), spec, background=True)

    def run(self, spec: LaunchSpec, on_line: LineCallback) -> LaunchResult:
        """Start every agent, stream their lines (ranks per ``launch.log_ranks``), wait."""
        return run_agents(self.commands(spec), spec, on_line, rank_filter(spec.launch.log_ranks))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_agents(
    cmds: Sequence[list[str]],
    spec: LaunchSpec,
    on_line: LineCallback,
    accept: Callable[[str], bool],
) -> LaunchResult:
    """Run the agent commands to completion, streaming ``accept``-ed lines to ``on_line``.

    Lines of agent i > 0 that are not rank output get an ``[agent i]`` prefix. When an agent
    fails, the others get ``_PEER_GRACE_S`` to notice before they are killed.
    """
    if spec.log_dir:
        os.makedirs(spec.log_dir, exist_ok=True)
    start = time.monotonic()
    tails = [collections.deque[str](maxlen=TAIL_LINES) for _ in cmds]  # per agent, unprefixed
    lines: queue.Queue[tuple[int, str | None]] = queue.Queue()
    env = job_environment(spec)
    procs: list[subprocess.Popen[str]] = []
    readers: list[threading.Thread] = []
    timed_out = threading.Event()
    timer = None
    num_lines = 0
    try:
        with terminate_on_sigterm(lambda: _terminate_all(procs)):
            for i, cmd in enumerate(cmds):
                proc = subprocess.Popen(
                    cmd,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    text=True,
                    errors="replace",
                    bufsize=1,
                    env=env,
                    cwd=spec.cwd,
                    start_new_session=True,  # one process group: the agent and its workers
                )
                procs.append(proc)
                reader = threading.Thread(target=_pump, args=(i, proc, lines), daemon=True)
                reader.start()
                readers.append(reader)
            if spec.timeout_s is not None:
                timer = threading.Timer(spec.timeout_s, _expire, (procs, timed_out))
                timer.daemon = True
                timer.start()
            open_streams = len(procs)
            failed_at: float | None = None
            first_failed: int | None = None  # the agent whose failure ends the job
            while open_streams:
                try:
                    i, line = lines.get(timeout=0.5)
                except queue.Empty:
                    failed_at = _watch_peers(procs, failed_at)
                    continue
                if line is None:
                    open_streams -= 1
                    failed_at = _watch_peers(procs, failed_at)
                    if first_failed is None and procs[i].wait() != 0:
                        first_failed = i
                    continue
                tails[i].append(line)
                if i and not line.startswith("[rank"):
                    line = f"[agent {i}] {line}"
                if accept(line):
                    num_lines += 1
                    on_line(line)
            codes = [p.wait() for p in procs]
    except BaseException:
        _terminate_all(procs)
        raise
    finally:
        if timer is not None:
            timer.cancel()
        for p in procs:
            _kill_group(p.pid)  # no worker outlives its agent
            if p.stdout is not None:
                p.stdout.close()
    if timed_out.is_set():
        raise LaunchError(
            f"training: killed after the launch timeout of {spec.timeout_s:.0f}s",
            returncode=next((c for c in codes if c), -signal.SIGKILL),
            retryable=False,
        )
    if any(codes):
        if first_failed is None or not codes[first_failed]:
            first_failed = next(i for i, c in enumerate(codes) if c)
        raise describe_failure(codes[first_failed], list(tails[first_failed]))
    return LaunchResult(
        command=list(cmds[0]),
        returncode=0,
        elapsed_s=time.monotonic() - start,
        num_lines=num_lines,
    )


def _pump(i: int, proc: subprocess.Popen[str], out: queue.Queue[tuple[int, str | None]]) -> None:
    """Reader thread: one agent's lines into the shared queue, then ``None``."""
    assert proc.stdout is not None
    with contextlib.suppress(ValueError, OSError):  # closed under us at teardown
        for raw in proc.stdout:
            out.put((i, raw.rstrip("\n")))
    out.put((i, None))


def _watch_peers(procs: Sequence[subprocess.Popen[str]], failed_at: float | None) -> float | None:
    """After an agent failed, kill the rest once the grace period is over."""
    if failed_at is None:
        if any(p.poll() not in (None, 0) for p in procs):
            return time.monotonic()
        return None
    if time.monotonic() - failed_at > _PEER_GRACE_S:
        for p in procs:
            if p.poll() is None:
                _kill_group(p.pid)
    return failed_at


@contextlib.contextmanager
def terminate_on_sigterm(stop: Callable[[], None]) -> Iterator[None]:
    """While a job runs, SIGTERM to this process (a cancelled flow run) calls ``stop`` first.

    The job runs in its own session (or on a cluster), so the signal would not reach it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may install handlers; the caller's cleanup still applies
        return
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: Any) -> None:
        stop()
        if callable(previous):
            previous(signum, frame)
        else:
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminate_all(procs: Sequence[subprocess.Popen[str]]) -> None:
    """SIGTERM every agent's process group, then SIGKILL what lingers."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + _TERM_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill_group(p.pid)
            p.wait()


def _expire(procs: Sequence[subprocess.Popen[str]], flag: threading.Event) -> None:
    flag.set()
    for p in procs:
        _kill_group(p.pid)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
