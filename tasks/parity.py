"""Tasks of the parallelism-parity recipe (``titan_core.pipeline.parity`` does the work)."""

from __future__ import annotations

from prefect import get_run_logger, task

from titan_core.pipeline.parity import LayoutLosses, train_parity_layout, write_parity_seed
from titan_core.pipeline.run.common import relay_line


@task(task_run_name="parity-seed")
def write_seed_checkpoint(base: list[str], output: str, seq_len: int, timeout: float = 600) -> str:
    """Write the shared seed checkpoint with one process; returns its directory."""
    return write_parity_seed(base, output, seq_len, timeout)


@task(task_run_name="parity-{name}")
def train_layout(
    name: str,
    nproc: int,
    args: list[str],
    seed: str,
    output: str,
    steps: int,
    timeout: float = 600,
) -> LayoutLosses:
    """Train one layout from the seed checkpoint under torchrun; returns its per-step losses."""
    logger = get_run_logger()
    result = train_parity_layout(
        name,
        nproc,
        args,
        seed,
        output,
        steps,
        on_line=lambda line: relay_line(logger, line),
        timeout=timeout,
    )
    logger.info("layout %s: final loss %.6f", name, result.final)
    return result
