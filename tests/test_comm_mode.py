"""COMM_MODE debug modes (fake_backend dry run, local_tensor) and flight-recorder dumps."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TINY, process_env
from parallel_harness import assert_parity, run_layout

from titan_core import comm_mode
from titan_core.cli.train import _comm_mode_args
from titan_core.errors import ConfigError
from titan_core.models import get_flavor
from titan_core.resolve import parse_args

ROOT = Path(__file__).resolve().parents[1]


def _run_train(args: list[str], timeout: int, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ROOT / "run_train.sh"), *args],
        env=process_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# --- fake_backend: the dry run ---------------------------------------------------------------


def test_run_train_fake_backend_prints_the_plan_of_8_ranks(tmp_path: Path, assets: Path) -> None:
    dump = tmp_path / "out"
    args = ["--job.dump_folder", str(dump), "--parallelism.tensor_parallel_degree", "2"]
    args += ["--parallelism.data_parallel_replicate_degree", "2"]
    proc = _run_train(
        args, 300, NGPU="8", COMM_MODE="fake_backend", CONFIG="llama3_debugmodel_tiny"
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "world 8 = pp 1 × dp_replicate 2 × dp_shard 2 × cp 1 × tp 2" in out
    assert "device mesh (dp_replicate=2, dp_shard=2, tp=2); flattened views: dp=4" in out
    # wq: column-parallel over tp 2, then FSDP splits dim 0 over dp_shard 2; HSDP replicates.
    dim = get_flavor("llama3", "debugmodel_tiny").dim
    wq = next(line for line in out.splitlines() if "attention.wq " in line)
    assert "ColwiseParallel" in wq and f"weight [{dim}, {dim}] → [{dim // 4}, {dim}]" in wq
    assert "R@dp_replicate" in wq and "S(0)@tp" in wq
    assert re.search(r"^layers\.\{0-\d+\} +FSDP unit", out, re.MULTILINE)
    assert "Per-rank memory" in out and "one training step on fake tensors" in out
    assert "dry run OK" in out
    assert not dump.exists()  # no checkpoint, config or metrics: nothing is written


def test_titan_train_ngpu_simulates_in_one_process() -> None:
    """`titan train --ngpu N` with a COMM_MODE runs one process simulating N ranks."""
    args = _comm_mode_args(16, [*TINY, "--comm.mode", "fake_backend"])
    assert parse_args(args).comm.fake_world_size == 16
    assert _comm_mode_args(16, TINY) == []  # default mode: torchrun as usual
    with pytest.raises(ConfigError, match=r"^comm\.fake_world_size: expected the number of"):
        parse_args([*TINY, "--comm.mode", "fake_backend"])


@pytest.mark.parametrize(
    "layout",
    [
        ["--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "full"],
        [
            "--model.n_layers",
            "4",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "ZBVZeroBubble",
            "--parallelism.tensor_parallel_degree",
            "2",
        ],
        ["--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"],
    ],
    ids=["fsdp4xtp2_ac", "pp2_zbv_x_fsdp2xtp2", "fsdp2xcp2xtp2"],
)
def test_fake_step_holds_what_the_estimate_predicts(
    tmp_path: Path, assets: Path, layout: list[str]
) -> None:
    """The real FSDP2/TP/PP code on fake tensors and the analytic estimate agree byte for byte
    on rank 0's parameters, gradients and optimizer state."""
    args = [*TINY, "--comm.mode", "fake_backend", "--comm.fake_world_size", "8", *layout]
    report = comm_mode.dry_run(parse_args([*args, "--job.dump_folder", str(tmp_path)]))
    step, expected = report.step, comm_mode.rank0_estimate(report.estimate)
    assert step.num_params > 0 and step.params_with_grad == step.num_params
    assert step.param_bytes == expected.params
    assert step.grad_bytes == expected.grads
    assert step.optimizer_bytes == expected.optimizer
    assert report.peak_rss_bytes < 2 * 2**30


@pytest.mark.slow
def test_fake_backend_llama3_70b_on_128_ranks(tmp_path: Path, assets: Path) -> None:
    """The issue's command: 70B, TP 8 x FSDP 16, one fake step, on this CPU-only machine."""
    start = time.perf_counter()
    proc = _run_train(
        ["--job.dump_folder", str(tmp_path / "out")],
        900,
        NGPU="128",
        COMM_MODE="fake_backend",
        MODULE="llama3",
        CONFIG="llama3_70b",
    )
    seconds = time.perf_counter() - start
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "world 128 = pp 1 × dp_replicate 1 × dp_shard 16 × cp 1 × tp 8" in out
    n_layers = get_flavor("llama3", "70B").n_layers
    assert f"layers.{{0-{n_layers - 1}}}.attention.wq" in out
    step = next(line for line in out.splitlines() if "one training step" in line)
    for term in ("parameters", "gradients", "optimizer state"):
        assert re.search(rf"{term} (\S+ \S+) \(estimate \1\)", step), step
    rss = re.search(r"peak RSS of this process ([\d.]+) GiB", out)
    assert rss and float(rss.group(1)) < 4.0, out[-500:]  # the machine has 24 GiB
    print(f"70B fake_backend dry run at 128 ranks: {seconds:.0f}s wall, {rss.group(1)} GiB RSS")


# --- local_tensor -----------------------------------------------------------------------------


def test_local_tensor_tp2_matches_the_single_process(
    tmp_path: Path, parity_seed: Path, parity_reference: dict
) -> None:
    """TP 2 simulated in one process (real numerics) from the shared seed checkpoint."""
    extra = ["--comm.mode", "local_tensor", "--comm.fake_world_size", "2"]
    extra += ["--parallelism.tensor_parallel_degree", "2"]
    got = run_layout(tmp_path, parity_seed, nproc=1, dp=1, extra=extra, steps=5)
    assert_parity(got, parity_reference, what="local_tensor TP 2")


@pytest.mark.parametrize(
    "overrides, key",
    [
        ([], "data_parallel_shard_degree=2"),  # the default -1 takes the whole world: FSDP 2
        (
            [
                "--parallelism.data_parallel_replicate_degree",
                "2",
                "--parallelism.data_parallel_shard_degree",
                "1",
            ],
            "data_parallel_replicate_degree=2",
        ),
        (["--parallelism.context_parallel_degree", "2"], "context_parallel_degree=2"),
        (["--parallelism.pipeline_parallel_degree", "2"], "pipeline_parallel_degree=2"),
    ],
    ids=["fsdp", "ddp", "cp", "pp"],
)
def test_local_tensor_refuses_what_it_cannot_simulate(overrides: list[str], key: str) -> None:
    cfg = parse_args(
        [*TINY, "--comm.mode", "local_tensor", "--comm.fake_world_size", "2", *overrides]
    )
    with pytest.raises(ConfigError, match=rf"^comm\.mode: local_tensor cannot simulate .*{key}"):
        comm_mode.check(cfg)


def test_local_tensor_fsdp_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    args = [*TINY, "--job.dump_folder", str(tmp_path / "x")]
    args += ["--comm.mode", "local_tensor", "--comm.fake_world_size", "2"]
    proc = subprocess.run(
        [sys.executable, "-m", "titan_core.train", *args],
        env=process_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(
        "error: comm.mode: local_tensor cannot simulate parallelism.data_parallel_shard_degree=2"
    )
    assert not (tmp_path / "x").exists()
