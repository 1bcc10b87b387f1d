"""Storage faults are inputs too: a read-only output folder or a full disk ends in one line that
says what failed, where and why in words, with exit code 2, and leaves nothing behind.

Real file systems: a read-only tmpfs and a 64 KiB tmpfs mounted for the test where this process
may mount (root, as in CI); elsewhere a folder without write permission stands in for the first.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from titan_core import storage
from titan_core.errors import ConfigError, DataError, storage_errors

TINY = ["--module", "llama3", "--config", "llama3_debugmodel_tiny", "--training.steps", "2"]


def _mount_tmpfs(target: Path, options: str) -> bool:
    target.mkdir(parents=True, exist_ok=True)
    cmd = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)]
    return subprocess.run(cmd, capture_output=True).returncode == 0


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """(a folder this process cannot write in, the words the error gives)."""
    folder = tmp_path / "ro"
    if os.geteuid() == 0:
        if not _mount_tmpfs(folder, "ro,size=1m"):
            pytest.skip("root without permission to mount a read-only tmpfs")
        try:
            yield folder, "read-only file system"
        finally:
            subprocess.run(["umount", str(folder)], check=False)
        return
    folder.mkdir()
    folder.chmod(0o555)
    try:
        yield folder, "permission denied"
    finally:
        folder.chmod(0o755)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB file system."""
    folder = tmp_path / "small"
    if os.geteuid() != 0 or not _mount_tmpfs(folder, "size=64k"):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def _titan(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "titan_core.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


def _one_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize(
    "command",
    [["train"], ["train", "--ngpu", "2"], ["launch"]],
    ids=["train", "train-2-ranks", "launch"],
)
def test_read_only_output_is_one_line_before_anything_runs(
    command: list[str], read_only: tuple[Path, str], tmp_path: Path, assets: Path
) -> None:
    folder, words = read_only
    run = folder / "run"
    proc = _titan(*command, *TINY, "--job.dump_folder", str(run), cwd=tmp_path)
    assert _one_line(proc) == f"error: job.dump_folder: {run}: {words}"
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "step:" not in proc.stdout  # nothing trained


def test_read_only_eval_output_is_one_line_before_scoring(
    read_only: tuple[Path, str], tmp_path: Path, assets: Path
) -> None:
    folder, words = read_only
    trained = _titan("train", *TINY, "--job.dump_folder", "run", "--checkpoint.enable",
                     "--checkpoint.interval", "2", cwd=tmp_path)  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    step = tmp_path / "run" / "checkpoint" / "step-2"
    proc = _titan("eval", "--checkpoint", str(step), "--output", str(folder), cwd=tmp_path)
    assert _one_line(proc) == f"error: --output: {folder}: {words}"
    assert "loss" not in proc.stdout  # not scored first


def test_the_write_check_leaves_no_folders(tmp_path: Path) -> None:
    storage.check_writable(str(tmp_path / "a" / "b" / "c"), "job.dump_folder")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()
    storage.check_writable(str(tmp_path / "kept"), "job.dump_folder")
    assert [p.name for p in tmp_path.iterdir()] == ["kept"] and not list(
        (tmp_path / "kept").iterdir()
    )
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"^job\.dump_folder: .*/file/run: a path component is"):
        storage.check_writable(str(blocker / "run"), "job.dump_folder")


def test_a_full_disk_says_so_and_leaves_no_temp_file(small_disk: Path) -> None:
    target = small_disk / "config.toml"
    with pytest.raises(DataError) as info, storage_errors(str(target), DataError):
        storage.write_text_atomic(str(target), "x" * (1 << 20))
    assert str(info.value) == f"{target}: no space left on device"
    assert list(small_disk.iterdir()) == []  # neither the file nor its temp
    name = f"{uuid.uuid4().hex}.txt"
    storage.write_text_atomic(str(small_disk / name), "fits")  # the disk still works
    assert (small_disk / name).read_text() == "fits"
