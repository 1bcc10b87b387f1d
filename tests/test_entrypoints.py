"""The user-facing entry points: run_train.sh (torchrun), `titan demo` resume, `titan config`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import process_env

from titan_core.checkpoint.manager import complete_steps

ROOT = Path(__file__).resolve().parents[1]
TINY_OVERRIDES = [
    "--training.steps",
    "3",
    "--metrics.log_freq",
    "1",
    "--metrics.cpu_peak_tflops",
    "1",
    "--validation.no_enable",
]


@pytest.mark.multiprocess
def test_run_train_sh_two_ranks_log_rank(tmp_path: Path, assets: Path) -> None:
    toml = tmp_path / "job.toml"
    toml.write_text("[training]\nlocal_batch_size = 2\n")
    proc = subprocess.run(
        [
            str(ROOT / "run_train.sh"),
            "--job.dump_folder",
            str(tmp_path / "out"),
            "--checkpoint.no_enable",
            *TINY_OVERRIDES,
        ],
        env=process_env(
            NGPU="2", LOG_RANK="0,1", CONFIG="llama3_debugmodel_tiny", CONFIG_FILE=str(toml)
        ),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "[rank0]:" in out and "[rank1]:" in out  # LOG_RANK=0,1 shows both ranks
    assert "Applied FSDP" in out
    assert "2 tokens/step/rank" not in out and "128 tokens/step/rank" in out  # TOML batch 2 x 64
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_titan_demo_resumes_when_run_again(tmp_path: Path, assets: Path) -> None:
    args = [
        sys.executable,
        "-m",
        "titan_core.cli",
        "demo",
        "--engine-only",  # the engine's own resume path (plain `titan demo` runs the pipeline)
        "--steps",
        "6",
        "--model.flavor",
        "debugmodel_tiny",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--lr_scheduler.warmup_steps",
        "2",
        "--checkpoint.interval",
        "3",
        "--job.dump_folder",
        str(tmp_path / "demo"),
        "--metrics.log_freq",
        "1",
        "--metrics.cpu_peak_tflops",
        "1",
        "--validation.no_enable",
    ]
    first = subprocess.run(args, env=process_env(), capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "mean loss of the first" in first.stdout
    ckpt = str(tmp_path / "demo" / "checkpoint")
    assert complete_steps(ckpt) == [3, 6]
    second = subprocess.run(args, env=process_env(), capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "found checkpoint step-6" in second.stdout and "continuing to step 12" in second.stdout
    assert "(step 6)" in second.stdout  # loaded the full state of step 6, not fresh weights
    assert complete_steps(ckpt) == [6, 9, 12]  # the debug recipe keeps the latest 3
    rows = [json.loads(line) for line in (tmp_path / "demo" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows if "loss" in r][-1] == 12


def test_titan_config_prints_resolved_toml() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "titan_core.cli",
            "config",
            "--module",
            "llama3",
            "--config",
            "llama3_8b",
            "--training.seq_len",
            "4096",
        ],
        env=process_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert 'flavor = "8B"' in proc.stdout and "seq_len = 4096" in proc.stdout


def test_titan_train_error_is_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "titan_core.cli",
            "train",
            "--module",
            "llama3",
            "--config",
            "llama3_debugmodel",
            "--profiling.enable_memory_snapshot=False",
            "--job.dump_folder",
            str(tmp_path / "x"),
        ],
        env=process_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "--profiling.no_enable_memory_snapshot" in proc.stderr
    assert not (tmp_path / "x").exists()
