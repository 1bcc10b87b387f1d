"""End-to-end training: resume determinism, checkpoint commit semantics, seed checkpoints,
metrics, profiling, validation, and bad input rejected before anything is written."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from titan_core.checkpoint.manager import COMMIT_MARKER, FAULT_ENV, complete_steps
from titan_core.resolve import parse_args
from titan_core.train import run

TINY = ["--module", "llama3", "--config", "llama3_debugmodel_tiny"]


def _args(dump: Path, *extra: str) -> list[str]:
    return [
        *TINY,
        "--job.dump_folder",
        str(dump),
        "--training.steps",
        "12",
        "--metrics.log_freq",
        "1",
        "--metrics.cpu_peak_tflops",
        "1",
        "--debug.deterministic",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "4",
        "--checkpoint.keep_latest_k",
        "0",
        "--checkpoint.no_last_save_model_only",
        "--validation.no_enable",
        *extra,
    ]


def _losses(history: list[dict[str, float]]) -> dict[int, float]:
    return {int(h["step"]): h["loss"] for h in history if "loss" in h}


def _train_subprocess(
    argv: list[str], env_extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "titan_core.train", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> dict[int, float]:
    """Losses of an uninterrupted deterministic 12-step run."""
    dump = tmp_path_factory.mktemp("reference")
    return _losses(run(parse_args(_args(dump))))


@pytest.mark.torch_range
def test_resume_is_bitwise_equal(tmp_path: Path, reference: dict[int, float]) -> None:
    dump = tmp_path / "run"
    first = _losses(run(parse_args(_args(dump, "--training.steps", "12"))))
    assert first == reference  # same seed and config → bitwise-equal losses
    # Resume from step 4 (model, optimizer, scheduler, dataloader, RNG) and train to 12 again.
    resumed = _losses(run(parse_args(_args(dump, "--checkpoint.load_step", "4"))))
    assert sorted(resumed) == list(range(5, 13))
    assert resumed == {s: reference[s] for s in range(5, 13)}


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_async_checkpoint_resume(tmp_path: Path, reference: dict[int, float], mode: str) -> None:
    dump = tmp_path / "run"
    run(parse_args(_args(dump, "--checkpoint.async_mode", mode)))
    assert complete_steps(str(dump / "checkpoint")) == [4, 8, 12]
    resumed = _losses(run(parse_args(_args(dump, "--checkpoint.load_step", "8"))))
    assert resumed == {s: reference[s] for s in range(9, 13)}


def test_kill_during_save_leaves_previous_step(tmp_path: Path, reference: dict[int, float]) -> None:
    dump = tmp_path / "run"
    killed = _train_subprocess(_args(dump), {FAULT_ENV: "8"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    ckpt = dump / "checkpoint"
    assert (ckpt / "step-8" / ".metadata").exists()  # DCP wrote everything but our marker
    assert not (ckpt / "step-8" / COMMIT_MARKER).exists()
    assert complete_steps(str(ckpt)) == [4]
    again = _train_subprocess(_args(dump))
    assert again.returncode == 0, again.stderr[-2000:]
    assert "checkpoint/step-4 (step 4)" in again.stdout
    logged = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    resumed = {r["step"]: r["loss"] for r in logged[-8:]}
    assert resumed == {s: reference[s] for s in range(5, 13)}
    assert complete_steps(str(ckpt)) == [4, 8, 12]


def test_a_native_crash_prints_every_threads_python_stack(tmp_path: Path, assets: Path) -> None:
    """A rank dying in native code (here a SIGSEGV sent once step 2 is logged) leaves the
    Python stacks of its threads in its log, the training loop's among them."""
    argv = [*_args(tmp_path / "run"), "--training.steps", "200"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "titan_core.train", *argv],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if re.search(r"step:\s+2\b", line):
                proc.send_signal(signal.SIGSEGV)
                break
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGSEGV, err[-2000:]
    assert "Fatal Python error: Segmentation fault" in err, err[-2000:]
    # every thread's stack, whichever thread took the signal: the main one runs the loop
    assert "Current thread" in err and 'titan_core/train.py", line' in err, err[-3000:]


