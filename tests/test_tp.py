"""Tensor + sequence parallelism: loss parity, clipping, validation, checkpoints, compile, errors.

Every run loads the shared seed checkpoint and draws the same samples (tests/parallel_harness.py),
so each layout is compared with one process step by step: fp32, tolerance 1e-5 relative (only
the reduction order differs). Gradient norms (clipping is active: norms ~7 > max_norm 1) and
validation losses are compared with a single-process run that logs them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import reproducible_env
from parallel_harness import (
    assert_parity,
    free_port,
    run_layout,
    train_layout,
)

pytestmark = pytest.mark.multiprocess

TP2 = ["--parallelism.tensor_parallel_degree", "2"]
# Validation at steps 5 and 10 (2 batches each); full-state saves at steps 4 and 8.
VALIDATE = ["--validation.enable", "--validation.freq", "5", "--validation.steps", "2"]
SAVE = ["--checkpoint.no_load_only", "--checkpoint.interval", "4"]


def _rows(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def _series(dump: Path, key: str) -> dict[int, float]:
    return {int(r["step"]): r[key] for r in _rows(dump) if key in r}


def _resume(
    dump: Path, seed: Path, checkpoint: Path, nproc: int, dp: int, extra: list[str]
) -> dict:
    """Train to step 10 from a copied step checkpoint (a full state); returns {step: loss}."""
    shutil.copytree(checkpoint, dump / "checkpoint" / checkpoint.name)
    start = int(checkpoint.name.removeprefix("step-")) + 1
    return run_layout(dump, seed, nproc=nproc, dp=dp, extra=extra, start=start)


def _assert_close(got: dict, ref: dict, what: str, rel: float = 1e-5) -> None:
    assert sorted(got) == sorted(ref), f"{what}: steps {sorted(got)} vs {sorted(ref)}"
    assert_parity(got, ref, rel=rel, what=what)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory, parity_seed: Path) -> Path:
    """One process, 10 steps, validating and saving full states: its dump folder."""
    dump = tmp_path_factory.mktemp("tp_single")
    run_layout(dump, parity_seed, nproc=1, dp=1, extra=[*VALIDATE, *SAVE])
    return dump


@pytest.mark.parametrize(
    "name, nproc, dp, extra",
    [
        ("TP 2", 2, 1, TP2),
        ("TP 2 without loss parallel", 2, 1, [*TP2, "--parallelism.disable_loss_parallel"]),
        ("FSDP x TP 2x2", 4, 2, TP2),
    ],
)
def test_tp_parity(
    tmp_path: Path,
    parity_seed: Path,
    parity_reference: dict,
    single: Path,
    name: str,
    nproc: int,
    dp: int,
    extra: list[str],
) -> None:
    """Losses and gradient norms equal the single process's; so do validation losses where
    one data-parallel rank reads the validation split as the single process does (with
    ``dp`` ranks each reads its own part of it, other samples, so only its presence counts)."""
    run = train_layout(tmp_path, parity_seed, nproc=nproc, dp=dp, extra=[*extra, *VALIDATE])
    # Ranks that silently skipped the plan would train full replicas and match just as well.
    loss_parallel = "disable_loss_parallel" not in " ".join(extra)
    applied = f"Applied tensor + sequence parallel (degree 2, loss parallel {loss_parallel})"
    assert run.output.count(applied) == nproc, run.output[-4000:]
    got = run.losses
    assert_parity(got, parity_reference, what=name)
    _assert_close(_series(tmp_path, "grad_norm"), _series(single, "grad_norm"), f"{name} norm")
    val = _series(tmp_path, "validation/loss")
    assert sorted(val) == [5, 10]
    if dp == 1:
        _assert_close(val, _series(single, "validation/loss"), f"{name} validation")


def test_checkpoints_reshard_between_tp_and_one_process(
    tmp_path: Path, parity_seed: Path, parity_reference: dict, single: Path
) -> None:
    """A full state (model, optimizer, data, schedule) saved by one process continues under
    TP 2, and TP 2's save continues in one process, both on the uninterrupted losses."""
    tp_dump, one_dump = tmp_path / "tp", tmp_path / "one"
    got = _resume(tp_dump, parity_seed, single / "checkpoint" / "step-4", 2, 1, [*TP2, *SAVE])
    assert sorted(got) == list(range(5, 11))
    assert_parity(got, parity_reference, what="TP 2 from a 1-process step-4")
    got = _resume(one_dump, parity_seed, tp_dump / "checkpoint" / "step-8", 1, 1, [])
    assert sorted(got) == [9, 10]
    assert_parity(got, parity_reference, what="1 process from a TP 2 step-8")


