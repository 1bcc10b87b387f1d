"""The engine's logger: one per process, rank-tagged when distributed."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

logger = logging.getLogger("titan")
RANK_PREFIX_ENV = "TITAN_LOG_RANK_PREFIX"
"""Set to 0 by titan's launchers: torchrun already tags each line ``[rankN]:`` there."""


class _StdoutHandler(logging.StreamHandler):
    """Writes to ``sys.stdout`` as it is when a line is logged (a redirect, a test's capture),
    not to the stream that was there when the logger was configured, which may be closed;
    to ``sys.stderr`` inside ``logs_to_stderr``."""

    to_stderr = 0

    @property  # type: ignore[override]
    def stream(self) -> object:
        """The current ``sys.stdout`` (``sys.stderr`` inside ``logs_to_stderr``)."""
        return sys.stderr if _StdoutHandler.to_stderr else sys.stdout

    @stream.setter
    def stream(self, value: object) -> None:
        pass  # StreamHandler.__init__ sets it: always the current sys.stdout instead


@contextlib.contextmanager
def logs_to_stderr() -> Iterator[None]:
    """The engine's log lines go to stderr in the body: a command whose stdout is data
    (``--json``) keeps it clean whatever logs while it runs."""
    _StdoutHandler.to_stderr += 1
    try:
        yield
    finally:
        _StdoutHandler.to_stderr -= 1


def init_logger(level: int = logging.INFO) -> None:
    """Configure the ``titan`` logger once, prefixing the rank under torchrun."""
    if getattr(init_logger, "_done", False):
        return
    rank = os.environ.get("RANK")
    distributed = rank is not None and os.environ.get("WORLD_SIZE", "1") != "1"
    tagged_by_launcher = os.environ.get(RANK_PREFIX_ENV) == "0"
    prefix = f"[rank{rank}] " if distributed and not tagged_by_launcher else ""
    handler = _StdoutHandler()
    handler.setFormatter(
        logging.Formatter(f"{prefix}[titan] %(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    )
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False
    init_logger._done = True  # type: ignore[attr-defined]