def test_keep_latest_k_and_final_model_only(tmp_path: Path, assets: Path) -> None:
    dump = tmp_path / "run"
    run(
        parse_args(
            _args(
                dump,
                "--checkpoint.keep_latest_k",
                "2",
                "--checkpoint.last_save_model_only",
                "--checkpoint.export_dtype",
                "bfloat16",
            )
        )
    )
    assert complete_steps(str(dump / "checkpoint")) == [8, 12]
    marker = json.loads((dump / "checkpoint" / "step-12" / COMMIT_MARKER).read_text())
    assert marker == {**marker, "step": 12, "model_only": True}
    # Training to the same step count again finds the work done.
    assert run(parse_args(_args(dump))) == []


def test_seed_checkpoint_fixes_initial_weights(tmp_path: Path, assets: Path) -> None:
    seed_dump = tmp_path / "seeded"
    run(parse_args(_args(seed_dump, "--checkpoint.create_seed_checkpoint", "--debug.seed", "1")))
    assert (seed_dump / "checkpoint" / "seed" / COMMIT_MARKER).exists()
    assert not (seed_dump / "metrics.jsonl").exists()
    # Runs with different init seeds start from the same (seed-checkpoint) weights: one finds the
    # seed in its own checkpoint folder, the other loads it through initial_load_path.
    from_folder = _losses(
        run(parse_args(_args(seed_dump, "--training.steps", "2", "--debug.seed", "7")))
    )
    from_path = _losses(
        run(
            parse_args(
                [
                    *_args(tmp_path / "b", "--training.steps", "2", "--debug.seed", "9"),
                    "--checkpoint.initial_load_path",
                    str(seed_dump / "checkpoint" / "seed"),
                ]
            )
        )
    )
    fresh = _losses(
        run(parse_args(_args(tmp_path / "c", "--training.steps", "2", "--debug.seed", "9")))
    )
    assert from_folder == from_path
    assert fresh[1] != from_path[1]


def test_metrics_profiling_validation(tmp_path: Path, assets: Path) -> None:
    dump = tmp_path / "run"
    history = run(
        parse_args(
            [
                *TINY,
                "--job.dump_folder",
                str(dump),
                "--training.steps",
                "6",
                "--metrics.log_freq",
                "2",
                "--metrics.enable_tensorboard",
                "--profiling.enable_profiling",
                "--profiling.profile_freq",
                "3",
                "--profiling.profiler_warmup",
                "1",
                "--profiling.enable_memory_snapshot",
                "--validation.enable",
                "--validation.freq",
                "3",
                "--validation.steps",
                "2",
                "--checkpoint.no_enable",
            ]
        )
    )
    logged = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in logged if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 4, 6]
    for key in (
        "loss",
        "grad_norm",
        "lr",
        "tps",
        "tflops",
        "mfu_pct",
        "data_pct",
        "step_time_s",
        "memory/rss_gib",
    ):
        assert all(r[key] >= 0 for r in train_rows), key
    assert train_rows[-1]["tps"] > 0 and train_rows[-1]["mfu_pct"] > 0
    val = [r for r in logged if "validation/loss" in r]
    assert [r["step"] for r in val] == [3, 6] and all(0 < r["validation/loss"] < 20 for r in val)
    assert any(h.get("validation/loss") for h in history)
    assert list((dump / "tb").glob("events.out.tfevents.*"))
    assert (dump / "profile_traces" / "iteration_3" / "rank0_trace.json").stat().st_size > 0
    assert (dump / "profile_traces" / "iteration_6" / "rank0_trace.json").exists()
    report = json.loads(
        (dump / "memory_snapshot" / "iteration_3" / "rank0_memory_report.json").read_text()
    )
    assert report["kind"] == "cpu_memory_report" and report["parameters_mib"] > 0
    assert (dump / "config.toml").read_text().count("[training]") == 1
    # Saved as the ranks ran it: auto values resolved (titan_core.build.resolved_config).
    saved = tomllib.loads((dump / "config.toml").read_text())
    assert saved["parallelism"]["data_parallel_shard_degree"] == 1
    assert saved["model"]["vocab_size"] > 0 and saved["model"]["n_layers"] > 0
    assert saved["validation"]["local_batch_size"] == saved["training"]["local_batch_size"]


