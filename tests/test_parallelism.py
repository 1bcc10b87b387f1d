"""Loss parity of parallel layouts against a single process (see tests/parallel_harness.py).

fp32, deterministic, tiny model, one seed checkpoint, the same data streams everywhere.
Tolerance 1e-5 relative: reductions in a different order change the last bits only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from parallel_harness import assert_parity, run_layout

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize(
    "name, nproc, dp, extra",
    [
        ("FSDP 2", 2, 2, []),
        ("HSDP 2x2", 4, 4, ["--parallelism.data_parallel_replicate_degree", "2"]),
    ],
)
def test_data_parallel_parity(
    tmp_path: Path,
    parity_seed: Path,
    parity_reference: dict,
    name: str,
    nproc: int,
    dp: int,
    extra: list[str],
) -> None:
    got = run_layout(tmp_path, parity_seed, nproc=nproc, dp=dp, extra=extra)
    assert_parity(got, parity_reference, what=name)


def test_two_torchrun_agents_train_as_one_world(
    tmp_path: Path, parity_seed: Path, parity_reference: dict
) -> None:
    """Two agents (--nnodes=2, c10d rendezvous on loopback) equal one agent of the same world."""
    one = run_layout(tmp_path / "one_agent", parity_seed, nproc=2, dp=2, steps=5)
    two = run_layout(tmp_path / "two_agents", parity_seed, nproc=2, dp=2, steps=5, nnodes=2)
    assert two == one  # same world, same collectives: bitwise equal
    assert_parity(two, parity_reference, what="2 agents x 1 process")
