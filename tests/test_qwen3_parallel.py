"""Qwen3 under every parallelism: loss parity of each layout against one process from one seed
checkpoint (tests/parallel_harness.py, the tiny Qwen3 with QK-norm), activation checkpointing,
checkpoint resume, and the fake_backend dry run at the published 8B's shapes.

fp32, deterministic; tolerance 1e-5 relative. Few steps (CI budget): with 2 warmup steps the
first 3 losses do not depend on the run's length, so they compare with the 10-step reference.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from parallel_harness import QWEN3_MODEL, SEQ_LEN, assert_parity, run_layout, train_layout

from titan_core import comm_mode
from titan_core.resolve import parse_args

pytestmark = pytest.mark.multiprocess

STEPS = 3
P = "--parallelism."
PP2_LOOPED = [
    f"{P}pipeline_parallel_degree",
    "2",
    f"{P}pipeline_parallel_schedule",
    "Interleaved1F1B",
]


@pytest.mark.parametrize(
    "name, nproc, dp, extra, applied",
    [
        # HSDP wraps the same blocks as FSDP (one fully_shard code path): Llama 3's matrix
        # covers it, and the replica-groups tests run it again.
        ("FSDP 2", 2, 2, [], "Applied FSDP on mesh {'dp_shard': 2}"),
        (
            "TP 2",
            2,
            1,
            [f"{P}tensor_parallel_degree", "2"],
            "Applied tensor + sequence parallel (degree 2, loss parallel True)",
        ),
        (
            "PP 2 Interleaved1F1B",
            2,
            1,
            [
                f"{P}pipeline_parallel_degree",
                "2",
                f"{P}pipeline_parallel_schedule",
                "Interleaved1F1B",
            ],
            "Pipeline: Interleaved1F1B, 4 stages on 2 ranks",
        ),
        (
            "CP 2",
            2,
            1,
            [f"{P}context_parallel_degree", "2"],
            f"ring attention over 2 ranks (allgather rotation), {SEQ_LEN // 2} of {SEQ_LEN} tokens",
        ),
    ],
)
def test_qwen3_layout_parity(
    tmp_path: Path,
    qwen3_parity_seed: Path,
    qwen3_parity_reference: dict,
    name: str,
    nproc: int,
    dp: int,
    extra: list[str],
    applied: str,
) -> None:
    """Each layout logs that it applied itself (a silent fallback would match too) and its
    losses equal the single process's."""
    run = train_layout(
        tmp_path, qwen3_parity_seed, nproc=nproc, dp=dp, extra=extra, steps=STEPS, model=QWEN3_MODEL
    )
    assert applied in run.output, run.output[-4000:]
    assert_parity(run.losses, qwen3_parity_reference, what=f"qwen3 {name}")


def test_qwen3_tp_with_cp(
    tmp_path: Path, qwen3_parity_seed: Path, qwen3_parity_reference: dict
) -> None:
    """TP x CP = 2 x 2 on 4 processes: QK-norm on tensor-parallel heads inside ring attention,
    the one interaction Qwen3 adds to the shared parallelism code. (The full 2x2x2x2 world of 16
    runs for Llama in test_parallelism.py; PP and FSDP hold no Qwen3-specific code, and each
    runs alone for Qwen3 above: the 16-process run here cost a minute of CI for nothing new.)"""
    extra = [f"{P}context_parallel_degree", "2", f"{P}tensor_parallel_degree", "2"]
    got = run_layout(
        tmp_path, qwen3_parity_seed, nproc=4, dp=1, extra=extra, steps=STEPS, model=QWEN3_MODEL
    )
    assert_parity(got, qwen3_parity_reference, what="qwen3 TP x CP 2x2")


def test_qwen3_full_activation_checkpointing_equals_no_ac(
    tmp_path: Path, qwen3_parity_seed: Path, qwen3_parity_reference: dict
) -> None:
    """Full AC recomputes each block in backward: the same losses, bit for bit."""
    extra = ["--activation_checkpoint.mode", "full"]
    run = train_layout(
        tmp_path, qwen3_parity_seed, nproc=1, dp=1, extra=extra, steps=STEPS, model=QWEN3_MODEL
    )
    assert "Activation checkpointing (full, every 1 block(s)) on 4/4 blocks" in run.output
    assert run.losses == {s: qwen3_parity_reference[s] for s in range(1, STEPS + 1)}


def test_qwen3_resume_is_bitwise(tmp_path: Path, qwen3_parity_seed: Path) -> None:
    """Six steps saving a full state at step 3; a new run resumed from that step trains steps
    4-6 with the uninterrupted run's losses exactly (model, optimizer, data, RNG restored)."""
    save = ["--checkpoint.no_load_only", "--checkpoint.interval", "3"]
    whole = run_layout(
        tmp_path / "whole", qwen3_parity_seed, nproc=1, dp=1, extra=save, steps=6, model=QWEN3_MODEL
    )
    dump = tmp_path / "resumed"
    shutil.copytree(tmp_path / "whole" / "checkpoint" / "step-3", dump / "checkpoint" / "step-3")
    resumed = run_layout(
        dump, qwen3_parity_seed, nproc=1, dp=1, steps=6, start=4, model=QWEN3_MODEL
    )
    assert resumed == {s: whole[s] for s in range(4, 7)}


@pytest.mark.parametrize(
    "argv, world, tp",
    [
        # The published 8B's shapes (4 of its 36 layers: CI budget) at 64 ranks, TP 8 x FSDP 8.
        (["--config", "qwen3_8b", "--model.n_layers", "4"], 64, 8),
        # PP 2 (looped: 4 stages, 2 per rank) x TP 2 x FSDP 2 on the debug model.
        (
            ["--config", "qwen3_debugmodel", "--model.n_layers", "4", *PP2_LOOPED],
            8,
            2,
        ),
    ],
    ids=["8b_shapes_fsdp8xtp8", "debug_pp2_interleaved_x_fsdp2xtp2"],
)
@pytest.mark.filterwarnings("ignore:DTensor random operators")
def test_qwen3_fake_backend_dry_run(
    tmp_path: Path, assets: Path, argv: list[str], world: int, tp: int
) -> None:
    """COMM_MODE=fake_backend for Qwen3 in one process: QK-norm scales replicated over tp
    (sharded by FSDP only), projections column-wise, rank 0's bytes equal the estimate."""
    args = ["--module", "qwen3", *argv, "--comm.mode", "fake_backend"]
    args += ["--comm.fake_world_size", str(world), f"{P}tensor_parallel_degree", str(tp)]
    report = comm_mode.dry_run(parse_args([*args, "--job.dump_folder", str(tmp_path)]))
    rows = {row.name.split("] ")[-1]: row for row in report.modules}
    q_norm = next(r for n, r in rows.items() if n.endswith("attention.q_norm"))
    assert "SequenceParallel" in q_norm.applied and "S(0)@dp_shard R@tp" in q_norm.params
    wq = next(r for n, r in rows.items() if n.endswith("attention.wq"))
    assert "ColwiseParallel" in wq.applied and "S(0)@tp" in wq.params
    step, expected = report.step, comm_mode.rank0_estimate(report.estimate)
    assert step.num_params > 0 and step.params_with_grad == step.num_params
    assert step.param_bytes == expected.params
    assert step.grad_bytes == expected.grads
    assert step.optimizer_bytes == expected.optimizer
