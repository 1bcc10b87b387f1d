"""The ``slurm`` backend: submit the batch script (``slurm_script``), follow the job to its end.

``run`` submits with ``sbatch --parsable``, polls ``squeue`` every ``launch.slurm.poll_seconds``
(never ``sbatch --wait``), streams the job's output file as it grows, maps the final job state
(``scontrol show job``) to a result or a one-line ``LaunchError`` that names the state, and
cancels the job (``scancel``) if the caller is interrupted or times out.

The job inherits the submitting environment (``--export=ALL``): credentials and the spec's
``env`` travel that way and are never written into the script. The nodes must see this
checkout and its interpreter (``launch.slurm.python``) at the same paths, as on any shared
filesystem.
"""

from __future__ import annotations

import codecs
import collections
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from titan_core import storage
from titan_core.config.job import Launch
from titan_core.errors import ConfigError
from titan_core.launch import slurm_script
from titan_core.launch.failures import (
    TAIL_LINES,
    USER_ERROR_RE,
    LaunchError,
    describe_failure,
    signal_name,
)
from titan_core.launch.spec import LaunchResult, LaunchSpec, LineCallback
from titan_core.launch.supervise import AGENT_FAILED_RE, CHILD_FAILED_RE, terminate_on_sigterm
from titan_core.launch.torchrun import job_environment, rank_filter
from titan_core.logging import logger

CLIENTS = ("sbatch", "squeue", "scontrol", "scancel")
_OUTPUT_POLL_S = 0.5  # how often the output file is read between squeue polls
_SRUN_TASK_RE = re.compile(r"srun: error: (?P<node>\S+): task (?P<task>\d+): (?P<what>.+)$")
_CLIENT_TIMEOUT_S = 60.0
_TIMED_OUT = 124  # the returncode _client gives a client that did not answer in time
_MAX_QUERY_FAILURES = 30  # squeue failures in a row before the job counts as lost
# Final states (squeue/scontrol JobState) → whether a relaunch could help.
_RETRYABLE_STATES = {
    "FAILED": True,  # refined by torchrun's report (a rejected config is final)
    "TIMEOUT": True,  # the relaunch resumes from the newest checkpoint
    "NODE_FAIL": True,
    "PREEMPTED": True,
    "BOOT_FAIL": True,
    "CANCELLED": False,
    "OUT_OF_MEMORY": False,
    "DEADLINE": False,
    "REVOKED": False,
    "SPECIAL_EXIT": False,
}
_ACTIVE_STATES = {
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "SUSPENDED",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "RESIZING",
    "SIGNALING",
    "STAGE_OUT",
    "STOPPED",
}


