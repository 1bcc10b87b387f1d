"""A full disk outside a checkpoint save: every writer of the trainer, the launchers and the
pipeline ends in one line naming the file and the full disk (``StorageError``, exit code 2),
and leaves nothing behind: no temp file, no folder it made, no half-written file, no half line.

Drills on nearly full tmpfs mounts (tests/storage_faults.py): real ``titan train`` processes for
``config.toml`` and ``metrics.jsonl`` (one rank and two), and each other writer called in this
process. Checkpoint saves on a full disk are drilled in tests/test_storage_faults.py; the rule
that no other write path exists is tests/test_writers.py.
"""

from __future__ import annotations

import json
import re
import tempfile
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
from storage_faults import Disk, files_under, one_line, titan

from titan_core import storage
from titan_core.cli import command
from titan_core.errors import StorageError

PAGE = 4096  # tmpfs allocates whole pages: a file of n bytes takes ceil(n / 4096) of them
FULL = "no space left on device"
RUN = ["--module", "llama3", "--config", "llama3_debugmodel_tiny", "--metrics.log_freq", "1",
       "--validation.no_enable", "--checkpoint.no_enable"]  # fmt: skip


def _pages(n: int) -> int:
    return -(-n // PAGE)


# --------------------------------------------------------------------- the trainer, as a process


@pytest.mark.parametrize("ngpu", [1, 2], ids=["1-rank", "2-ranks"])
def test_config_toml_on_a_full_disk_is_one_line_and_leaves_no_run_folder(
    ngpu: int, disk: Disk, tmp_path: Path, assets: Path
) -> None:
    """One free page: the write check's probe fits, config.toml (two pages and more: a long
    job.description) does not. One line naming it, exit 2, no run folder left, nothing
    trained; under the launcher the line is the documented ``training: rejected its input``."""
    files = disk("64k", free=PAGE)
    dump = files / "run"
    argv = [*RUN, "--training.steps", "2", "--job.description", "x" * PAGE]
    argv += ["--job.dump_folder", str(dump)]
    if ngpu > 1:
        argv = ["--ngpu", str(ngpu), *argv]
    proc = titan("train", *argv, cwd=tmp_path)
    line = one_line(proc)
    said = f"{dump}/config.toml: {FULL}"
    assert line == (
        f"error: training: rejected its input: {said}" if ngpu > 1 else f"error: {said}"
    )
    assert "step:" not in proc.stdout  # nothing trained
    # Under the launcher, torchrun stops rank 1 with SIGTERM (rank 0 alone writes config.toml)
    # and rank 1 writes its flight-recorder trace on the way out: the launcher removes it.
    assert files_under(files) == []


def _config_bytes(argv: list[str]) -> int:
    """The size of the config.toml the trainer writes for ``argv`` (as ``Trainer._write_config``
    renders it: the resolved config)."""
    from titan_core.build import check_job, resolved_config
    from titan_core.config.schema import to_toml
    from titan_core.resolve import parse_args

    cfg = parse_args(argv)
    parallel_dims, _, model_args = check_job(cfg, 1)
    return len(to_toml(resolved_config(cfg, parallel_dims, model_args)).encode())


def test_metrics_jsonl_filling_mid_run_is_one_line_and_keeps_whole_lines(
    disk: Disk, tmp_path: Path, assets: Path
) -> None:
    """Room for config.toml and one more page: metrics.jsonl (a line of ~400 bytes per step)
    fills within 40 steps. One line naming it, exit 2 (not 1: not worth a relaunch), and what
    stays of metrics.jsonl is whole lines of the first steps; no temp file."""
    steps = 40
    sized = _config_bytes([*RUN, "--job.dump_folder", str(tmp_path / "run")])
    # + 512 bytes for the longer path of the dump folder on the disk: at most one page more
    # for metrics.jsonl, ~20 lines, still fewer than the steps
    files = disk("64k", free=PAGE * (_pages(sized + 512) + 1))
    dump = files / "run"
    argv = [*RUN, "--training.steps", str(steps), "--job.dump_folder", str(dump)]
    line = one_line(titan("train", *argv, cwd=tmp_path))
    assert line == f"error: {dump}/metrics.jsonl: {FULL}"
    tomllib.loads((dump / "config.toml").read_text())  # written whole before the disk filled
    text = (dump / "metrics.jsonl").read_text()
    assert text.endswith("\n"), text[-200:]  # no half line
    logged = [json.loads(row)["step"] for row in text.splitlines()]
    assert 0 < len(logged) < steps and logged == list(range(1, len(logged) + 1))
    assert files_under(files) == [dump, dump / "config.toml", dump / "metrics.jsonl"]


# --------------------------------------------------------------- each other writer, in-process

Writer = Callable[[Path, pytest.MonkeyPatch], object]


def _preflight_config(folder: Path, _: pytest.MonkeyPatch) -> object:
    from titan_core.pipeline.stages.preflight import run_preflight
    from titan_core.resolve import resolve_job

    job = resolve_job("llama3_debugmodel_tiny", "", {"training.steps": 2})
    return run_preflight(job, str(folder / "run" / "config.toml"))


def _memory_snapshot(folder: Path, _: pytest.MonkeyPatch) -> object:
    import torch

    from titan_core.components.profiling import MemoryProfiler
    from titan_core.config.job import Profiling

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = Profiling(enable_memory_snapshot=True)
    profiler = MemoryProfiler(cfg, str(folder / "run"), 0, torch.device("cpu"), model, optimizer)
    return profiler.step(1, exit_=True)


def _profiler_trace(folder: Path, _: pytest.MonkeyPatch) -> object:
    import torch

    from titan_core.components.profiling import maybe_enable_profiling
    from titan_core.config.job import Profiling

    cfg = Profiling(enable_profiling=True, profile_freq=1, profiler_active=1, profiler_warmup=0)
    with maybe_enable_profiling(cfg, str(folder / "run"), 0, 0) as profiler:
        assert profiler is not None
        torch.ones(3).sum()
        profiler.step()  # the trace of step 1 is exported here
    return None


def _flight_recorder(folder: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    import torch
    import torch.distributed as dist

    from titan_core.distributed import flight_recorder

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "64")  # read when the group is created
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(1))  # one entry to record
        return flight_recorder.dump_trace(str(folder / "run"))
    finally:
        dist.destroy_process_group()


