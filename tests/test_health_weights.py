"""Poisoned weights (issue 35): an update that overflows leaves every weight non-finite while its
own loss and gradient norm are finite, so the step guard passes it. The weights (and optimizer
state) are checked at every save point: with the guard on nothing non-finite is saved and the
run stops (exit code 4) or rolls back; retention never deletes the newest healthy checkpoint;
the stop line names a healthy checkpoint or says there is none. Float settings are checked
against the dtype they are used in, and a checkpoint folder that cannot be written is one line
before anything starts.

The faults are real: the ``overflow_update`` drill applies one step's update at an infinite
learning rate, and a learning rate of 3e38 (finite in float32) overflows when it is applied.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import TINY, checkpoint_tensors, titan_in_process

from titan_core.checkpoint.manager import COMMIT_MARKER, CheckpointManager, complete_steps
from titan_core.components.health import HealthStop
from titan_core.config.job import Checkpoint
from titan_core.errors import CheckpointError
from titan_core.resolve import parse_args
from titan_core.train import run


def _args(dump: Path, *extra: str) -> list[str]:
    """8 steps, a full checkpoint every 2, the newest 2 kept."""
    return [
        *TINY,
        "--job.dump_folder", str(dump), "--training.steps", "8", "--metrics.log_freq", "1",
        "--metrics.cpu_peak_tflops", "1", "--validation.no_enable", "--checkpoint.enable",
        "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2",
        "--checkpoint.no_last_save_model_only", *extra,
    ]  # fmt: skip


def _nonfinite(step_dir: Path) -> list[str]:
    """The tensors of a (single-process) checkpoint on disk, model and optimizer state, that
    hold a NaN or an inf."""
    state = checkpoint_tensors(step_dir)
    assert any(k.startswith("model.") for k in state) and any(k.startswith("optim") for k in state)
    return [key for key, t in state.items() if not torch.isfinite(t).all()]


def _health(step_dir: Path) -> dict:
    return json.loads((step_dir / COMMIT_MARKER).read_text())["health"]


def _rows(dump: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (dump / name).read_text().splitlines()]


def test_an_overflowing_update_stops_the_run_and_keeps_the_newest_healthy_checkpoint(
    tmp_path: Path, assets: Path
) -> None:
    """Step 5's update overflows: its loss and gradient norm are finite (the guard passes it),
    every weight after it is not. The check at the step after a save (4) finds them at step 5,
    before step 6's save: the run stops with exit code 4, nothing is saved, and keep_latest_k
    has deleted no healthy checkpoint. (The check at a save point itself: the next test.)"""
    with pytest.raises(HealthStop) as stop:
        run(parse_args(_args(tmp_path, "--debug.drill", "--debug.inject", "overflow_update:5")))
    folder = tmp_path / "checkpoint"
    assert stop.value.exit_code == 4
    assert str(stop.value) == (
        "health: step 5: nonfinite weights in 21 tensors on rank 0; an applied update made them "
        "so, which health.nonfinite = skip cannot undo: stopped, nothing saved; "
        f"newest checkpoint (healthy): {folder}/step-4"
    )
    metrics = {int(r["step"]): r for r in _rows(tmp_path, "metrics.jsonl")}
    assert max(metrics) == 4 and math.isfinite(metrics[4]["loss"])  # step 5 stopped, unlogged
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-4"]
    for step in complete_steps(str(folder)):  # what is on disk, read back: all finite
        assert _nonfinite(folder / f"step-{step}") == [], step
        assert _health(folder / f"step-{step}")["healthy"] is True
    rows = _rows(tmp_path, "health.jsonl")  # step 5's loss and grad norm passed the guard
    assert [(r["step"], r["quantity"]) for r in rows] == [(5, "weights")]
    assert rows[-1] == {"step": 5, "quantity": "weights", "kind": "nonfinite", "value": 21.0,
                        "action": "stop", "ranks": [0]}  # fmt: skip


def test_from_scratch_the_stop_says_there_is_no_checkpoint(
    tmp_path: Path, assets: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """lr 1e39 is inf in float32: one line before anything is written. lr 3e38 is finite there,
    so it is accepted, but step 1's update overflows: the first save point (step 2) finds it
    before writing and stops the run without calling anything healthy."""
    dump = tmp_path / "run"
    assert titan_in_process(["train", *_args(dump, "--optimizer.lr", "1e39")], capsys)[0] == 2
    assert not dump.exists()
    argv = _args(dump, "--optimizer.lr", "3e38", "--lr_scheduler.warmup_steps", "0")
    with pytest.raises(HealthStop) as stop:
        run(parse_args(argv))
    assert str(stop.value).startswith("health: step 2: nonfinite weights in 21 tensors on rank 0")
    assert str(stop.value).endswith("; no checkpoint of this run was saved")
    assert complete_steps(str(dump / "checkpoint")) == []


def test_without_the_guard_retention_keeps_the_newest_healthy_checkpoint(
    tmp_path: Path, assets: Path, capsys: pytest.CaptureFixture
) -> None:
    """Guard off: the saves after the overflow are kept, marked unhealthy, but keep_latest_k
    (2) does not delete step 4, the newest healthy one. A run that resumes passes over the
    unhealthy steps 8 and 6, saying so, and trains on from step 4 with finite weights; asked
    for step 8 by name, it refuses in one line."""
    argv = _args(tmp_path, "--health.no_enable", "--debug.drill", "--debug.inject",
                 "overflow_update:5")  # fmt: skip
    run(parse_args(argv))
    folder = tmp_path / "checkpoint"
    assert complete_steps(str(folder)) == [4, 6, 8]
    assert _health(folder / "step-4") == {"healthy": True, "guard": False}
    assert _nonfinite(folder / "step-4") == []
    for step in (6, 8):
        assert _health(folder / f"step-{step}") == {"healthy": False, "guard": False}
        assert _nonfinite(folder / f"step-{step}")
    with pytest.raises(CheckpointError, match=r"^checkpoint\.load_step: .*step-8 holds non-finite"):
        run(parse_args(_args(tmp_path, "--training.steps", "12", "--checkpoint.load_step", "8")))
    capsys.readouterr()
    logged = run(parse_args(_args(tmp_path, "--training.steps", "12")))
    out = capsys.readouterr().out
    for step in (8, 6):
        assert f"Checkpoint step-{step} is unhealthy, not loaded: its commit marker says" in out
    assert [m["step"] for m in logged] == list(range(5, 13))
    assert all(math.isfinite(m["loss"]) for m in logged)
    assert complete_steps(str(folder)) == [10, 12]
    assert _health(folder / "step-12")["healthy"] is True and _nonfinite(folder / "step-12") == []


def test_freeing_room_for_a_save_never_removes_the_newest_healthy_checkpoint(
    tmp_path: Path,
) -> None:
    """A full disk frees what keep_latest_k would: never the newest complete step, and never
    the newest healthy one either (markers as a guard-off run writes them)."""
    folder = tmp_path / "checkpoint"
    for step, healthy in ((2, True), (4, True), (6, False), (8, False)):
        (folder / f"step-{step}").mkdir(parents=True)
        marker = {"step": step, "model_only": False, "health": {"healthy": healthy}}
        (folder / f"step-{step}" / COMMIT_MARKER).write_text(json.dumps(marker))
    cfg = Checkpoint(enable=True, keep_latest_k=2)
    manager = CheckpointManager(cfg, str(tmp_path), {}, rank=0, world_size=1)
    assert manager._free_before_save(10)
    assert complete_steps(str(folder)) == [4, 8]


@pytest.mark.parametrize(
    ("argv", "key", "value"),
    [
        (["--optimizer.lr", "1e39"], "--optimizer.lr", "'1e39'"),
        (["--optimizer.eps", "1e-50"], "--optimizer.eps", "'1e-50'"),  # 0 in float32: 0 / 0
        (["--health.spike_threshold", "1e39"], "--health.spike_threshold", "'1e39'"),
        (["--training.max_norm", "1e39"], "--training.max_norm", "'1e39'"),
        ("[optimizer]\nweight_decay = 1e39\n", "optimizer.weight_decay", "1e+39"),  # TOML
    ],
)
def test_a_float_its_dtype_cannot_hold_is_one_line_before_anything_is_written(
    tmp_path: Path, argv: list[str] | str, key: str, value: str, capsys: pytest.CaptureFixture
) -> None:
    dump = tmp_path / "run"
    if isinstance(argv, str):  # a config file: its line names the file too
        (tmp_path / "job.toml").write_text(argv)
        argv, key = ["--job.config_file", str(tmp_path / "job.toml")], f"{tmp_path}/job.toml: {key}"
    code, _, err = titan_in_process(["train", *TINY, "--job.dump_folder", str(dump), *argv], capsys)
    assert code == 2 and err == (
        f"error: {key}: expected a float that float32 holds (0 or a magnitude from 1.175e-38 "
        f"to 3.403e+38: it is used in float32 arithmetic), got {value}\n"
    )
    assert not dump.exists()


def test_the_dtype_ranges_are_torchs() -> None:
    from titan_core.config.schema import DTYPE_RANGE, schema

    for name, (largest, smallest) in DTYPE_RANGE.items():
        info = torch.finfo(getattr(torch, name))
        assert (largest, smallest) == (info.max, info.tiny), name
    marked = {key for key, spec in schema().items() if spec.dtype}
    assert {"optimizer.lr", "optimizer.eps", "health.spike_threshold"} <= marked
    assert "launch.retry_delay_seconds" not in marked  # a host float: a double is what it needs


@pytest.mark.parametrize("ranks", [[], ["--ngpu", "2"]], ids=["train", "train-2-ranks"])
def test_a_read_only_checkpoint_folder_is_one_line_before_anything_runs(
    tmp_path: Path, ranks: list[str], read_only: tuple[Path, str], assets: Path, capsys
) -> None:
    """checkpoint.folder outside the dump folder (an absolute path) and not writable: found
    with the other outputs, not at the first save after steps were trained."""
    folder, words = read_only
    dump, ckpt = tmp_path / "run", folder / "ckpt"
    argv = ["train", *ranks, *TINY, "--job.dump_folder", str(dump), "--checkpoint.enable",
            "--checkpoint.folder", str(ckpt)]  # fmt: skip
    code, out, err = titan_in_process(argv, capsys)
    assert (code, err) == (2, f"error: checkpoint.folder: {ckpt}: {words}\n")
    assert "step:" not in out and not dump.exists()
