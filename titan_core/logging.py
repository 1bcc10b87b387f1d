"""The engine's logger: one per process, rank-tagged when distributed."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

logger = logging.getLogger("titan")
RANK_PREFIX_ENV = "TITAN_LOG_RANK_PREFIX"
"""Set to 0 by titan's launchers: torchrun already tags each line ``[rankN]:`` there."""


class _StdoutHandler(logging.StreamHandler):
    """A handler on whatever ``sys.stdout`` is when a line is written, not the one that was
    current when the logger was set up (a test's captured stream is closed after the test)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stdout

    @stream.setter
    def stream(self, _: Any) -> None:
        pass


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
