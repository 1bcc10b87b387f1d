"""Storage faults on demand, for the checkpoint, data, convert and eval tests (conftest.py
registers the fixtures).

Real file systems, not mocks: a read-only tmpfs, and small tmpfs mounts that really fill up,
mounted for the test where this process may mount (root, as in CI). Without root a folder
without write permission stands in for the read-only one, and the full-disk tests are skipped
with the reason. ``cut``, ``overwrite`` and ``flip`` damage files as a crash or a bad copy would.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

Disk = Callable[..., Path]


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
def disk(tmp_path: Path) -> Iterator[Disk]:
    """``disk(size, free=None)``: a new file system of ``size`` (tmpfs: "64k", "20m"), unmounted
    after; with ``free`` (bytes), a ballast file fills it until only that much is left, as
    other data would."""
    mounted: list[Path] = []

    def make(size: str, free: int | None = None) -> Path:
        folder = tmp_path / f"disk-{len(mounted)}"
        if os.geteuid() != 0 or not _mount_tmpfs(folder, f"size={size}"):
            pytest.skip("needs root to mount a small tmpfs")
        mounted.append(folder)
        if free is None:
            return folder
        stat = os.statvfs(folder)  # beside the folder the test gets: the same file system
        (folder / "ballast").write_bytes(b"\0" * max(stat.f_bavail * stat.f_frsize - free, 0))
        (folder / "files").mkdir()
        return folder / "files"

    try:
        yield make
    finally:
        for folder in mounted:
            subprocess.run(["umount", str(folder)], check=False)


@pytest.fixture
def small_disk(disk: Disk) -> Path:
    """A 64 KiB file system."""
    return disk("64k")


def cut(path: Path, size: int = -1) -> None:
    """Cut ``path`` to ``size`` bytes (default: half), as a crash or a full disk would."""
    with open(path, "r+b") as f:
        f.truncate(size if size >= 0 else max(1, path.stat().st_size // 2))


def overwrite(path: Path, byte: bytes = b"\xff") -> None:
    """Rewrite ``path`` at its own size with one repeated byte (a bad copy: only a checksum
    or a content check notices)."""
    path.write_bytes(byte * path.stat().st_size)


def flip(path: Path, offset: int, n: int = 16) -> None:
    """Invert ``n`` bytes of ``path`` at ``offset`` (a bit flip, a bad copy: the size stays,
    only a checksum notices)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(n)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def titan(
    *argv: str, cwd: Path, env: dict[str, str] | None = None, timeout: int = 300
) -> subprocess.CompletedProcess[str]:
    """``titan ARGV`` in a subprocess (one thread per process)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "titan_core.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=timeout,
    )


def one_line(proc: subprocess.CompletedProcess[str], code: int = 2) -> str:
    """The one ``error:`` line of a command that failed with ``code``; no traceback anywhere."""
    assert proc.returncode == code, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout[-3000:]
    return lines[0]


def files_under(folder: Path) -> list[Path]:
    """Every file and folder below ``folder`` (debris check)."""
    return sorted(folder.rglob("*"))
