"""Backends on this host: ``local`` (one torchrun agent) and ``local_multinode`` (``nnodes``
torchrun agents on loopback joined by a c10d rendezvous, as separate nodes would be).

Output of every agent is streamed line by line; a failure of any agent ends the others and
becomes one ``LaunchError``.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
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

import psutil

from titan_core.config.job import Launch
from titan_core.errors import ConfigError
from titan_core.launch.failures import LaunchError, describe_failure
from titan_core.launch.spec import LaunchResult, LaunchSpec, LineCallback
from titan_core.logging import RANK_PREFIX_ENV

TAIL_LINES = 400  # enough to hold torchrun's failure report and the rank's last error
# torchrun, told to stop, gives its workers 30 s before it kills them; then it is our turn.
_TERM_GRACE_S = 40.0
PEER_GRACE_S = 10.0
_PEER_TERM_GRACE_S = 5.0  # after one agent fails, the others get this long to notice and exit
# torchrun prefixes tee'd lines with the local rank unless told otherwise: global ranks, so that
# lines from several nodes stay apart and ``launch.log_ranks`` can pick them.
PREFIX_TEMPLATE_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
PREFIX_TEMPLATE = "[${role_name}${rank}]:"
NO_SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


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
    # torchrun tags every tee'd line with the rank: the engine's logger then adds no tag of its
    # own (no doubled "[rank0]:[rank0]").
    env = {"PYTHONUNBUFFERED": "1", PREFIX_TEMPLATE_ENV: PREFIX_TEMPLATE, RANK_PREFIX_ENV: "0"}
    # A fresh rendezvous store per round: torchrun's shared one keeps a killed attempt's keys
    # (see titan_core.distributed.utils._restart_store).
    env[NO_SHARED_STORE_ENV] = "1"
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

    def commands(self, spec: LaunchSpec) -> list[list[str]]:
        """One torchrun command per agent (same rendezvous endpoint and id, picked now)."""
        self.check(spec.launch)
        launch = spec.launch
        endpoint = launch.rdzv_endpoint or f"127.0.0.1:{_free_port()}"
        rdzv_id = f"titan-{uuid.uuid4().hex[:12]}"
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
    fails, the others get ``PEER_GRACE_S`` to notice before they are stopped.
    """
    if spec.log_dir:
        os.makedirs(spec.log_dir, exist_ok=True)
    start = time.monotonic()
    tails = [collections.deque[str](maxlen=TAIL_LINES) for _ in cmds]  # per agent, unprefixed
    lines: queue.Queue[tuple[int, str | None]] = queue.Queue()
    env = job_environment(spec)
    agents = _Agents()
    timed_out = threading.Event()
    timer = None
    num_lines = 0
    try:
        with terminate_on_sigterm(agents.stop):
            for i, cmd in enumerate(cmds):
                proc = agents.start(cmd, env, spec.cwd)
                threading.Thread(target=_pump, args=(i, proc, lines), daemon=True).start()
            if spec.timeout_s is not None:
                timer = threading.Timer(spec.timeout_s, _expire, (agents, timed_out))
                timer.daemon = True
                timer.start()
            open_streams = len(cmds)
            first_failed: int | None = None  # the agent whose failure ends the job
            while open_streams:
                agents.watch()
                try:
                    i, line = lines.get(timeout=0.5)
                except queue.Empty:
                    continue
                if line is None:
                    open_streams -= 1
                    if first_failed is None and agents.procs[i].wait() != 0:
                        first_failed = i
                    continue
                tails[i].append(line)
                if i and not line.startswith("[rank"):
                    line = f"[agent {i}] {line}"
                if accept(line):
                    num_lines += 1
                    on_line(line)
            codes = [p.wait() for p in agents.procs]
    except BaseException:
        agents.stop()
        raise
    finally:
        if timer is not None:
            timer.cancel()
        agents.close()
    if timed_out.is_set() and any(codes):
        raise LaunchError(
            f"training: killed after the launch timeout of {spec.timeout_s:.0f}s",
            returncode=next(c for c in codes if c),
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


class _Agents:
    """The torchrun agents of one launch and every process they start.

    torch starts each worker in a session of its own, so signalling an agent's process group
    does not reach its workers: the workers are tracked (psutil, which also guards against a
    reused pid) and killed with the agents when it comes to that. Agents also die with the
    thread that started them (``PR_SET_PDEATHSIG``), for a caller killed without cleanup.
    """

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.known: dict[int, psutil.Process] = {}
        self.failed_at: float | None = None
        self._lock = threading.RLock()  # stop() may run in a signal handler during track()
        self._last_scan = 0.0

    def start(self, cmd: list[str], env: dict[str, str], cwd: str | None) -> subprocess.Popen[str]:
        """Start one agent (its own session, output piped)."""
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            bufsize=1,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_die_with_parent,  # one preloaded libc call: safe with threads
        )
        with self._lock:
            self.procs.append(proc)
        return proc

    def track(self) -> None:
        """Remember every live descendant of the agents (workers, their helpers)."""
        with self._lock:
            for p in self.procs:
                with contextlib.suppress(psutil.Error):
                    for child in psutil.Process(p.pid).children(recursive=True):
                        self.known.setdefault(child.pid, child)

    def watch(self) -> None:
        """Each loop turn: track workers (twice a second); after an agent failed, stop the
        others once they have had ``PEER_GRACE_S`` to notice."""
        now = time.monotonic()
        if now - self._last_scan >= 0.5:
            self._last_scan = now
            self.track()
        if self.failed_at is None:
            if any(p.poll() not in (None, 0) for p in self.procs):
                self.failed_at = now
        elif now - self.failed_at > PEER_GRACE_S and any(p.poll() is None for p in self.procs):
            # An agent whose workers finished waits in torchrun's exit barrier (a blocking
            # store call that defers its SIGTERM handler): a short grace, then the kill.
            self.stop(grace=_PEER_TERM_GRACE_S)

    def stop(self, grace: float | None = None) -> None:
        """SIGTERM every agent (torchrun then stops its workers), SIGKILL what lingers."""
        self.track()
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + (_TERM_GRACE_S if grace is None else grace)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """SIGKILL the agents' process groups and every tracked descendant still running."""
        self.track()
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
        for child in list(self.known.values()):
            with contextlib.suppress(psutil.Error):
                if child.is_running():
                    child.kill()

    def close(self) -> None:
        """At the end: nothing of the job survives; pipes closed."""
        self.kill()
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=_TERM_GRACE_S)
            if p.stdout is not None:
                p.stdout.close()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the thread that started it goes away."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _load_prctl() -> Any:
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(None, use_errno=True).prctl
    return None


_PR_SET_PDEATHSIG = 1
_PRCTL = _load_prctl() if sys.platform == "linux" else None


def _expire(agents: _Agents, flag: threading.Event) -> None:
    flag.set()
    agents.stop()


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
