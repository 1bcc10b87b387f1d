"""The tests' shared helpers: free ports, polling with a deadline, process environments, tiny
model configs. One copy here; test modules and fixtures import them (tests/ is on sys.path)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from titan_core.testing.ports import free_port, free_ports  # noqa: F401  (re-exported)

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[1]

# Config keys added after the house's snapshots (tests/data/*_before_house.*): new options,
# not changed ones, each with the issue that added it.
ADDED_KEYS = {  # issue 22: the step guard ([health]) and fault drills
    *(f"health.{name}" for name in ("enable", "nonfinite", "spike", "spike_window")),
    *(f"health.{name}" for name in ("spike_threshold", "max_consecutive", "max_rollbacks")),
    *(f"health.{name}" for name in ("rollback_window", "rollback_lr_factor", "rollback_lr_steps")),
    *(f"health.{name}" for name in ("straggler_factor", "sdc_every", "sdc")),
    "debug.inject",
    "debug.drill",
    "dataloader.exclude",  # issue 22: what a rollback skips, to reproduce it
    # issue 25: fault-tolerant replica groups (torchft)
    *(f"fault_tolerance.{name}" for name in ("enable", "group_id", "lighthouse", "min_replicas")),
    *(f"fault_tolerance.{name}" for name in ("timeout_seconds", "quorum_timeout_seconds")),
    *(f"fault_tolerance.{name}" for name in ("heartbeat_timeout_ms", "join_timeout_ms")),
    *(f"fault_tolerance.{name}" for name in ("semi_sync", "sync_every", "outer_lr")),
    "fault_tolerance.outer_momentum",
    "checkpoint.verify",  # issue 35: checksums of a checkpoint's files, checked before a load
    # issue 38: in-loop evaluation on named held-out sets and downstream tasks
    *(f"evaluators.{name}" for name in ("sets", "freq", "at_start", "batch_size", "batches")),
    "tracking.champion_metric",  # issue 38: the champion gate on any metric, in its direction
    "model.mtp_layers",  # issue 37: DeepSeek-V3's multi-token prediction depth and loss weight
    "model.mtp_loss_weight",
}

# The tiny debug Llama: seconds of CPU per step on gloo.
TINY = ["--module", "llama3", "--config", "llama3_debugmodel_tiny"]


def wait_until(
    condition: Callable[[], T | None],
    *,
    timeout: float,
    what: str,
    interval: float = 0.2,
    on_timeout: Callable[[], str] = lambda: "",
) -> T:
    """Poll ``condition`` until it returns something truthy (returned) or ``timeout`` seconds
    pass (an AssertionError naming ``what`` plus ``on_timeout()``'s details)."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            details = on_timeout()
            raise AssertionError(
                f"{what}: not after {timeout}s" + (f"\n{details}" if details else "")
            )
        time.sleep(interval)


def process_env(**extra: str) -> dict[str, str]:
    """The environment for a process a test starts: this interpreter's venv first on PATH (for
    ``torchrun``, ``titan``), one OpenMP thread per process (2 cores are shared), ``extra``."""
    venv_bin = os.path.dirname(sys.executable)
    return {
        **os.environ,
        "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
        **extra,
    }


def reproducible_env(**extra: str) -> dict[str, str]:
    """``process_env`` with MKL's reproducible mode: one process and several agree bit for bit
    on CPU (parity tests)."""
    return process_env(MKL_CBWR="AUTO,STRICT", **extra)


def titan_in_process(argv: list[str], capsys: object) -> tuple[int, str, str]:
    """``titan *argv`` in this process (its one error path included): (exit code, stdout,
    stderr). For bad-input cases that fail before anything starts; each family keeps one case
    in a real process."""
    from titan_core.cli import main

    capsys.readouterr()  # type: ignore[attr-defined]
    code = main(argv)
    captured = capsys.readouterr()  # type: ignore[attr-defined]
    return code, captured.out, captured.err


def checkpoint_tensors(step_dir: Path) -> dict:
    """Every tensor of a (single-process) DCP checkpoint on disk: model and optimizer state."""
    import torch
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    state = {
        key: torch.empty(m.size, dtype=m.properties.dtype)
        for key, m in meta.items()
        if key.startswith(("model.", "optimizer.")) and hasattr(m, "size")
    }
    dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
    return state
