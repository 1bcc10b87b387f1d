"""Running a job's torchrun agents on this host and supervising them to the end.

``run_agents`` starts the agent commands, streams their output line by line, ends the others
when one fails (after ``PEER_GRACE_S``), enforces the launch timeout and leaves no process of
the job behind, whatever way it ends. ``terminate_on_sigterm`` stops a job (local or on a
cluster) when this process is told to stop.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psutil

from titan_core.launch.failures import TAIL_LINES, LaunchError, describe_failure, worker_failed
from titan_core.launch.spec import LaunchResult, LaunchSpec, LineCallback
from titan_core.launch.torchrun import job_environment

# torchrun, told to stop, gives its workers 30 s before it kills them; then it is our turn.
_TERM_GRACE_S = 40.0
PEER_GRACE_S = 10.0
_PEER_TERM_GRACE_S = 5.0  # after one agent fails, the others get this long to notice and exit

# torchrun's report of a failed worker: an error log line per worker, then (as it exits) a
# traceback of its own.
AGENT_FAILED_RE = re.compile(r"^E\d{4} .*torch/distributed/elastic/.*\] failed \(exitcode")
CHILD_FAILED_RE = re.compile(r"ChildFailedError|Root Cause \(first observed failure\)")
_Lines = queue.Queue[tuple[int, str | None]]  # (agent, line); None: the agent's output ended
_Tails = list[collections.deque[str]]  # per agent, its last lines, unprefixed


def run_agents(
    cmds: Sequence[list[str]],
    spec: LaunchSpec,
    on_line: LineCallback,
    accept: Callable[[str], bool],
    independent: bool = False,
    tags: Sequence[str] = (),
) -> LaunchResult:
    """Run the agent commands to completion, streaming ``accept``-ed lines to ``on_line``.

    Lines of agent i > 0 that are not rank output get an ``[agent i]`` prefix; with ``tags``
    (one per agent: the replica groups' ``g0``, ``g1``) every line carries its agent's tag,
    ``[g1 rank0]:`` for a rank's, ``[g1]`` for the agent's own. When an agent fails, the others
    get ``PEER_GRACE_S`` to notice before they are stopped; ``independent`` agents
    (fault-tolerant replica groups) run on, and the job fails only if every one does.
    """
    if spec.log_dir:
        os.makedirs(spec.log_dir, exist_ok=True)
    start = time.monotonic()
    tails: _Tails = [collections.deque[str](maxlen=TAIL_LINES) for _ in cmds]
    lines: _Lines = queue.Queue()
    env = job_environment(spec)
    agents = _Agents(independent)
    timed_out = threading.Event()
    timer = None
    try:
        with terminate_on_sigterm(agents.stop):
            for i, cmd in enumerate(cmds):
                proc = agents.start(cmd, env, spec.cwd)
                threading.Thread(target=_pump, args=(i, proc, lines), daemon=True).start()
            if spec.timeout_s is not None:
                timer = threading.Timer(spec.timeout_s, _expire, (agents, timed_out))
                timer.daemon = True
                timer.start()
            held: list[str] = []
            stream = _Stream(on_line, accept, tags, spec.launch.max_restarts, len(cmds))
            num_lines, first_failed = stream.run(agents, lines, tails, held)
            codes = [p.wait() for p in agents.procs]
    except BaseException:
        agents.stop()
        raise
    finally:
        if timer is not None:
            timer.cancel()
        agents.close()
    if not any(codes) or not any(CHILD_FAILED_RE.search(line) for line in held):
        for line in filter(accept, held):  # not torchrun's report of a failed rank: news
            on_line(line)
    if independent and not all(codes) and not timed_out.is_set():
        for i, code in enumerate(codes):  # the others finished the job without it
            if code:
                on_line(stream.shown(i, _failure([code], 0, [tails[i]], spec, False).args[0]))
    elif any(codes):
        raise _failure(codes, first_failed, tails, spec, timed_out.is_set())
    return LaunchResult(
        command=list(cmds[0]),
        returncode=0,
        elapsed_s=time.monotonic() - start,
        num_lines=num_lines,
    )


class _Stream:
    """How the agents' lines are passed on: tagged by agent, torchrun's report of a failed
    worker said in one line when the job goes on without it (a restart, or independent
    agents), held back when the job's one-line error will replace it."""

    def __init__(
        self,
        on_line: LineCallback,
        accept: Callable[[str], bool],
        tags: Sequence[str],
        max_restarts: int,
        num_agents: int,
    ) -> None:
        self.on_line, self.accept, self.tags = on_line, accept, tags
        self.max_restarts = max_restarts
        self.failures = [0] * num_agents  # torchrun's failed rounds, by agent
        # torchrun names a worker by its local rank: the rank of its agent's job (a replica
        # group's, or the whole job's on one node), a node's rank among several otherwise.
        self.who = "local rank" if num_agents > 1 and not tags else "rank"

    def shown(self, i: int, line: str) -> str:
        """``line`` of agent ``i`` as streamed."""
        rank_line = line.startswith("[rank")
        if self.tags:
            return f"[{self.tags[i]} {line[1:]}" if rank_line else f"[{self.tags[i]}] {line}"
        return f"[agent {i}] {line}" if i and not rank_line else line

    def run(
        self, agents: _Agents, lines: _Lines, tails: _Tails, held: list[str]
    ) -> tuple[int, int | None]:
        """Pass the agents' lines on until every agent's output has ended; returns the number
        of lines streamed and the agent whose failure ends the job (None: none failed first).

        An agent's report of a failed worker (its error line; its traceback, from which on it
        says nothing else) goes to ``held`` unless the job goes on: the job's one-line error
        replaces it.
        """
        holding = [False] * len(tails)
        open_streams = len(tails)
        first_failed: int | None = None
        num_lines = 0
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
            agent_line = not line.startswith("[rank")
            holding[i] = holding[i] or (agent_line and line.startswith("Traceback (most recent"))
            failed = agent_line and bool(AGENT_FAILED_RE.match(line))
            if failed and (news := self._worker_failed(i, line, agents.independent)):
                line = news  # said now: the job goes on without that worker
            elif holding[i] or failed:
                held.append(self.shown(i, line))
                continue
            if self.accept(line):
                num_lines += 1
                self.on_line(self.shown(i, line))
        return num_lines, first_failed

    def _worker_failed(self, i: int, line: str, independent: bool) -> str | None:
        """The line saying that agent ``i``'s worker failed (torchrun's ``line``), when the
        job goes on: torchrun restarts the workers, or the agents are independent."""
        self.failures[i] += 1
        restarts = self.failures[i] <= self.max_restarts
        if not (restarts or independent) or not (what := worker_failed(line)):
            return None
        workers = "the group" if self.tags else "the workers"
        then = (
            f"torchrun restarts {workers} (restart {self.failures[i]} of {self.max_restarts})"
            if restarts
            else f"no restarts left (launch.max_restarts {self.max_restarts})"
        )
        return f"launch: {self.who} {what}; {then}"


def _failure(
    codes: list[int], first_failed: int | None, tails: _Tails, spec: LaunchSpec, timed_out: bool
) -> LaunchError:
    """The error of a job some agent of which exited non-zero."""
    if timed_out:
        return LaunchError(
            f"training: killed after the launch timeout of {spec.timeout_s:.0f}s",
            returncode=next(c for c in codes if c),
            retryable=False,
        )
    if first_failed is None or not codes[first_failed]:
        first_failed = next(i for i, c in enumerate(codes) if c)
    return describe_failure(codes[first_failed], list(tails[first_failed]))


_RANK_HEADER_RE = re.compile(r"\[rank\d+\]:")


def _one_write(line: str) -> str:
    """A rank's line as the rank wrote it: torchrun's tee prefixes every read of a rank's log,
    and a read that ends mid-line makes ``[rank0]:error: …[rank0]:`` of one line written in
    two parts (its newline came later)."""
    if not (m := _RANK_HEADER_RE.match(line)):
        return line
    return m.group(0) + line[m.end() :].replace(m.group(0), "")


def _pump(i: int, proc: subprocess.Popen[str], out: _Lines) -> None:
    """Reader thread: one agent's lines into the shared queue, then ``None``."""
    assert proc.stdout is not None
    with contextlib.suppress(ValueError, OSError):  # closed under us at teardown
        for raw in proc.stdout:
            out.put((i, _one_write(raw.rstrip("\n"))))
    out.put((i, None))


class _Agents:
    """The torchrun agents of one launch and every process they start.

    torch starts each worker in a session of its own, so signalling an agent's process group
    does not reach its workers: the workers are tracked (psutil, which also guards against a
    reused pid) and killed with the agents when it comes to that. Agents also die with the
    thread that started them (``PR_SET_PDEATHSIG``), for a caller killed without cleanup.
    """

    def __init__(self, independent: bool = False) -> None:
        self.independent = independent  # one agent's failure does not end the others
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
        if self.independent:
            return
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
