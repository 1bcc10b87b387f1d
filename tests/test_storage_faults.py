"""Storage faults are inputs too: a read-only output folder or a full disk ends in one line that
says what failed, where and why in words, with exit code 2, and leaves nothing behind.

Real file systems from tests/storage_faults.py (read-only and small tmpfs mounts), which the
checkpoint, data, convert and eval tests use too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from helpers import titan_in_process
from storage_faults import Disk, cut, flip, one_line, titan

from titan_core import storage
from titan_core.checkpoint.dcp_io import dcp_reader
from titan_core.errors import ConfigError, StorageError

TINY = ["--module", "llama3", "--config", "llama3_debugmodel_tiny", "--training.steps", "2"]


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
    proc = titan(*command, *TINY, "--job.dump_folder", str(run), cwd=tmp_path)
    assert one_line(proc) == f"error: job.dump_folder: {run}: {words}"
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "step:" not in proc.stdout  # nothing trained


def test_read_only_eval_output_is_one_line_before_scoring(
    read_only: tuple[Path, str], trained: Path, tmp_path: Path
) -> None:
    folder, words = read_only
    step = trained / "checkpoint" / "step-4"
    proc = titan("eval", "--checkpoint", str(step), "--output", str(folder), cwd=tmp_path)
    assert one_line(proc) == f"error: --output: {folder}: {words}"
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
    with pytest.raises(StorageError) as info:
        storage.write_text(str(target), "x" * (1 << 20))
    assert str(info.value) == f"{target}: no space left on device"
    assert list(small_disk.iterdir()) == []  # neither the file nor its temp
    name = f"{uuid.uuid4().hex}.txt"
    storage.write_text(str(small_disk / name), "fits")  # the disk still works
    assert (small_disk / name).read_text() == "fits"


def _train_args(dump: Path, steps: int) -> list[str]:
    return [
        "--module", "llama3", "--config", "llama3_debugmodel_tiny", "--job.dump_folder", str(dump),
        "--training.steps", str(steps), "--checkpoint.enable", "--checkpoint.interval", "4",
        "--checkpoint.keep_latest_k", "0", "--checkpoint.no_last_save_model_only",
        "--metrics.log_freq", "1", "--debug.deterministic", "--validation.no_enable",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> Path:
    """A 16-step run (full checkpoints at steps 4, 8, 12 and 16, all kept) to copy and harm."""
    from titan_core.resolve import parse_args
    from titan_core.train import run

    dump = tmp_path_factory.mktemp("trained") / "run"
    run(parse_args(_train_args(dump, 16)))
    return dump


def _copy(trained: Path, to: Path) -> Path:
    shutil.copytree(trained, to)
    return to


def _losses(dump: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


@pytest.mark.parametrize(
    "harm, says",
    [
        (lambda step: (step / ".titan_complete").write_text("{not json"), "commit marker does not"),
        (lambda step: cut(step / "__0_0.distcp"), "(truncated)"),
        (lambda step: (step / "__0_0.distcp").unlink(), "data file missing"),
        (lambda step: cut(step / ".metadata"), "/.metadata: "),  # its size against the marker
        # Changed bytes at the start of the data file: once "optimizer....lr is not a tensor".
        (lambda step: flip(step / "__0_0.distcp", 0), "__0_0.distcp: checksum mismatch"),
    ],
    ids=["marker", "truncated-data", "missing-data", "truncated-metadata", "changed-data"],
)
def test_resume_passes_over_a_damaged_newest_step(
    harm: Any, says: str, trained: Path, tmp_path: Path
) -> None:
    """The newest step damaged (a full disk cut it short, a bad copy): the resume says so in one
    warning and loads the previous complete step, bitwise as that step left it; eval refuses
    the damaged step in one line naming the file."""
    dump = _copy(trained, tmp_path / "run")
    damaged = dump / "checkpoint" / "step-16"
    harm(damaged)
    if "marker" in says or ".metadata" in says:  # eval refuses the damaged step in one line
        line = one_line(titan("eval", "--checkpoint", str(damaged), cwd=tmp_path))
        assert str(damaged) in line and ("does not parse" in line or "metadata" in line), line
    env = {}
    if "marker" in says:  # and the MLflow run the metrics stream to says so too
        from mlflow.tracking import MlflowClient

        from titan_core.components.mlflow_sink import RUN_ID_ENV, TRACKING_URI_ENV

        uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
        mlflow_run = MlflowClient(uri).create_run(MlflowClient(uri).create_experiment("x"))
        env = {RUN_ID_ENV: mlflow_run.info.run_id, TRACKING_URI_ENV: uri}
    proc = titan("train", *_train_args(dump, 16), cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warning = next(line for line in proc.stdout.splitlines() if "is damaged" in line)
    assert "step-16 is damaged, not loaded: " in warning and says in warning, warning
    if env:
        params = MlflowClient(uri).get_run(mlflow_run.info.run_id).data.params
        assert params["checkpoint.damaged.step-16"] == warning.split("not loaded: ", 1)[1]
    assert "checkpoint/step-12 (step 12)" in proc.stdout
    logged = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    resumed = {r["step"]: r["loss"] for r in logged[-4:]}
    reference = _losses(trained)
    assert resumed == {s: reference[s] for s in range(13, 17)}  # step 12's state, bitwise


def test_eval_and_convert_refuse_changed_bytes_naming_the_file(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bytes changed in the middle of a step's data file (a model tensor: DCP alone would load
    it) or of its .metadata: eval and convert refuse the step, naming the file."""
    for case, name in enumerate(("__0_0.distcp", ".metadata")):
        step = _copy(trained, tmp_path / str(case) / "run") / "checkpoint" / "step-8"
        offset = (step / name).stat().st_size // 2
        if name != ".metadata":
            items = dcp_reader(str(step)).read_metadata().storage_data.items()
            info = next(v for k, v in items if k.fqn == "model.output.weight")
            offset = info.offset + info.length // 2
        flip(step / name, offset)
        says = f"{step}/{name}: checksum mismatch ("
        for argv in (
            ["eval", "--checkpoint", str(step)],
            ["convert", "dcp-to-hf", "--checkpoint", str(step), "--output", str(tmp_path / "hf")],
        ):
            code, _, err = titan_in_process(argv, capsys)
            assert code == 2 and err.count("\n") == 1 and says in err, (argv, err)
        assert not (tmp_path / "hf").exists()