class SlurmLauncher:
    """``slurm``: render an sbatch script, submit it, follow the job to its end.

    ``script``: what renders the batch script (default ``slurm_script.render``; the replica
    groups of a fault-tolerant job bring their own).
    """

    def __init__(self, script: Callable[[LaunchSpec], str] | None = None) -> None:
        self.script = script or slurm_script.render

    def check(self, launch: Launch) -> None:
        """Settings only (a dry run needs no cluster); ``probe`` checks this machine."""
        if launch.rdzv_endpoint.startswith(("127.", "localhost")) and launch.nnodes > 1:
            raise ConfigError(
                f"launch.rdzv_endpoint: {launch.rdzv_endpoint} is loopback, which other nodes "
                "cannot reach; leave it empty (the head node's address, per job)"
            )

    def probe(self) -> None:
        """``ConfigError`` if Slurm's clients are not here (not a login node)."""
        missing = [c for c in CLIENTS if shutil.which(c) is None]
        if missing:
            raise ConfigError(
                f"launch.backend: slurm needs {', '.join(missing)} on PATH (run from a Slurm "
                "login node), not found"
            )

    def render(self, spec: LaunchSpec) -> str:
        """The batch script for ``spec`` (paths resolved as ``run`` would)."""
        return self.script(spec)

    def run(self, spec: LaunchSpec, on_line: LineCallback) -> LaunchResult:
        """Submit, stream, wait; ``LaunchError`` naming the Slurm state on failure."""
        try:
            self.probe()
            text = self.script(spec)
        except ConfigError as e:
            raise LaunchError(str(e), returncode=2, retryable=False) from None
        start = time.monotonic()
        log_dir = Path(slurm_script.log_folder(spec))
        script = _write_script(log_dir, text)
        env = _submit_environment(spec)
        submit = ["sbatch", "--parsable", str(script)]
        job_id = _submit(submit, env, script)
        job = _Job(job_id, env, on_line)
        output = _Follower(log_dir / f"slurm-{job_id}.out", rank_filter(spec.launch.log_ranks))
        try:
            with terminate_on_sigterm(job.cancel):
                logger.info("Submitted Slurm job %s (%s)", job_id, script)
                on_line(f"titan: submitted Slurm job {job_id}; batch script {script}")
                name, exit_code, reason = self._follow(job, spec, output)
        except BaseException:
            job.cancel()  # an interrupted caller leaves no job behind
            raise
        output.drain(on_line, final=True)
        elapsed = time.monotonic() - start
        on_line(f"titan: Slurm job {job_id} ended {name} (exit code {exit_code or '?'})")
        if name == "COMPLETED" and exit_code in ("0:0", ""):
            return LaunchResult(
                command=submit,
                returncode=0,
                elapsed_s=elapsed,
                num_lines=output.num_lines,
                job_id=job_id,
            )
        raise _failure(job, spec, name, exit_code, reason, output)

    def _follow(self, job: _Job, spec: LaunchSpec, output: _Follower) -> tuple[str, str, str]:
        """Poll until the job has left the queue; returns (state, exit code, reason).

        A failed ``squeue`` call (busy controller) is not the end of the job: polling goes on,
        and only ``_MAX_QUERY_FAILURES`` failures in a row give up (cancelling the job).
        """
        poll = spec.launch.slurm.poll_seconds
        deadline = None if spec.timeout_s is None else time.monotonic() + spec.timeout_s
        last_state, next_poll, failures = "", 0.0, 0
        while True:
            output.drain(job.on_line)
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                job.timed_out = True
                job.cancel()
                deadline = None
            if now >= next_poll:
                next_poll = now + poll
                state, reason = _queue_state(job.id, job.env)
                if state is None:
                    failures += 1
                    if failures >= _MAX_QUERY_FAILURES:
                        job.cancel()
                        raise LaunchError(
                            f"training: lost track of Slurm job {job.id}: squeue failed "
                            f"{failures} times in a row; the job was cancelled",
                            returncode=1,
                            retryable=False,
                        )
                    continue
                failures = 0
                if state and state != last_state:
                    extra = f" ({reason})" if reason and reason != "None" else ""
                    job.on_line(f"titan: Slurm job {job.id} {state}{extra}")
                    last_state = state
                if not state or state not in _ACTIVE_STATES:
                    final = _final_state(job.id, job.env, state)
                    if final[0] not in _ACTIVE_STATES:
                        return final
            time.sleep(min(_OUTPUT_POLL_S, poll))


def _write_script(log_dir: Path, text: str) -> Path:
    """The batch script, written to a file of its own in the log folder."""
    path = log_dir / f"sbatch-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}.sh"
    storage.write_text(str(path), text)
    return path


def _submit(submit: list[str], env: dict[str, str], script: Path) -> str:
    """Run the ``sbatch`` command line ``submit``; the job id, or a ``LaunchError``."""
    res = _client(submit, env)
    if res.returncode == _TIMED_OUT:
        raise LaunchError(
            f"training: sbatch did not answer in {_CLIENT_TIMEOUT_S:.0f}s; the job may have "
            f"been submitted all the same: check squeue before relaunching ({script})",
            returncode=res.returncode,
            retryable=False,  # a relaunch could run the job twice
        )
    if res.returncode != 0:
        raise LaunchError(
            f"training: sbatch refused the job: {_last_line(res.stderr or res.stdout)}",
            returncode=res.returncode,
            retryable=False,
        )
    return res.stdout.strip().split(";")[0]