EVAL_REPORT = {
    "report_version": 1, "created": "2025-01-01T00:00:00+00:00",
    "checkpoint": "/ckpt/step-4", "step": 4,
    "model": {"name": "llama3", "flavor": "debugmodel_tiny", "num_params": 393536,
              "vocab_size": 2304, "n_layers": 2, "dim": 64},
    "metrics": {"loss": 7.5, "perplexity": 1808.0, "bits_per_byte": 3.1, "num_tokens": 256,
                "num_bytes": 900, "num_batches": 2},
    "samples": [], "timing": {"eval_seconds": 0.5},
    "config": {"job_description": "x", "dataset": "titan_corpus", "split": "validation",
               "seq_len": 64, "world_size": 1, "device": "cpu"},
}  # fmt: skip


def _eval_report(folder: Path, _: pytest.MonkeyPatch) -> object:
    from titan_core.evaluate.report import write_report

    return write_report(str(folder / "ev"), EVAL_REPORT)


def _model_card(folder: Path, _: pytest.MonkeyPatch) -> object:
    from titan_core.pipeline.stages.model_card import ExportFacts, write_model_card

    facts = ExportFacts(
        run_id="r1", experiment="e", recipe="llama3_debugmodel_tiny", family="llama3",
        flavor="debugmodel_tiny", dataset="titan_corpus", steps=4, tokens=1024, seq_len=64,
        export_url="/hf", export_dtype="bfloat16", checkpoint_url="/ckpt/step-4",
        checkpoint_dtype="float32", eval_compute_dtype="float32", eval_metrics={"loss": 7.5},
    )  # fmt: skip
    return write_model_card(str(folder / "hf"), facts)


def _tracking() -> object:
    from titan_core.pipeline.run.tracking import TrackingContext

    return TrackingContext("sqlite:///unused.db", "e", "1", "parent")