def test_eval_refuses_a_truncated_model_file_naming_it(trained: Path, tmp_path: Path) -> None:
    step = _copy(trained, tmp_path / "run") / "checkpoint" / "step-4"
    for data in step.glob("*.distcp"):  # into the model's tensors (half may cut optimizer only)
        cut(data, 64)
    line = one_line(titan("eval", "--checkpoint", str(step), cwd=tmp_path))
    assert line.startswith(f"error: --checkpoint: {step}/__") and ".distcp: 64 bytes" in line
    assert line.endswith("(truncated)")


def test_every_complete_step_damaged_isone_line(trained: Path, tmp_path: Path) -> None:
    dump = _copy(trained, tmp_path / "run")
    for step in ("step-4", "step-8", "step-12", "step-16"):
        (dump / "checkpoint" / step / ".titan_complete").write_text("")
    line = one_line(titan("train", *_train_args(dump, 20), cwd=tmp_path))
    assert "every complete step in" in line and "step-16/.titan_complete" in line
    assert (dump / "checkpoint" / "step-16" / "__0_0.distcp").exists()  # nothing deleted


def test_prepare_on_a_full_disk_says_so_and_leaves_no_file(
    small_disk: Path, tmp_path: Path, assets: Path
) -> None:
    from titan_core.data.assets import bundled_corpus_dir, default_tokenizer_path
    from titan_core.data.prepare import PrepareSpec, prepare

    source = str(bundled_corpus_dir() / "train")
    spec = PrepareSpec(
        sources=(source,), tokenizer_path=str(default_tokenizer_path()), root=str(small_disk)
    )
    with pytest.raises(StorageError, match=rf"^{small_disk}/.*: no space left on device$"):
        prepare(spec, workers=1)
    assert [p for p in small_disk.rglob("*") if p.is_file()] == []  # no shard, no .tmp


# The tiny model with a vocabulary padded to 8192: a full checkpoint is 14.3 MB, so a 20 MB
# disk holds one and a 32 MB disk two.
WIDE = ["--model.vocab_size", "8192"]


def _kept(argv: list[str], k: int) -> list[str]:
    argv = [*argv, *WIDE]
    argv[argv.index("--checkpoint.keep_latest_k") + 1] = str(k)
    return argv


@pytest.mark.parametrize("ngpu", [1, 2], ids=["1-rank", "2-ranks"])
def test_a_checkpoint_save_on_a_full_disk_is_one_line_and_removes_its_step(
    ngpu: int, disk: Disk, tmp_path: Path, assets: Path
) -> None:
    """A 20 MB disk, room for one full checkpoint, keep_latest_k 2: the second save fails. It
    says so in one line naming the full disk (exit 2, on every rank, no flight-recorder trace
    written), its partial step is gone, the first step is intact (keep_latest_k never frees
    the newest complete one), and a rerun resumes from it and meets the same full disk."""
    dump = disk("20m") / "run"
    argv = _kept(_train_args(dump, 12), 2)
    if ngpu > 1:
        argv = ["--ngpu", str(ngpu), *argv]
    line = one_line(titan("train", *argv, cwd=tmp_path))
    said = f"checkpoint: saving {dump}/checkpoint/step-8 failed: no space left on device"
    if ngpu > 1:  # torchrun's report of the failed ranks becomes the job's one line
        assert line.startswith(f"error: training: rejected its input: {said}"), line
    else:
        assert line == f"error: {said}"
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-4"]
    assert sorted(p.name for p in dump.iterdir()) == ["checkpoint", "config.toml", "metrics.jsonl"]
    assert not list(dump.rglob("*.tmp*"))
    again = titan("train", *argv, cwd=tmp_path)
    assert again.returncode == 2 and "checkpoint/step-4 (step 4)" in again.stdout


