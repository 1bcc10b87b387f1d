"""torch.compile applied per transformer block (repeated blocks share one compiled graph)."""

from __future__ import annotations

import torch
from torch import nn

from titan_core.config.job import Compile as CompileConfig
from titan_core.logging import logger


def apply_compile(blocks: nn.ModuleDict, cfg: CompileConfig) -> None:
    """Compile each block of ``blocks`` in place."""
    for name, block in list(blocks.items()):
        blocks[name] = torch.compile(block, backend=cfg.backend, fullgraph=True)
    logger.info("Compiled %d blocks with torch.compile(backend=%s)", len(blocks), cfg.backend)