@pytest.mark.slow
def test_tp_compile_parity(
    tmp_path: Path, parity_seed: Path, single: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compiled blocks and loss under TP + loss parallel: losses and gradient norms equal the
    eager single process (a cold compile cache).

    This needs the embedding-output fix (FIELD_NOTES). With a warm cache it also needs the
    AOTAutograd cache off (its DTensor keys are the same on every rank: tensor_parallel.py):
    the run says it is off on each rank.
    """
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor_cache"))
    ref = {s: v for s, v in _series(single, "loss").items() if s <= 2}
    norms = {s: v for s, v in _series(single, "grad_norm").items() if s <= 2}
    dump = tmp_path / "cold"
    args = [*TP2, "--compile.enable"]
    run = train_layout(dump, parity_seed, nproc=2, dp=1, extra=args, steps=2)
    assert run.output.count("AOTAutograd cache off") == 2, run.output[-3000:]  # on each rank
    _assert_close(run.losses, ref, "TP 2 + compile")
    _assert_close(_series(dump, "grad_norm"), norms, "TP 2 + compile norm")


def _train_error(tmp_path: Path, args: list[str], world_size: int) -> str:
    """Run rank 0 of a ``world_size`` world alone: a config error must come out before the
    process group (which would wait for the missing ranks) starts."""
    env = {**reproducible_env(), "WORLD_SIZE": str(world_size), "RANK": "0", "LOCAL_RANK": "0"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    cmd = [sys.executable, "-m", "titan_core.train", "--module", "llama3"]
    cmd += ["--config", "llama3_debugmodel_tiny", "--job.dump_folder", str(tmp_path / "run")]
    cmd += ["--comm.init_timeout_seconds", "30", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()  # nothing written
    return lines[-1]


@pytest.mark.parametrize(
    "args, world, expected",
    [
        (
            ["--parallelism.tensor_parallel_degree", "4"],
            4,
            "parallelism.tensor_parallel_degree: 4 must divide n_heads (4) and n_kv_heads (2)",
        ),
        (
            [*TP2, "--parallelism.enable_async_tensor_parallel", "--compile.enable"],
            2,
            "parallelism.enable_async_tensor_parallel: async TP needs CUDA",
        ),
        (
            ["--float8.recipe_name", "tensorwise"],
            2,
            "float8.recipe_name: 'tensorwise' needs CUDA (SM89+) and torchao; device is cpu",
        ),
        (
            [*TP2, "--parallelism.data_parallel_replicate_degree", "2"],
            4,
            "parallelism.data_parallel_replicate_degree: DDP does not compose with tensor",
        ),
        (
            [*TP2, "--training.seq_len", "33"],
            2,
            "training.seq_len: 33 must be divisible by parallelism.tensor_parallel_degree (2)",
        ),
    ],
    ids=["tp-kv-heads", "async-tp-cpu", "float8-cpu", "ddp-tp", "uneven-seq"],
)
def test_bad_tp_configs_fail_in_one_line(
    tmp_path: Path, args: list[str], world: int, expected: str
) -> None:
    assert expected in _train_error(tmp_path, args, world)