def _failure(
    job: _Job, spec: LaunchSpec, state: str, exit_code: str, reason: str, output: _Follower
) -> LaunchError:
    """The error of a job that did not complete: timed out, stopped in its setup, or failed."""
    if job.timed_out:
        return LaunchError(
            f"training: Slurm job {job.id} cancelled after the launch timeout of "
            f"{spec.timeout_s:.0f}s",
            returncode=1,
            retryable=False,
        )
    if state == "FAILED" and not output.reached_srun:
        return LaunchError(
            f"training: Slurm job {job.id} FAILED before srun started (exit code "
            f"{exit_code or '?'}): check launch.slurm.setup; output in {output.path}",
            returncode=1,
            retryable=False,  # the same script would fail the same way
        )
    return _job_error(job.id, state, exit_code, reason, list(output.tail), output.path)


class _Job:
    """A submitted job: its id, the clients' environment, and cancelling it (once)."""

    def __init__(self, job_id: str, env: dict[str, str], on_line: LineCallback) -> None:
        self.id = job_id
        self.env = env
        self.on_line = on_line
        self.cancelled = False
        self.timed_out = False

    def cancel(self) -> None:
        """``scancel`` (retried: a busy controller may refuse the first call)."""
        if self.cancelled:
            return
        self.cancelled = True
        for _ in range(3):
            res = _client(["scancel", self.id], self.env)
            if res.returncode == 0:
                self.on_line(f"titan: cancelled Slurm job {self.id}")
                return
            time.sleep(1.0)
        self.on_line(
            f"titan: could not cancel Slurm job {self.id}: {_last_line(res.stderr)}; "
            f"run `scancel {self.id}`"
        )


def _submit_environment(spec: LaunchSpec) -> dict[str, str]:
    """The job's environment for sbatch: the caller's and the spec's, without the variables of
    an allocation the caller may itself be running in (they would override the new job's)."""
    env = job_environment(spec)
    return {k: v for k, v in env.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}


class _Follower:
    """Reads a growing output file; streams complete lines that pass the rank filter."""

    def __init__(self, path: Path, accept: Callable[[str], bool]) -> None:
        self.path = path
        self.accept = accept
        self.offset = 0
        self.partial = ""
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.num_lines = 0
        self.reached_srun = False  # the script printed its "titan: job" line (setup passed)
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.reports = _Reports()

    def drain(self, on_line: LineCallback, final: bool = False) -> None:
        """Stream what was appended since the last call."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return  # the job has not started yet
        if not data and os.path.getsize(self.path) < self.offset:
            self.offset, self.partial = 0, ""  # requeued: Slurm truncated the file
            self.decoder.reset()
            return
        self.offset += len(data)
        text = self.partial + self.decoder.decode(data, final=final)
        lines = text.split("\n")
        self.partial = "" if final else lines.pop()
        for line in lines:
            if final and not line:
                continue
            self.reached_srun = self.reached_srun or line.startswith("titan: job ")
            self.tail.append(line)
            for shown in self.reports.feed(line):
                if self.accept(shown):
                    self.num_lines += 1
                    on_line(shown)
        if final:
            for shown in self.reports.flush():
                self.num_lines += 1
                on_line(shown)


class _Reports:
    """Holds back torchrun's report of a failed rank (its error line, then its traceback down to
    the ``Root Cause`` box) while other steps' lines go on: the job's one line (or, for a
    replica group, the batch script's line on how it ended) says it instead. A held block that
    turns out not to be such a report is passed on."""

    def __init__(self) -> None:
        self.block: list[str] = []
        self.boxed = False  # the block reached "Root Cause": its closing rule ends it

    def feed(self, line: str) -> list[str]:
        """The lines to show now, given the next line of the output."""
        if line.startswith("[rank"):
            return [line]
        if not self.block:
            if AGENT_FAILED_RE.match(line) or line.startswith("Traceback (most recent"):
                self.block.append(line)
                return []
            return [line]
        self.block.append(line)
        self.boxed = self.boxed or line.startswith("Root Cause (first observed failure)")
        if self.boxed and line.startswith("====="):
            held, self.block, self.boxed = self.block, [], False
            return [] if any(CHILD_FAILED_RE.search(h) for h in held) else held
        if len(self.block) > 2 * TAIL_LINES:  # not a report after all
            return self.flush()
        return []

    def flush(self) -> list[str]:
        """What is still held (an unfinished block is not a report)."""
        held, self.block, self.boxed = self.block, [], False
        return held


def _client(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run a Slurm client; a hung controller becomes a failed call, not a hung caller."""
    try:
        return subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=_CLIENT_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, _TIMED_OUT, "", f"{cmd[0]} timed out")


