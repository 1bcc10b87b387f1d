"""torchrun entry point: parse the config, build the trainer, train, close.

torchrun --nproc_per_node=2 -m titan_core.train --module llama3 --config llama3_debugmodel
"""

from __future__ import annotations

import faulthandler
import os
import sys

from titan_core import comm_mode
from titan_core.build import check_outputs_writable
from titan_core.config.job import JobConfig
from titan_core.distributed import flight_recorder
from titan_core.errors import TitanError
from titan_core.logging import init_logger, logger
from titan_core.resolve import parse_args
from titan_core.trainer import Trainer


def run(cfg: JobConfig) -> list[dict[str, float]]:
    """Train (or only write the seed checkpoint) for a resolved config; returns logged metrics.

    ``comm.mode`` fake_backend / local_tensor simulate the whole world in this process instead.
    A failed collective dumps every rank's flight-recorder trace (see ``flight_recorder``).
    """
    if cfg.comm.mode != "default":
        return comm_mode.run(cfg)
    _note_restart(cfg)
    check_outputs_writable(cfg)  # the dump folder, and the checkpoint folder where saved
    trainer = Trainer(cfg)
    try:
        with flight_recorder.dump_on_failure(trainer.side_folder):
            return _run(cfg, trainer)
    finally:
        trainer.close()


def _note_restart(cfg: JobConfig) -> None:
    """Say so when torchrun restarted the worker group (``launch.max_restarts``)."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    if not restart:
        return
    most = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
    if cfg.fault_tolerance.enable:
        logger.warning(
            "torchrun restart %d of %s: replica group %d heals from a live group (if none is, "
            "it resumes from the newest complete checkpoint)",
            restart, most, cfg.fault_tolerance.group_id,
        )  # fmt: skip
    elif cfg.checkpoint.enable:
        logger.warning(
            "torchrun restart %d of %s: resuming from the newest complete checkpoint", restart, most
        )
    else:
        logger.warning(
            "torchrun restart %d of %s: checkpoint.enable is off, so training starts over from "
            "step 0",
            restart,
            most,
        )


def _run(cfg: JobConfig, trainer: Trainer) -> list[dict[str, float]]:
    if cfg.checkpoint.create_seed_checkpoint:
        if trainer.dist.world_size != 1:
            raise TitanError(
                "checkpoint.create_seed_checkpoint: run it with one process "
                f"(NGPU=1), got world size {trainer.dist.world_size}"
            )
        path = trainer.checkpointer.save_seed()
        logger.info("Seed checkpoint written to %s", path)
        return []
    return trainer.train()


def main(argv: list[str] | None = None) -> int:
    """Run one job; errors print one line on stderr and return 2 (input) or 3 (collective).

    A crash in native code (a segmentation fault, glibc aborting on a corrupted heap) prints
    every thread's Python stack on stderr before the process dies: where it happened, in the
    rank's log."""
    init_logger()
    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)
    try:
        run(parse_args(argv))
    except TitanError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
