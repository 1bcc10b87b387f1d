"""Exit codes and torchrun's failure report → one clear ``LaunchError``.

torchrun exits 1 when a worker fails and prints a "Root Cause" block naming the first failed
rank and its exit code (negative: killed by that signal). The training entry point exits 2 on a
user error after printing one ``error: ...`` line, which is not worth a relaunch, 3 when a
collective failed (the line names the flight-recorder folder), which is, 4 when the step
guard stopped the run (``[health]``), which is not, and 5 when the replica groups lost their
lighthouse (worth a relaunch when the launcher starts a new one: ``replica_groups``).
"""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence

# The last lines of a job's output that a backend keeps for ``describe_failure``: enough to hold
# torchrun's failure report and the rank's last error.
TAIL_LINES = 400
USER_ERROR_EXIT = 2  # titan_core.train: a TitanError (bad config, missing data)
HEALTH_STOP_EXIT = 4  # titan_core.train: the step guard stopped the run (docs/health.md)
LIGHTHOUSE_LOST_EXIT = 5  # titan_core.train: the replica groups' lighthouse does not answer
# titan_core.train exits 3 on a CommError (a collective failed: dead or stuck peer), retryable.
# Exit codes whose relaunch would fail the same way: bad input, or the step guard's stop (a
# relaunch resumes from the same checkpoint and meets the same anomaly).
_NOT_RETRIED = {
    USER_ERROR_EXIT: "rejected its input",
    HEALTH_STOP_EXIT: "stopped by the health guard",
}
_ROOT_CAUSE_RE = re.compile(r"Root Cause")
_RANK_RE = re.compile(r"^\s*rank\s*:\s*(\d+)")
_EXIT_RE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
USER_ERROR_RE = re.compile(r"(?:^|\]:?\s*)error: (.+)$")
_OOM_RE = re.compile(r"OutOfMemoryError|CUDA out of memory")


class LaunchError(RuntimeError):
    """A launched job failed: ``str(e)`` is one line; ``retryable`` says whether to relaunch."""

    def __init__(
        self,
        message: str,
        *,
        returncode: int,
        exitcode: int | None = None,
        rank: int | None = None,
        retryable: bool = True,
    ) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.exitcode = exitcode
        self.rank = rank
        self.retryable = retryable

    @property
    def exit_code(self) -> int:
        """What a command exits with: the ranks' own code where a relaunch would fail the same
        way (2: the user must act; 4: the health guard stopped the run) and when the replica
        groups lost their lighthouse (5), else 1."""
        if self.exitcode == LIGHTHOUSE_LOST_EXIT:
            return LIGHTHOUSE_LOST_EXIT
        return self.exitcode if self.exitcode in _NOT_RETRIED and not self.retryable else 1


def signal_name(num: int) -> str:
    """``SIGKILL`` for 9; ``signal 64`` for numbers without a name."""
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


# torchrun's error line on the first failed worker of a round (the agent then restarts the
# workers, or gives up).
_WORKER_FAILED_RE = re.compile(r"\] failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")


def worker_failed(line: str) -> str | None:
    """torchrun's line on a failed worker in words (``1 (pid 4242) was killed by SIGKILL``:
    its local rank, its process, how it ended); None for any other line."""
    if not (m := _WORKER_FAILED_RE.search(line)):
        return None
    code, rank, pid = int(m.group(1)), m.group(2), m.group(3)
    how = f"was killed by {signal_name(-code)}" if code < 0 else f"exited with code {code}"
    return f"{rank} (pid {pid}) {how}"


def _root_cause(tail: Sequence[str]) -> tuple[int | None, int | None]:
    """(rank, exitcode) of torchrun's first observed failure, if it printed one."""
    rank = exitcode = None
    seen = False
    for line in tail:
        seen = seen or bool(_ROOT_CAUSE_RE.search(line))
        if not seen:
            continue
        if rank is None and (m := _RANK_RE.match(line)):
            rank = int(m.group(1))
        if exitcode is None and (m := _EXIT_RE.match(line)):
            exitcode = int(m.group(1))
    return rank, exitcode


def _user_error(tail: Sequence[str], naming: str = "") -> str | None:
    """The last ``error:`` line of ``tail``; with ``naming``, the first one that contains it."""
    lines = tail if naming else list(reversed(tail))
    for line in lines:
        if (m := USER_ERROR_RE.search(line.strip())) and naming in m.group(1):
            return m.group(1).strip()
    return None


# Why a rank may have died of a signal, said after it.
_SIGNAL_HINTS = {
    signal.SIGKILL: " (out of memory, or killed from outside)",
    **dict.fromkeys(
        (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS),
        " (a crash in native code: the rank's log shows its threads' Python stacks)",
    ),
}


def describe_failure(returncode: int, tail: Sequence[str], what: str = "training") -> LaunchError:
    """The ``LaunchError`` for a launcher that exited with ``returncode``, given its output."""
    if returncode < 0:
        name = signal_name(-returncode)
        return LaunchError(
            f"{what}: the launcher (torchrun) was killed by {name}",
            returncode=returncode,
            retryable=True,
        )
    rank, exitcode = _root_cause(tail)
    code = exitcode if exitcode is not None else returncode
    where = f"rank {rank}" if rank is not None else "the job"
    if verdict := _NOT_RETRIED.get(code):
        reason = _user_error(tail) or "see the log above"
        return LaunchError(
            f"{what}: {verdict}: {reason}",
            returncode=returncode,
            exitcode=code,
            rank=rank,
            retryable=False,
        )
    if code == LIGHTHOUSE_LOST_EXIT:
        # The first such line: the step where it was lost (a restarted group's line lacks it).
        said = _user_error(tail, naming="lighthouse")
        return LaunchError(
            f"{what}: " + (said or f"{where} lost the replica groups' lighthouse (exit code 5)"),
            returncode=returncode,
            exitcode=code,
            rank=rank,
            retryable=True,  # a launch that starts its own lighthouse; see replica_groups
        )
    if code < 0:
        hint = _SIGNAL_HINTS.get(-code, "")
        return LaunchError(
            f"{what}: {where} was killed by {signal_name(-code)}{hint}",
            returncode=returncode,
            exitcode=code,
            rank=rank,
            retryable=True,
        )
    if any(_OOM_RE.search(line) for line in tail):
        return LaunchError(
            f"{what}: {where} ran out of device memory (exit code {code}); lower "
            "training.local_batch_size or enable activation_checkpoint.mode",
            returncode=returncode,
            exitcode=code,
            rank=rank,
            retryable=False,
        )
    said = _user_error(tail)  # e.g. a collective that timed out, naming the trace folder
    return LaunchError(
        f"{what}: {where} failed with exit code {code}"
        + (f": {said}" if said else "; the log above shows why"),
        returncode=returncode,
        exitcode=code,
        rank=rank,
        retryable=True,
    )