def test_gradient_accumulation_matches_bigger_batch(tmp_path: Path, assets: Path) -> None:
    base = [
        *TINY,
        "--training.steps",
        "3",
        "--metrics.log_freq",
        "1",
        "--debug.deterministic",
        "--checkpoint.no_enable",
        "--validation.no_enable",
        "--metrics.cpu_peak_tflops",
        "1",
    ]
    big = _losses(
        run(
            parse_args(
                [
                    *base,
                    "--job.dump_folder",
                    str(tmp_path / "a"),
                    "--training.local_batch_size",
                    "4",
                ]
            )
        )
    )
    acc = _losses(
        run(
            parse_args(
                [
                    *base,
                    "--job.dump_folder",
                    str(tmp_path / "b"),
                    "--training.local_batch_size",
                    "2",
                    "--training.gradient_accumulation_steps",
                    "2",
                ]
            )
        )
    )
    for step in big:
        assert acc[step] == pytest.approx(big[step], rel=1e-5)


@pytest.mark.parametrize(
    "bad, expected",
    [
        (["--tokenizer.path", "/no/such/tokenizer.model"], "tokenizer.path"),
        (["--training.stepz", "3"], "training.stepz"),
        (["--training.steps", "three"], "training.steps"),
        (["--job.config_file", "BROKEN_TOML"], "line"),
        (["--dataloader.dataset", "EMPTY_JSONL"], "empty.jsonl"),
    ],
)
def test_bad_input_one_line_nothing_written(
    tmp_path: Path, assets: Path, bad: list[str], expected: str, capsys: pytest.CaptureFixture
) -> None:
    """The engine's entry point in this process (test_tp runs it as a process: the same one
    line)."""
    from titan_core.train import main

    broken = tmp_path / "broken.toml"
    broken.write_text("[training]\nsteps = = 3\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n{"text": "   "}\n')
    bad = [
        str(broken) if b == "BROKEN_TOML" else str(empty) if b == "EMPTY_JSONL" else b for b in bad
    ]
    dump = tmp_path / "out"
    capsys.readouterr()
    code = main([*TINY, "--job.dump_folder", str(dump), *bad])
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    assert not dump.exists()


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "degrees, applied",
    [([], "Applied FSDP"), (["--parallelism.data_parallel_replicate_degree", "2"], "Applied DDP")],
)
def test_torchrun_data_parallel_two_processes(
    tmp_path: Path, assets: Path, degrees: list[str], applied: str
) -> None:
    dump = tmp_path / "dp"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "titan_core.cli",
            "train",
            "--ngpu",
            "2",
            *TINY,
            "--job.dump_folder",
            str(dump),
            "--training.steps",
            "4",
            "--metrics.log_freq",
            "1",
            "--metrics.cpu_peak_tflops",
            "1",
            "--checkpoint.enable",
            "--checkpoint.interval",
            "2",
            "--validation.no_enable",
            *degrees,
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert applied in proc.stdout
    logged = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in logged)
    assert complete_steps(str(dump / "checkpoint")) == [2, 4]


def _saved_dtype(step_dir: Path, key: str = "model.tok_embeddings.weight") -> torch.dtype:
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata[key].properties.dtype


def test_checkpoint_options(tmp_path: Path, reference: dict[int, float]) -> None:
    # model_weights_only + export_dtype: every save holds bf16 weights and nothing else.
    light = tmp_path / "light"
    run(
        parse_args(
            _args(light, "--checkpoint.model_weights_only", "--checkpoint.export_dtype", "bfloat16")
        )
    )
    for step in (4, 8, 12):
        marker = json.loads((light / "checkpoint" / f"step-{step}" / COMMIT_MARKER).read_text())
        assert marker["model_only"] is True
    assert _saved_dtype(light / "checkpoint" / "step-12") == torch.bfloat16
    full = tmp_path / "full"
    run(parse_args(_args(full)))
    assert _saved_dtype(full / "checkpoint" / "step-12") == torch.float32
    # exclude_from_loading=dataloader: weights and optimizer resume, data starts over.
    restarted = _losses(
        run(
            parse_args(
                _args(
                    full,
                    "--checkpoint.load_step",
                    "4",
                    "--checkpoint.exclude_from_loading",
                    "dataloader",
                    "--training.steps",
                    "6",
                )
            )
        )
    )
    assert restarted[5] != reference[5]
    # load_only: resumes, trains, and saves nothing new.
    before = sorted(p.name for p in (full / "checkpoint").iterdir())
    resumed = _losses(
        run(
            parse_args(
                _args(
                    full,
                    "--checkpoint.load_step",
                    "8",
                    "--checkpoint.load_only",
                    "--training.steps",
                    "10",
                )
            )
        )
    )
    assert sorted(resumed) == [9, 10]
    assert sorted(p.name for p in (full / "checkpoint").iterdir()) == before


