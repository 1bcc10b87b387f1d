"""Ask a running training job to stop at its next log step: a request file in its dump folder,
which the job consumes into a record of the stop.

Anyone who can write to the job's ``job.dump_folder`` (a path or an fsspec URL) can create the
request ``stop-requested`` there, e.g. ``touch <dump_folder>/stop-requested``; its text is the
reason. Rank 0 looks for it at every log step (``metrics.log_freq``) and broadcasts what it
found, so all ranks stop at the same step. The trainer then consumes the request: it writes the
record ``stopped-early`` (``{"step": N, "reason": ...}``) and deletes ``stop-requested``, so a
later run in the same folder trains on normally. A request the job finds only after its last log
step is dropped: the job completed anyway. ``StopRequests`` is the job's side of all this.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec
import torch
import torch.distributed as dist

from titan_core import storage
from titan_core.errors import first_line
from titan_core.logging import logger

STOP_REQUEST = "stop-requested"
STOPPED_EARLY = "stopped-early"
DEFAULT_REASON = "stop requested"
REASON_CHARS = 1000  # of a request's text kept as the reason (an MLflow tag's value)


@dataclass(frozen=True)
class StopRecord:
    """A job's record of the stop it honoured: the step it ended at and why."""

    step: int
    reason: str


def _fresh(dump_folder: str, name: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and path of ``name`` in ``dump_folder``, its folder's cached listing
    dropped (another process writes these files)."""
    fs, path = storage.filesystem(storage.join(dump_folder, name))
    fs.invalidate_cache(posixpath.dirname(path))
    return fs, path


def request_stop(dump_folder: str, reason: str = "") -> str:
    """Ask the job writing into ``dump_folder`` to stop at its next log step; returns the
    request's path. ``reason`` (one line) is the request's content, for people."""
    path = storage.join(dump_folder, STOP_REQUEST)
    storage.write_text(path, (reason or DEFAULT_REASON) + "\n")
    return path


def pending_stop(dump_folder: str) -> str | None:
    """The reason (its text) of a pending stop request for ``dump_folder``'s job, or None. Reads the
    storage afresh, so call it at log steps only; a storage error is raised."""
    fs, path = _fresh(dump_folder, STOP_REQUEST)
    if not fs.exists(path):
        return None
    with fs.open(path, "r") as f:
        return f.read(REASON_CHARS).strip() or DEFAULT_REASON


def record_stop(dump_folder: str, step: int, reason: str) -> None:
    """Consume the request: write the ``stopped-early`` record (``step``, ``reason``), then
    delete ``stop-requested``."""
    record = json.dumps({"step": step, "reason": reason})
    storage.write_text(storage.join(dump_folder, STOPPED_EARLY), record + "\n")
    discard_stop_request(dump_folder)


def discard_stop_request(dump_folder: str) -> bool:
    """Delete a pending stop request; whether there was one."""
    fs, path = _fresh(dump_folder, STOP_REQUEST)
    if not fs.exists(path):
        return False
    fs.rm(path)
    return True


def stopped_early(dump_folder: str) -> StopRecord | None:
    """The job's record of its latest honoured stop request, or None."""
    fs, path = _fresh(dump_folder, STOPPED_EARLY)
    if not fs.exists(path):
        return None
    with fs.open(path, "r") as f:
        record = json.loads(f.read())
    return StopRecord(int(record["step"]), str(record["reason"]))


class StopRequests:
    """A training job's side of stop requests: rank 0 looks for one at log steps and every rank
    gets its answer (a broadcast on the default process group), so all stop at the same step;
    rank 0 consumes a request the job honoured and drops one that came after the last log step.
    A storage error is logged (once per distinct error), never raised: the other ranks may be
    waiting in the broadcast, and a transient error must not end the job."""

    def __init__(self, dump_folder: str, is_rank0: bool, device: torch.device) -> None:
        self.dump_folder, self.is_rank0, self.device = dump_folder, is_rank0, device
        self._error = ""  # the last storage error, logged

    def check(self) -> str | None:
        """The reason of a pending request ("" on ranks other than 0), or None; rank 0 reads
        the storage and broadcasts whether there is one."""
        reason = self._on_storage(pending_stop) if self.is_rank0 else None
        flag = torch.tensor(int(reason is not None), device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(flag, src=0)
        return (reason or "") if flag.item() else None

    def consume(self, step: int, reason: str) -> None:
        """Log the stop honoured at ``step``; rank 0 turns the request into the
        ``stopped-early`` record, so a later run in this folder trains on. Call it once the
        stop's checkpoint is committed."""
        logger.info("stopped early at step %d (stop requested)", step)
        if self.is_rank0:
            self._on_storage(record_stop, step, reason)

    def drop_late(self) -> None:
        """Rank 0 drops a request that came after the last log step: the job completed."""
        if self.is_rank0 and self._on_storage(discard_stop_request):
            logger.info("a stop request came after the last log step; training completed anyway")

    def _on_storage(self, operation: Callable[..., Any], *args: Any) -> Any:
        """``operation(dump_folder, *args)``, or None when the storage fails (logged)."""
        try:
            return operation(self.dump_folder, *args)
        except Exception as e:  # fsspec backends raise more than OSError (S3 client errors)
            if first_line(e) != self._error:
                self._error = first_line(e)
                logger.warning(
                    "stop request: %s failed, going on: %s", operation.__name__, self._error
                )
            return None
