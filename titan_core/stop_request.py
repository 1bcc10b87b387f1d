"""Ask a running training job to stop at its next log step: a marker file in its dump folder.

Anyone who can write to the job's ``job.dump_folder`` (a path or an fsspec URL) can create the
marker ``stop-requested`` there, e.g. ``touch <dump_folder>/stop-requested``. Rank 0 looks for it
at every log step (``metrics.log_freq``) and broadcasts what it found, so all ranks stop at the
same step: the trainer saves that step as its final checkpoint, logs ``stopped early at step N
(stop requested)`` and exits 0. The marker stays as the run's record of the stop; delete it
before training the same run further.
"""

from __future__ import annotations

import posixpath

from titan_core import storage

STOP_REQUEST = "stop-requested"


def stop_request_path(dump_folder: str) -> str:
    """Where the marker of ``dump_folder``'s job lives."""
    return storage.join(dump_folder, STOP_REQUEST)


def request_stop(dump_folder: str, reason: str = "") -> str:
    """Ask the job writing into ``dump_folder`` to stop at its next log step; returns the
    marker's path. ``reason`` (one line) is the marker's content, for people."""
    path = stop_request_path(dump_folder)
    storage.write_text_atomic(path, (reason or "stop requested") + "\n")
    return path


def stop_requested(dump_folder: str) -> bool:
    """Whether someone asked the job writing into ``dump_folder`` to stop. Reads the storage
    afresh (another process writes the marker), so call it at log steps, not every step."""
    fs, path = storage.filesystem(stop_request_path(dump_folder))
    fs.invalidate_cache(posixpath.dirname(path))
    return fs.exists(path)