def _run_summary(folder: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    from titan_core.pipeline.stages.publish import Publication, log_run_files

    monkeypatch.setattr(tempfile, "tempdir", str(folder))  # its staging folder on the full disk
    publication = Publication("r1", str(folder / "absent"), "/ckpt", "/hf", "/report.json", "")
    return log_run_files(_tracking(), publication)  # type: ignore[arg-type]


def _compare_plot(folder: Path, _: pytest.MonkeyPatch) -> object:
    from titan_core.pipeline.compare import PLOT_NAME, RunSummary, plot_loss_curves

    run = RunSummary("r1", "a", "FINISHED", loss_curve=[(1, 2.0), (2, 1.5)])
    return plot_loss_curves([run], str(folder / "cmp" / PLOT_NAME), "loss")


TRIALS = (((("optimizer.lr", 1e-3),), 2.0), ((("optimizer.lr", 1e-2),), 1.5))


def _sweep_rows() -> list:
    from titan_core.pipeline.sweep.report import TrialRow

    return [
        TrialRow(i, f"trial-{i}", f"r{i}", "completed", values, metric=metric)
        for i, (values, metric) in enumerate(TRIALS, 1)
    ]


def _sweep_report(folder: Path, _: pytest.MonkeyPatch) -> object:
    from titan_core.pipeline.sweep.plan import SweepPlan, Trial
    from titan_core.pipeline.sweep.tracking import write_report

    plan = SweepPlan(
        sweep_id="s1", recipe="llama3_debugmodel_tiny", config_file="", base=(),
        trials=tuple(Trial(i, values) for i, (values, _) in enumerate(TRIALS, 1)),
        keys=("optimizer.lr",), experiment="e", model_name="m", metric="eval/loss",
        concurrency=1, root=str(folder), pinned=(),
    )  # fmt: skip
    return write_report(str(folder / "sweep"), plan, _sweep_rows(), [], _tracking())  # type: ignore[arg-type]


def _sweep_plot(folder: Path, _: pytest.MonkeyPatch) -> object:
    from titan_core.pipeline.sweep.report import plot_metric_by_key

    path = str(folder / "sweep" / "eval_loss_by_lr.png")
    return plot_metric_by_key(_sweep_rows(), "optimizer.lr", "eval/loss", path)


def _stop_request(folder: Path, _: pytest.MonkeyPatch) -> object:
    from titan_core.stop_request import request_stop

    return request_stop(str(folder / "run"), "enough")


def _stopped_early(folder: Path, _: pytest.MonkeyPatch) -> object:
    from titan_core.stop_request import record_stop

    return record_stop(str(folder / "run"), 8, "enough")


def _slurm_script(folder: Path, _: pytest.MonkeyPatch) -> object:
    from titan_core.launch.slurm import _write_script

    return _write_script(folder / "logs", "#!/bin/bash\nsrun true\n")


def _lighthouse_address(folder: Path, _: pytest.MonkeyPatch) -> object:
    from titan_core.launch.lighthouse import _write_atomically

    return _write_atomically(str(folder / "lh" / "lighthouse.env"), "A=b\n")


# (writer, bytes left free, the file its one line names, relative to the folder, as a regex).
# Zero free bytes: the first page of the first file fails. The eval report: one page, so that
# report.json fits and report.md does not (the pair, or neither).
WRITERS: list = [
    pytest.param(_preflight_config, 0, r"run/config\.toml", id="preflight-config"),
    pytest.param(
        _memory_snapshot,
        0,
        r"run/memory_snapshot/iteration_1_exit/rank0_memory_report\.json",
        id="memory-snapshot",
    ),
    pytest.param(
        _profiler_trace,
        0,
        r"run/profile_traces/iteration_1/rank0_trace\.json",
        id="profiler-trace",
    ),
    pytest.param(_flight_recorder, 0, r"run/comm_traces/rank_0", id="flight-recorder"),
    pytest.param(_eval_report, PAGE, r"ev/eval/report\.md", id="eval-report"),
    pytest.param(_model_card, 0, r"hf/README\.md", id="model-card"),
    pytest.param(_run_summary, 0, r"titan-publish-[^/]+/summary\.md", id="run-summary"),
    pytest.param(_compare_plot, 0, r"cmp/loss_curves\.png", id="compare-report"),
    pytest.param(_sweep_report, 0, r"sweep/loss_curves\.png", id="sweep-report"),
    pytest.param(_sweep_plot, 0, r"sweep/eval_loss_by_lr\.png", id="sweep-plot"),
    pytest.param(_stop_request, 0, r"run/stop-requested", id="stop-request"),
    pytest.param(_stopped_early, 0, r"run/stopped-early", id="stopped-early"),
    pytest.param(_slurm_script, 0, r"logs/sbatch-\d{8}-\d{6}-[0-9a-f]{8}\.sh", id="slurm-script"),
    pytest.param(_lighthouse_address, 0, r"lh/lighthouse\.env", id="lighthouse-address"),
]


@pytest.mark.parametrize("write, free, names", WRITERS)
def test_each_writer_on_a_full_disk_is_one_line_and_leaves_nothing(
    write: Writer, free: int, names: str, disk: Disk, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real writer into folders it must make on a full disk: one ``StorageError`` line
    naming its file and the full disk; no file, temp file or folder of it stays."""
    files = disk("64k", free=free)
    with pytest.raises(StorageError) as info:
        write(files, monkeypatch)
    assert re.fullmatch(f"{re.escape(str(files))}/{names}: {FULL}", str(info.value)), info.value
    assert files_under(files) == []


def _jsonl_sink(path: Path) -> Callable[[int], None]:
    from titan_core.components.metrics import JsonlSink

    sink = JsonlSink(str(path))
    return lambda step: sink.log(step, {"loss": 7.5, "note": "x" * 200})


def _health_rows(path: Path) -> Callable[[int], None]:
    import torch

    from titan_core.components.health import HealthGuard
    from titan_core.config.job import Health

    guard = HealthGuard(
        Health(), device=torch.device("cpu"), rank=0, world_size=1, loss_scale=1.0,
        min_history=0, folder=str(path.parent), is_rank0=True,
    )  # fmt: skip
    line = "health: rolled back to step 4 " + "x" * 200
    return lambda step: guard.record_rollback(line, step, 4, (0, 16))


@pytest.mark.parametrize(
    "writer, name",
    [(_jsonl_sink, "metrics.jsonl"), (_health_rows, "health.jsonl")],
    ids=["metrics-jsonl", "health-jsonl"],
)
def test_an_append_file_filling_up_keeps_whole_lines(
    writer: Callable[[Path], Callable[[int], None]], name: str, disk: Disk
) -> None:
    """One free page: rows land until one does not fit. That one is one line naming the file,
    and the file keeps the rows before it, whole. On the now full disk a new log's first row
    fails too, and its empty file and the folder it made are removed."""
    files = disk("64k", free=PAGE)
    path = files / "run" / name
    write = writer(path)
    step = 0
    with pytest.raises(StorageError) as info:
        for step in range(1, 100):  # ~250 bytes a row: the page holds about 16
            write(step)
    assert str(info.value) == f"{path}: {FULL}"
    text = path.read_text()
    assert text.endswith("\n") and len(text) <= PAGE
    assert [json.loads(row)["step"] for row in text.splitlines()] == list(range(1, step))
    assert files_under(files) == [path.parent, path]  # no temp file
    again = files / "again" / name
    with pytest.raises(StorageError, match=f"^{re.escape(str(again))}: {FULL}$"):
        writer(again)(1)
    assert files_under(files) == [path.parent, path]


# ---------------------------------------------------------------------- the CLI's error path


def test_a_storage_error_is_one_line_and_exit_code_2_through_the_cli(
    disk: Disk, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the writers raise on a full disk reaches the user as ``titan``'s one ``error:``
    line with exit code 2 (bad input: a relaunch would fail the same way), no traceback."""
    files = disk("64k", free=0)
    target = files / "run" / "summary.md"

    def main(argv: list[str]) -> int:
        storage.write_text(str(target), "summary\n")
        return 0

    assert command.run(main, []) == 2
    out, err = capsys.readouterr()
    assert err == f"error: {target}: {FULL}\n" and out == ""
    assert files_under(files) == []
