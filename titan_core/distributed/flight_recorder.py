"""Collective timeouts and flight-recorder dumps.

The flight recorder (``TORCH_FR_BUFFER_SIZE`` entries per rank, set from ``comm.trace_buf_size``
before the process group starts) keeps the last collectives each rank issued, gloo's included.
When a rank fails (a collective timeout or any other exception) it writes its buffer to
``<dump_folder>/comm_traces/rank_<rank>``; a rank that torchrun terminates because a peer failed
does the same from its SIGTERM handler, so every rank leaves a trace. Read them with
``python -m torch.distributed.flight_recorder.fr_trace <dump_folder>/comm_traces --prefix rank_``.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

import torch
import torch.distributed as dist

from titan_core import storage
from titan_core.errors import CommError, TitanError
from titan_core.logging import logger

TRACE_SUBDIR = "comm_traces"
TRACE_PREFIX = "rank_"
# Fault injection for tests: rank TITAN_FAULT_HANG_RANK (default 1) stops before step N's
# collectives, as a stuck rank would; its peers then time out.
HANG_STEP_ENV = "TITAN_FAULT_HANG_STEP"
HANG_RANK_ENV = "TITAN_FAULT_HANG_RANK"
# gloo's wording for a collective that timed out or lost its peer.
_COMM_FAILURE_MARKERS = ("Timed out waiting", "Connection closed by peer", "Connection reset")


def trace_folder(side_folder: str) -> str:
    """Where every rank writes its flight-recorder dump."""
    return os.path.join(side_folder, TRACE_SUBDIR)


def configure(trace_buf_size: int, side_folder: str) -> None:
    """Turn the recorder on for process groups created from now on (env vars torch reads)."""
    if trace_buf_size > 0:
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(trace_buf_size))
        os.environ.setdefault(
            "TORCH_FR_DUMP_TEMP_FILE", os.path.join(trace_folder(side_folder), TRACE_PREFIX)
        )
        if torch.cuda.is_available():
            # NCCL's watchdog dumps by itself on a timeout, into an existing folder.
            os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
            os.makedirs(trace_folder(side_folder), exist_ok=True)


def _recording() -> bool:
    """Whether a real process group exists and its flight recorder is on."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    if dist.get_backend() == "fake":
        return False
    return int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0")) > 0


def dump_trace(side_folder: str) -> str | None:
    """Write this rank's flight-recorder buffer; returns the file (None when not recording)."""
    if not _recording():
        return None
    rank = dist.get_rank()
    path = os.path.join(trace_folder(side_folder), f"{TRACE_PREFIX}{rank}")
    dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    # gloo leaves its groups' names out of pg_config (one '' key), which torch's analyzer
    # (fr_trace) needs to match entries to groups: fill it in from this process's view.
    named = {k: v for k, v in dump.get("pg_config", {}).items() if k}
    dump["pg_config"] = {**named, **_pg_config()}
    # torch's analyzer (fr_trace) reads this pickle format; titan never loads it back.
    storage.write_bytes(path, pickle.dumps(dump))  # never seen half-written
    return path


def _pg_config() -> dict[str, dict[str, str]]:
    """Every process group this rank belongs to, in the flight recorder's pg_config format."""
    world = dist.distributed_c10d._world
    config = {}
    for group, name in world.pg_names.items():
        ranks = sorted(world.pg_group_ranks.get(group, {}))
        desc = getattr(group, "group_desc", "") or ""
        config[name] = {"name": name, "desc": desc, "ranks": str(ranks)}
    return config


def is_comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that failed (timeout, peer gone), not a bug in this rank."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _COMM_FAILURE_MARKERS)


@contextlib.contextmanager
def dump_on_failure(side_folder: str) -> Iterator[None]:
    """Dump the trace if the body fails (and on SIGTERM); a failed collective becomes one line
    naming the trace folder."""
    # torchrun stops the other ranks with SIGTERM when one fails: they dump on the way out.
    # Only where a trace exists, and only the main thread may install signal handlers.
    handle = _recording() and threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        path = dump_trace(side_folder)
        if path:
            logger.error("Terminated: flight-recorder trace written to %s", path)
        raise SystemExit(128 + signum)

    if handle:
        signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    except (Exception, KeyboardInterrupt) as exc:
        if isinstance(exc, TitanError) and not isinstance(exc, CommError):
            raise  # the user's to act on (a full disk, bad data): one line, no trace to write
        path = dump_trace(side_folder)
        if path is None:
            raise
        if is_comm_failure(exc):
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CommError(
                f"rank {dist.get_rank()}: collective failed ({first}); flight-recorder traces "
                f"of every rank in {trace_folder(side_folder)}"
            ) from exc
        logger.error("Flight-recorder trace written to %s", path)
        raise
    finally:
        if handle:
            signal.signal(signal.SIGTERM, previous)


def set_pg_timeouts(seconds: int) -> None:
    """Use ``seconds`` as the timeout of every process group (after the slow first step).

    A barrier first, so that no rank issues a collective under the short timeout while a peer
    is still initializing under the long one.
    """
    if not _real_groups():
        return
    dist.barrier()
    set_group_timeouts(seconds)
    logger.info("Collective timeout set to %ds for the rest of training", seconds)


def set_group_timeouts(seconds: int) -> None:
    """``seconds`` as the timeout of every process group this rank belongs to, now.

    Mesh sub-groups are created with torch's default (30 min on gloo), not the default group's.
    """
    if not _real_groups():
        return
    timeout = datetime.timedelta(seconds=seconds)
    for group in list(dist.distributed_c10d._world.pg_map):
        if not dist.distributed_c10d._rank_not_in_group(group):
            dist.distributed_c10d._set_pg_timeout(timeout, group)


def _real_groups() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_backend() != "fake"


def maybe_inject_hang(step: int, rank: int) -> None:
    """Stall this rank before ``step`` when ``TITAN_FAULT_HANG_STEP`` asks for it (tests only)."""
    hang_step = os.environ.get(HANG_STEP_ENV)
    if hang_step is None or int(hang_step) != step:
        return
    if rank != int(os.environ.get(HANG_RANK_ENV, "1")):
        return
    logger.warning("%s=%s: rank %d stalls before step %d", HANG_STEP_ENV, hang_step, rank, step)
    while True:  # interrupted only by a signal (torchrun's SIGTERM once a peer has failed)
        time.sleep(3600)