def test_retention_makes_room_when_the_disk_is_full(
    disk: Disk, tmp_path: Path, assets: Path
) -> None:
    """A 32 MB disk, room for two full checkpoints, keep_latest_k 2: each save from the third on
    finds the disk full, frees the step keep_latest_k would free after it (never the newest
    complete one) and saves again; training ends with the newest two steps, its losses those
    of the same run on a roomy disk."""
    argv = _kept(_train_args(tmp_path / "roomy", 16), 0)
    assert titan("train", *argv, cwd=tmp_path).returncode == 0
    dump = disk("32m") / "run"
    proc = titan("train", *_kept(_train_args(dump, 16), 2), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Removed checkpoint step-4 early to make room" in proc.stdout
    assert "step-12 failed (no space left on device): freed older steps" in proc.stdout
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-12", "step-16"]
    assert _losses(dump) == _losses(tmp_path / "roomy")


PREPARE_MOMENTS = {"first-shard": 1, "half-the-shards": 8, "manifest": -1}


def _found(folder: Path, pattern: str) -> list[Path]:
    """``folder.glob(pattern)``, empty while ``folder`` comes and goes (the CLI's write check
    makes the output folder and removes it again before the prepare starts)."""
    try:
        return list(folder.glob(pattern))
    except FileNotFoundError:
        return []


def _prepare_until(out: Path, moment: int, sig: int, cwd: Path, partner: bool) -> None:
    """Start ``titan data prepare`` of the bundled corpus into ``out`` (and, with ``partner``, a
    second one of the same dataset beside it, left to finish); send ``sig`` to the first when
    ``moment`` shard files exist (-1: once its manifest is written)."""
    import time

    from titan_core.data.assets import bundled_corpus_dir

    argv = [sys.executable, "-m", "titan_core.cli", "data", "prepare"]
    argv += [str(bundled_corpus_dir() / "train"), "--out", str(out), "--data.workers", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "cwd": cwd, "env": env}
    victim = subprocess.Popen(argv, **pipes)  # type: ignore[call-overload]
    other = subprocess.Popen(argv, **pipes) if partner else None  # type: ignore[call-overload]
    deadline = time.monotonic() + 120
    while victim.poll() is None and time.monotonic() < deadline:
        # staged (``.staging-*/``) or committed (``shards/``) shard files
        shard_files = _found(out, "*/*/*.tokens")
        done = _found(out, "*/manifest.json") if moment < 0 else []
        if (moment >= 0 and len(shard_files) >= moment) or done:
            victim.send_signal(sig)
            break
        time.sleep(0.002)
    victim.communicate(timeout=120)
    if other is not None:
        other.communicate(timeout=120)


@pytest.mark.parametrize(
    "sig, moment, partner",
    [
        (9, "first-shard", False),
        (9, "manifest", False),  # killed after its commit: the temp files of its last writes
        (2, "half-the-shards", False),
        (2, "manifest", False),
        (9, "half-the-shards", True),  # beside a prepare of the same dataset, left to finish
        (2, "first-shard", True),
    ],
    ids=["kill-9-early", "kill-9-late", "ctrl-c-mid", "ctrl-c-late", "kill-9-concurrent",
         "ctrl-c-concurrent"],
)  # fmt: skip
def test_an_interrupted_prepare_never_leaves_a_cached_broken_dataset(
    sig: int, moment: str, partner: bool, tmp_path: Path, assets: Path
) -> None:
    """kill -9 or Ctrl-C at several moments, alone and beside a concurrent prepare of the same
    dataset: afterwards a prepare says "cached" only of a dataset whose every shard verifies,
    and the dataset is byte for byte the one an undisturbed prepare writes."""
    from titan_core.data.assets import bundled_corpus_dir, default_tokenizer_path
    from titan_core.data.prepare import PrepareSpec, prepare
    from titan_core.data.shards import read_manifest, verify_shards

    out = tmp_path / "data"
    _prepare_until(out, PREPARE_MOMENTS[moment], sig, tmp_path, partner)
    spec = PrepareSpec(
        sources=(str(bundled_corpus_dir() / "train"),),
        tokenizer_path=str(default_tokenizer_path()),
        root=str(out),
    )
    after = prepare(spec, workers=1)
    verify_shards(after.url, read_manifest(after.url), checksum=True)
    again = prepare(spec, workers=1)
    assert again.cached  # and now, since it verified, "cached" is true
    clean = prepare(dataclasses.replace(spec, root=str(tmp_path / "clean")), workers=1)
    ours = sorted(p.relative_to(out) for p in Path(after.url).rglob("*") if p.is_file())
    theirs = sorted(
        p.relative_to(tmp_path / "clean") for p in Path(clean.url).rglob("*") if p.is_file()
    )
    assert ours == theirs
    for rel in ours:
        if rel.name != "manifest.json":  # shard bytes equal; the manifest lists the same shards
            assert (out / rel).read_bytes() == (tmp_path / "clean" / rel).read_bytes(), rel
    assert read_manifest(after.url).shards == read_manifest(clean.url).shards