def test_bf16_autocast_and_extra_sink(tmp_path: Path, assets: Path) -> None:
    from titan_core.trainer import Trainer

    class Recorder:
        def __init__(self) -> None:
            self.rows: list[tuple[int, dict[str, float]]] = []
            self.closed = False

        def log(self, step: int, metrics: dict[str, float]) -> None:
            self.rows.append((step, metrics))

        def close(self) -> None:
            self.closed = True

    sink = Recorder()
    cfg = parse_args(
        [
            *TINY,
            "--job.dump_folder",
            str(tmp_path),
            "--training.steps",
            "3",
            "--metrics.log_freq",
            "1",
            "--metrics.cpu_peak_tflops",
            "1",
            "--training.autocast_dtype",
            "bfloat16",
            "--checkpoint.no_enable",
            "--validation.no_enable",
        ]
    )
    trainer = Trainer(cfg, extra_sinks=[sink])
    try:
        history = trainer.train()
    finally:
        trainer.close()
    assert [s for s, _ in sink.rows] == [1, 2, 3] and sink.closed
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    assert history[0]["loss"] == pytest.approx(7.7, abs=0.6)  # ~ln(2304): bf16 is still sane


def test_stop_request_ends_training_at_the_next_log_step(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    """A stop saves the full state (not the last step's model-only export, the default) and
    consumes the request into a record; a later run in the folder resumes and trains on,
    bitwise as if never stopped."""
    from titan_core.stop_request import StopRecord, request_stop, stopped_early
    from titan_core.trainer import Trainer

    class StopAt:
        """A sink that asks the job to stop once it has logged ``step``."""

        def __init__(self, step: int) -> None:
            self.step = step

        def log(self, step: int, metrics: dict[str, float]) -> None:
            if step == self.step:
                request_stop(str(tmp_path), "test")

        def close(self) -> None:
            pass

    # Asked at step 4's log; the trainer looks at log steps (every 2): it ends at step 6 of 12.
    model_only_last = ("--checkpoint.last_save_model_only", "--checkpoint.export_dtype", "bfloat16")
    argv = _args(tmp_path, "--metrics.log_freq", "2", "--checkpoint.interval", "5")
    trainer = Trainer(parse_args([*argv, *model_only_last]), extra_sinks=[StopAt(4)])
    try:
        history = trainer.train()
    finally:
        trainer.close()
    assert [int(h["step"]) for h in history] == [1, 2, 4, 6]
    ckpt = tmp_path / "checkpoint"
    assert complete_steps(str(ckpt)) == [5, 6]  # 6: the stop's save
    assert json.loads((ckpt / "step-6" / COMMIT_MARKER).read_text())["model_only"] is False
    assert _saved_dtype(ckpt / "step-6") == torch.float32
    assert stopped_early(str(tmp_path)) == StopRecord(6, "test")
    assert not (tmp_path / "stop-requested").exists()
    resumed = _losses(run(parse_args(_args(tmp_path, *model_only_last))))
    assert resumed == {s: reference[s] for s in range(7, 13)}


def test_an_unreadable_stop_request_is_no_request(
    tmp_path: Path, assets: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A storage error while looking for the request is logged once and the job trains on."""
    from titan_core.logging import logger

    (tmp_path / "stop-requested").mkdir()  # exists, cannot be read as a file
    logger.addHandler(caplog.handler)
    try:
        argv = _args(tmp_path, "--training.steps", "4", "--checkpoint.no_enable")
        history = run(parse_args(argv))
    finally:
        logger.removeHandler(caplog.handler)
    assert [int(h["step"]) for h in history] == [1, 2, 3, 4]
    failed = [r for r in caplog.records if "pending_stop failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].levelname == "WARNING", caplog.text


def test_a_stop_request_after_the_last_log_step_is_dropped(
    tmp_path: Path, assets: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A request that comes after the job's last look (log step 2 of 4) does not stop it: the
    job completes, deletes the request and leaves no record, so a later run trains on; the
    train task does the same with one that came while the job was saving and exiting."""
    from titan_core.logging import logger
    from titan_core.pipeline.stages.training import discard_late_stop
    from titan_core.stop_request import request_stop, stopped_early
    from titan_core.trainer import Trainer

    class StopAtEnd:
        """A sink that asks the job to stop when it logs its last step."""

        def log(self, step: int, metrics: dict[str, float]) -> None:
            if step == 4:
                request_stop(str(tmp_path), "too late")

        def close(self) -> None:
            pass

    argv = _args(tmp_path, "--training.steps", "4", "--metrics.log_freq", "2")
    logger.addHandler(caplog.handler)
    try:
        trainer = Trainer(parse_args([*argv, "--checkpoint.no_enable"]), [StopAtEnd()])
        try:
            history = trainer.train()
        finally:
            trainer.close()
        assert [int(h["step"]) for h in history] == [1, 2, 4]
        assert not (tmp_path / "stop-requested").exists() and stopped_early(str(tmp_path)) is None
        assert "a stop request came after the last log step" in caplog.text
        request_stop(str(tmp_path), "later still")
        discard_late_stop(str(tmp_path))
        assert not (tmp_path / "stop-requested").exists() and stopped_early(str(tmp_path)) is None
        assert "A stop request came after training's last log step: discarded" in caplog.text
    finally:
        logger.removeHandler(caplog.handler)


@pytest.mark.multiprocess
def test_stop_request_stops_every_rank_of_a_torchrun_job(tmp_path: Path, assets: Path) -> None:
    from titan_core.stop_request import StopRecord, request_stop, stopped_early

    dump = tmp_path / "dp"
    request_stop(str(dump))  # before the start: rank 0 sees it at the first log step (1)
    argv = ["-m", "titan_core.cli", "train", "--ngpu", "2", *_args(dump, "--metrics.log_freq", "3")]
    proc = subprocess.run(
        [sys.executable, *argv],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "stopped early at step 1 (stop requested)" in proc.stdout
    # Rank 1 got rank 0's answer: both left the loop and wrote the final checkpoint together.
    assert complete_steps(str(dump / "checkpoint")) == [1]
    assert stopped_early(str(dump)) == StopRecord(1, "stop requested")
    logged = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1]


def test_mfu_divides_by_the_cpus_peak_and_stays_under_100(tmp_path: Path) -> None:
    """No configured peak: the CPU's theoretical one, said at the start; every logged MFU
    is a share of it (<= 100%)."""
    argv = [*TINY, "--job.dump_folder", str(tmp_path), "--training.steps", "4",
            "--metrics.log_freq", "1", "--validation.no_enable"]  # fmt: skip
    proc = _train_subprocess(argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(
        r"MFU divides by a peak of [\d.]+ TFLOP/s per rank \(1 core x [\d.]+ GHz x \d+ FLOP/cycle",
        proc.stdout + proc.stderr,
    )
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(0 < r["mfu_pct"] <= 100 for r in rows if "mfu_pct" in r), rows
    assert "is above 100%" not in proc.stdout + proc.stderr


def test_saved_config_names_local_data_by_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, assets: Path
) -> None:
    """A relative dataset path is saved absolute, so the run's config.toml reads the same data
    from any directory (evaluating from elsewhere took it for a Hugging Face dataset); names,
    URLs and paths that do not exist here stay as given."""
    from titan_core.build import resolve_auto

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "docs.jsonl").write_text('{"text": "hello world"}\n' * 50)
    values = ["--dataloader.dataset", "data/docs.jsonl", "--validation.dataset", "titan_corpus"]
    values += ["--data.sources", "data", "hf:org/name?split=train"]
    cfg = resolve_auto(parse_args([*TINY, *values]), 1)
    assert cfg.dataloader.dataset == str(tmp_path / "data" / "docs.jsonl")
    assert cfg.validation.dataset == "titan_corpus"
    assert cfg.data.sources == [str(tmp_path / "data"), "hf:org/name?split=train"]
    assert resolve_auto(cfg, 1) == cfg  # saving the saved config again changes nothing
