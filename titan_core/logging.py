"""The engine's logger: one per process, rank-tagged when distributed."""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("titan")
RANK_PREFIX_ENV = "TITAN_LOG_RANK_PREFIX"
"""Set to 0 by titan's launchers: torchrun already tags each line ``[rankN]:`` there."""


def init_logger(level: int = logging.INFO) -> None:
    """Configure the ``titan`` logger once, prefixing the rank under torchrun."""
    if getattr(init_logger, "_done", False):
        return
    rank = os.environ.get("RANK")
    distributed = rank is not None and os.environ.get("WORLD_SIZE", "1") != "1"
    tagged_by_launcher = os.environ.get(RANK_PREFIX_ENV) == "0"
    prefix = f"[rank{rank}] " if distributed and not tagged_by_launcher else ""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter(f"{prefix}[titan] %(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    )
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False
    init_logger._done = True  # type: ignore[attr-defined]