def _queue_state(job_id: str, env: dict[str, str]) -> tuple[str | None, str]:
    """(state, reason) from squeue; ("", "") once the job has left the queue; (None, "") when
    squeue itself failed (the job may well be running)."""
    res = _client(["squeue", "-h", "-j", job_id, "-o", "%T|%r"], env)
    if res.returncode != 0:
        gone = "Invalid job id" in res.stderr
        return ("" if gone else None), ""
    if not res.stdout.strip():
        return "", ""
    state, _, reason = res.stdout.strip().splitlines()[0].partition("|")
    return state.strip(), reason.strip()


def _final_state(job_id: str, env: dict[str, str], last: str) -> tuple[str, str, str]:
    """(JobState, ExitCode, Reason) of a finished job from ``scontrol show job``."""
    fields: dict[str, str] = {}
    for _ in range(10):  # the record can lag squeue for a moment
        res = _client(["scontrol", "-o", "show", "job", job_id], env)
        fields = dict(re.findall(r"(\w+)=(\S*)", res.stdout)) if res.returncode == 0 else {}
        if fields.get("JobState") and fields["JobState"] not in _ACTIVE_STATES:
            break
        time.sleep(0.5)
    if not fields.get("JobState") and shutil.which("sacct"):
        # Past MinJobAge the controller forgets the job; accounting (where set up) remembers.
        res = _client(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"], env)
        if res.returncode == 0 and "|" in res.stdout:
            state, _, code = res.stdout.strip().splitlines()[0].partition("|")
            fields = {"JobState": state.split()[0], "ExitCode": code}  # "CANCELLED by 0"
    state = fields.get("JobState") or last or "UNKNOWN"
    return state, fields.get("ExitCode", ""), fields.get("Reason", "")


def _job_error(
    job_id: str, state: str, exit_code: str, reason: str, tail: list[str], path: Path
) -> LaunchError:
    """One line: the Slurm state first, then what torchrun or srun said about the failure."""
    code, _, sig = exit_code.partition(":")
    returncode = int(code) if code.isdigit() and int(code) else 1
    retryable = _RETRYABLE_STATES.get(state, True)
    detail, exitcode = "", None
    if any("Root Cause" in line or USER_ERROR_RE.search(line) for line in tail):
        torchrun = describe_failure(returncode, tail)
        detail = ": " + str(torchrun).removeprefix("training: ")
        retryable = retryable and torchrun.retryable
        exitcode = torchrun.exitcode  # the ranks' own code (a lost lighthouse: 5)
    elif task := next((m for line in tail if (m := _SRUN_TASK_RE.search(line))), None):
        detail = f": job step task {task['task']} on {task['node']}: {task['what']}"
    elif returncode > 128:
        detail = f": killed by {signal_name(returncode - 128)}"
    elif sig.isdigit() and int(sig):
        detail = f": killed by {signal_name(int(sig))}"
    why = f", reason {reason}" if reason and reason != "None" else ""
    return LaunchError(
        f"training: Slurm job {job_id} ended {state} (exit code {exit_code or '?'}{why})"
        f"{detail}; output in {path}",
        returncode=returncode,
        exitcode=exitcode,
        retryable=retryable,
    )


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"
