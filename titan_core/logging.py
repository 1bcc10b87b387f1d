"""The engine's logger: one per process, rank-tagged when distributed."""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("titan")
RANK_PREFIX_ENV = "TITAN_LOG_RANK_PREFIX"
"""Set to 0 by titan's launchers: torchrun already tags each line ``[rankN]:`` there."""


class _StdoutHandler(logging.StreamHandler):
    """Writes to ``sys.stdout`` as it is when a line is logged (a redirect, a test's capture),
    not to the stream that was there when the logger was configured, which may be closed."""

    @property  # type: ignore[override]
    def stream(self) -> object:
        """The current ``sys.stdout``."""
        return sys.stdout

    @stream.setter
    def stream(self, value: object) -> None:
        pass  # StreamHandler.__init__ sets it: always the current sys.stdout instead


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
