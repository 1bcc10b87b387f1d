"""The step guard (``[health]``): non-finite values and spikes found on every rank, the update
skipped on the device or the run stopped, incidents reported, checkpoints kept healthy.

Faults come from ``debug.inject`` drills (with ``debug.drill``), as docs/health.md describes.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import checkpoint_tensors, process_env
from parallel_harness import MODEL, QWEN3_MOE_MODEL, launch_job

from titan_core.checkpoint.manager import COMMIT_MARKER, complete_steps
from titan_core.components.health import CAPACITY, HealthGuard, HealthStop
from titan_core.config.job import Health
from titan_core.resolve import parse_args
from titan_core.train import run

TINY = ["--module", "llama3", "--config", "llama3_debugmodel_tiny"]


def _guard(tmp_path: Path, **cfg: object) -> HealthGuard:
    return HealthGuard(
        Health(**cfg),  # type: ignore[arg-type]
        device=torch.device("cpu"),
        rank=0,
        world_size=1,
        loss_scale=1.0,
        min_history=0,
        folder=str(tmp_path),
        is_rank0=True,
    )


def _steady(guard: HealthGuard, steps: range) -> None:
    """Healthy steps with a little noise around loss 3 and grad norm 1."""
    g = torch.Generator().manual_seed(0)
    for step in steps:
        noise = torch.randn(2, generator=g) * 0.01
        found_inf, _ = guard.check(step, 3.0 + noise[0], 1.0 + noise[1])
        assert found_inf.item() == 0.0, step


# ------------------------------------------------------------------ the guard itself
CURVES = Path(__file__).parent / "data" / "health_curves.json"


@pytest.mark.parametrize("run", ["demo", "llama3_debugmodel_300"])
def test_normal_training_curves_raise_no_incident(tmp_path: Path, run: str) -> None:
    """Every step of real runs (the demo's 100 steps on 2 ranks; the debug recipe for 300
    steps), as their guards saw them, under the default policy: not one incident. The curves
    and how they were recorded are in the data file; their runs' health.jsonl were empty."""
    curve = json.loads(CURVES.read_text())[run]
    guard = HealthGuard(
        Health(), device=torch.device("cpu"), rank=0, world_size=1, loss_scale=1.0,
        min_history=curve["warmup_steps"], folder=str(tmp_path), is_rank0=True,
    )  # fmt: skip
    checked = 0
    for step, (loss, grad_norm) in enumerate(zip(curve["loss"], curve["grad_norm"], strict=True)):
        guard.check(step + 1, torch.tensor(loss), torch.tensor(grad_norm))
        if guard.full or step + 1 == len(curve["loss"]):
            assert guard.flush() == [], run
        checked += step + 1 > max(curve["warmup_steps"], Health().spike_window)
    assert len(curve["loss"]) == curve["steps"] and guard.counts.incidents == 0
    assert checked == max(curve["steps"] - Health().spike_window, 0)  # spikes looked for there


def test_nonfinite_loss_and_grad_norm_are_skipped_and_reported(tmp_path: Path) -> None:
    guard = _guard(tmp_path)
    _steady(guard, range(1, 4))
    assert guard.check(4, torch.tensor(math.nan), torch.tensor(1.0))[0].item() == 1.0
    assert guard.check(5, torch.tensor(2.9), torch.tensor(math.inf))[0].item() == 1.0
    assert guard.check(6, torch.tensor(2.9), torch.tensor(1.0))[0].item() == 0.0
    incidents = guard.flush()
    assert [(i.step, i.quantity, i.kind, i.action) for i in incidents] == [
        (4, "loss", "nonfinite", "skip"),
        (5, "grad_norm", "nonfinite", "skip"),
    ]
    assert incidents[0].ranks == [0] and incidents[1].ranks is None
    rows = [json.loads(line) for line in (tmp_path / "health.jsonl").read_text().splitlines()]
    assert rows[0] == {"step": 4, "quantity": "loss", "kind": "nonfinite", "value": "nan",
                       "action": "skip", "ranks": [0]}  # fmt: skip
    assert rows[1]["value"] == "inf" and rows[1]["ranks"] == "all"
    assert guard.metrics() == {
        "health/incidents": 2.0, "health/skipped_steps": 2.0, "health/rollbacks": 0.0,
    }  # fmt: skip


def test_a_spike_is_found_once_the_window_is_full_and_never_before(tmp_path: Path) -> None:
    guard = _guard(tmp_path, spike_window=16, spike_threshold=6.0)
    # A jump before the window is full is not judged: the statistics are not there yet.
    _steady(guard, range(1, 10))
    assert guard.check(10, torch.tensor(30.0), torch.tensor(1.0))[0].item() == 0.0
    assert guard.flush() == []
    guard = _guard(tmp_path, spike_window=16, spike_threshold=6.0)
    _steady(guard, range(1, 17))
    assert guard.check(17, torch.tensor(3.5), torch.tensor(1.0))[0].item() == 1.0  # loss spike
    assert guard.check(18, torch.tensor(3.0), torch.tensor(9.0))[0].item() == 1.0  # grad spike
    assert guard.check(19, torch.tensor(2.99), torch.tensor(1.0))[0].item() == 0.0
    incidents = guard.flush()
    assert [(i.step, i.quantity, i.kind) for i in incidents] == [
        (17, "loss", "spike"),
        (18, "grad_norm", "spike"),
    ]
    assert incidents[0].mean == pytest.approx(3.0, abs=0.02) and incidents[0].std < 0.05
    assert "spike loss 3.5" in incidents[0].line() and "-> skip" in incidents[0].line()


def test_a_stop_verdict_latches_until_the_host_reads_it(tmp_path: Path) -> None:
    guard = _guard(tmp_path, nonfinite="stop")
    _steady(guard, range(1, 3))
    assert guard.check(3, torch.tensor(math.inf), torch.tensor(1.0))[0].item() == 1.0
    # Healthy again, but the run is stopping: nothing after the anomaly is applied.
    assert guard.check(4, torch.tensor(3.0), torch.tensor(1.0))[0].item() == 1.0
    with pytest.raises(HealthStop, match=r"^health: step 3: nonfinite loss inf on rank 0; "
                       r"health.nonfinite = stop: stopped before applying it$"):  # fmt: skip
        guard.flush()
    assert HealthStop.exit_code == 4


def test_anomalies_that_persist_stop_the_run(tmp_path: Path) -> None:
    guard = _guard(tmp_path, max_consecutive=3)
    _steady(guard, range(1, 3))
    for step in (3, 4):
        guard.check(step, torch.tensor(math.nan), torch.tensor(1.0))
    guard.check(5, torch.tensor(3.0), torch.tensor(1.0))  # a healthy step resets the count
    for step in (6, 7, 8):
        guard.check(step, torch.tensor(3.0), torch.tensor(math.nan))
    with pytest.raises(HealthStop, match=r"3 anomalous steps in a row"):
        guard.flush()
    # Each row says what was done: the steps before were skipped, the last one stopped the run.
    rows = [json.loads(line) for line in (tmp_path / "health.jsonl").read_text().splitlines()]
    assert [(r["step"], r["action"]) for r in rows] == [
        (3, "skip"), (4, "skip"), (6, "skip"), (7, "skip"), (8, "stop"),
    ]  # fmt: skip


@contextlib.contextmanager
def _host_reads() -> Iterator[list[str]]:
    """Record every way a tensor's value can reach the host (each one a device sync on a GPU)."""
    seen: list[str] = []
    names = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")
    saved = {name: getattr(torch.Tensor, name) for name in names}

    def spy(name: str) -> object:
        def read(self: torch.Tensor, *args: object, **kwargs: object) -> object:
            seen.append(name)
            return saved[name](self, *args, **kwargs)

        return read

    for name in names:
        setattr(torch.Tensor, name, spy(name))
    try:
        yield seen
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def test_the_guard_and_a_skipped_update_read_nothing_on_the_host(tmp_path: Path) -> None:
    """A non-log step: the verdict goes from the guard to the fused optimizer on the device."""
    guard = _guard(tmp_path, spike_window=4)
    param = torch.nn.Parameter(torch.randn(8))
    optimizer = torch.optim.AdamW([param], lr=0.1, fused=True)
    _steady(guard, range(1, 6))
    healthy = torch.randn(8)
    for step, grad in ((6, healthy / healthy.norm()), (7, torch.full((8,), math.nan))):
        param.grad = grad
        with _host_reads() as seen:
            found_inf, _ = guard.check(step, torch.tensor(3.0), param.grad.norm())
            optimizer.found_inf = found_inf
            optimizer.step()
        assert seen == [], f"step {step}: host reads {seen}"
    assert optimizer.state[param]["step"].item() == 1.0  # step 7's update was not applied
    assert len(guard.flush()) == 1 and CAPACITY >= 10


def test_a_whole_training_step_reads_nothing_on_the_host(tmp_path: Path, assets: Path) -> None:
    """The real step (forward, backward, clipping, the guard, the fused update), a NaN one
    included: nothing reaches the host between log steps."""
    from titan_core.trainer import Trainer

    argv = [*TINY, "--job.dump_folder", str(tmp_path), "--checkpoint.no_enable",
            "--validation.no_enable", "--debug.drill", "--debug.inject", "nan_grad:2"]  # fmt: skip
    trainer = Trainer(parse_args(argv))
    try:
        data = iter(trainer.dataloader)
        for step in (1, 2, 3):
            batches = [next(data)]
            with _host_reads() as seen:
                trainer.train_step(batches, step)
            assert seen == [], f"step {step}: host reads {seen}"
        assert trainer.guard is not None and len(trainer.guard.flush()) == 1
    finally:
        trainer.close()


# ------------------------------------------------------------------ in a training run
def _args(dump: Path, *extra: str) -> list[str]:
    return [
        *TINY,
        "--job.dump_folder", str(dump), "--training.steps", "6", "--metrics.log_freq", "1",
        "--metrics.cpu_peak_tflops", "1", "--debug.deterministic", "--validation.no_enable",
        "--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0",
        "--checkpoint.no_last_save_model_only", *extra,
    ]  # fmt: skip


def _marker(step_dir: Path) -> dict:
    return json.loads((step_dir / COMMIT_MARKER).read_text())


def test_a_skipped_step_leaves_weights_and_optimizer_bitwise_as_before(
    tmp_path: Path, assets: Path
) -> None:
    history = run(parse_args(_args(tmp_path, "--debug.inject", "nan_grad:4", "--debug.drill")))
    before, skipped, after = (
        checkpoint_tensors(tmp_path / "checkpoint" / f"step-{s}") for s in (3, 4, 5)
    )
    assert before.keys() == skipped.keys() and any(".step" in k for k in before)
    for key in before:
        assert torch.equal(before[key], skipped[key]), key  # moments and step counters included
    assert not torch.equal(before["model.norm.weight"], after["model.norm.weight"])
    rows = {int(r["step"]): r for r in history}
    assert math.isnan(rows[4]["grad_norm"]) and math.isfinite(rows[6]["loss"])
    assert rows[6]["health/skipped_steps"] == 1.0 and rows[3]["health/incidents"] == 0.0
    assert _marker(tmp_path / "checkpoint" / "step-4")["health"] == {
        "healthy": True, "guard": True, "incidents": 1, "skipped_steps": 1, "rollbacks": 0,
    }  # fmt: skip
    incident = json.loads((tmp_path / "health.jsonl").read_text())
    assert incident["step"] == 4 and incident["quantity"] == "grad_norm"


def test_stop_keeps_the_newest_healthy_checkpoint_and_saves_nothing_after(
    tmp_path: Path, assets: Path
) -> None:
    extra = ["--debug.inject", "nan_loss:5", "--debug.drill", "--health.nonfinite", "stop"]
    extra += ["--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2"]
    with pytest.raises(HealthStop) as stop:
        run(parse_args(_args(tmp_path, *extra)))
    assert str(stop.value) == (
        "health: step 5: nonfinite loss nan on rank 0; health.nonfinite = stop: stopped before "
        f"applying it; newest checkpoint (healthy): {tmp_path}/checkpoint/step-4"
    )
    assert complete_steps(str(tmp_path / "checkpoint")) == [2, 4]
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-2", "step-4"]
    # The healthy checkpoint resumes: the same run without the drill finishes from it.
    history = run(parse_args(_args(tmp_path, "--checkpoint.interval", "2",
                                   "--checkpoint.keep_latest_k", "2")))  # fmt: skip
    assert [int(r["step"]) for r in history] == [5, 6]


def test_the_nan_run_of_the_issue_stops_with_code_4_and_keeps_a_healthy_checkpoint(
    tmp_path: Path, assets: Path
) -> None:
    """lr 1e6: the loss goes NaN from step 3 on. It used to run to the end, exit 0 and keep
    only checkpoints saved after the weights went bad."""
    argv = [*TINY, "--training.steps", "12", "--optimizer.lr", "1e6", "--checkpoint.enable",
            "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "2",
            "--job.dump_folder", str(tmp_path), "--metrics.cpu_peak_tflops", "1"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "titan_core.cli", "train", *argv],
        env=process_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 4, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "anomalous steps in a row" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    steps = complete_steps(str(tmp_path / "checkpoint"))
    assert steps and all(
        _marker(tmp_path / "checkpoint" / f"step-{s}")["health"]["healthy"] for s in steps
    )
    newest = f"newest checkpoint (healthy): {tmp_path}/checkpoint/step-{steps[-1]}"
    assert errors[0].endswith(newest)


def test_without_the_guard_nonfinite_weights_are_marked_and_never_exported(
    tmp_path: Path, assets: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from titan_core.cli import main

    run(parse_args(_args(tmp_path, "--health.no_enable", "--optimizer.lr", "1e6",
                         "--checkpoint.interval", "3")))  # fmt: skip
    step_dir = tmp_path / "checkpoint" / "step-6"
    assert _marker(step_dir)["health"] == {"healthy": False, "guard": False}
    capsys.readouterr()
    out = tmp_path / "hf"
    argv = ["convert", "dcp-to-hf", "--checkpoint", str(step_dir), "--output", str(out), *TINY]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: checkpoint: {step_dir} holds non-finite weights (its commit marker says healthy: "
        "false; it was saved with health.enable off); use an earlier checkpoint\n"
    )
    assert not out.exists()
    assert main(["eval", "--checkpoint", str(step_dir)]) == 2
    assert "--checkpoint: " in capsys.readouterr().err


def test_a_line_never_continues_from_an_unhealthy_checkpoint(tmp_path: Path) -> None:
    """The nightly retrain picks the newest checkpoint of its line: never one marked unhealthy."""
    from titan_core.pipeline.stages.model_line import complete_checkpoints

    for step, healthy in ((2, True), (4, False)):
        step_dir = tmp_path / "checkpoint" / f"step-{step}"
        step_dir.mkdir(parents=True)
        marker = {"step": step, "model_only": False, "health": {"healthy": healthy}}
        (step_dir / COMMIT_MARKER).write_text(json.dumps(marker))
    assert [c.step for c in complete_checkpoints(str(tmp_path))] == [2]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--health.nonfinite", "retry"], "--health.nonfinite: expected one of 'stop', 'skip'"),
        (["--health.spike_window", "0"], "health.spike_window: expected an int > 1, got 0"),
        (["--health.spike_threshold", "0"], "health.spike_threshold: expected a finite number"),
        (["--health.max_consecutive", "0"], "health.max_consecutive: expected an int > 0"),
        (["--debug.inject", "nan_loss:3"], "debug.inject: expected debug.drill on as well"),
        (["--debug.inject", "nan:3", "--debug.drill"], "debug.inject: expected KIND:STEP[:RANK]"),
        (
            ["--debug.inject", "nan_loss:21", "--debug.drill"],  # the recipe trains 20 steps
            "debug.inject: nan_loss:21:0: step 21 is past the last step (training.steps = 20): it",
        ),
        (
            ["--debug.inject", "nan_loss:3:2", "--debug.drill"],
            "debug.inject: nan_loss:3:2 names rank 2, but the job has ranks 0..0",
        ),
        (["--health.straggler_factor", "1"], "health.straggler_factor: expected 0 (off) or a"),
        (["--health.sdc_every", "-1"], "health.sdc_every: expected an int >= 0 (0: off)"),
        (["--health.sdc", "ignore"], "--health.sdc: expected one of 'stop', 'skip'"),
        (
            ["--debug.inject", "slow_rank:3", "--debug.drill"],
            "debug.inject: slow_rank:3:0: a slow rank is found by comparing ranks: it needs a job",
        ),
        (
            ["--debug.inject", "bitflip:3", "--debug.drill", "--health.sdc_every", "2"],
            "debug.inject: bitflip:3:0: step 3 is not checked",
        ),
    ],
)
def test_bad_health_settings_are_one_line_before_anything_is_written(
    tmp_path: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from titan_core.cli import main

    dump = tmp_path / "run"
    assert main(["train", *TINY, "--job.dump_folder", str(dump), *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not dump.exists()


# ------------------------------------------------------------------ every mesh dimension
def _launch_args(dump: Path, model: list[str], *extra: str, stragglers: bool = False) -> list[str]:
    """A short 2-rank drill. Straggler detection is off unless asked for: on a loaded 2-core
    machine a rank may really be slower for a while, and its row is not what these tests read."""
    return [
        *model,
        "--job.dump_folder", str(dump), "--training.steps", "4", "--training.seq_len", "32",
        "--training.local_batch_size", "2", "--metrics.log_freq", "1",
        "--metrics.cpu_peak_tflops", "1", "--validation.no_enable", "--debug.drill",
        "--health.straggler_factor", "1.5" if stragglers else "0", *extra,
    ]  # fmt: skip


@pytest.mark.multiprocess
def test_fsdp_stop_names_the_rank_and_is_not_relaunched(tmp_path: Path) -> None:
    from titan_core.launch import LaunchError

    args = _launch_args(tmp_path, MODEL, "--debug.inject", "nan_loss:3:1",
                        "--health.nonfinite", "stop", "--checkpoint.enable",
                        "--checkpoint.interval", "2")  # fmt: skip
    with pytest.raises(AssertionError) as failed:
        launch_job(args, tmp_path, backend="local", nproc_per_node=2)
    first = str(failed.value).splitlines()[0]
    assert first.startswith("training: stopped by the health guard: health: step 3: nonfinite loss")
    assert "on rank 1;" in first
    assert LaunchError  # the launcher's error, relayed by launch_job as the assertion's first line
    assert complete_steps(str(tmp_path / "checkpoint")) == [2]
    row = json.loads((tmp_path / "health.jsonl").read_text())
    assert (row["step"], row["ranks"], row["action"]) == (3, [1], "stop")


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("layout", "model", "inject", "quantity", "ranks"),
    [
        ("tp", MODEL, "nan_loss:2:1", "loss", [1]),
        ("pp", MODEL, "nan_grad:2:0", "grad_norm", "all"),
        ("ep", QWEN3_MOE_MODEL, "grad_spike:3:1", "grad_norm", "all"),
    ],
)
def test_an_anomaly_on_one_rank_is_seen_by_every_rank(
    tmp_path: Path, layout: str, model: list[str], inject: str, quantity: str, ranks: object
) -> None:
    """A fault on one TP rank, one pipeline stage or one expert-parallel rank: every rank skips
    the same update, and the run goes on to the end."""
    degree = {"tp": "tensor_parallel_degree", "pp": "pipeline_parallel_degree",
              "ep": "expert_parallel_degree"}[layout]  # fmt: skip
    extra = ["--debug.inject", inject, f"--parallelism.{degree}", "2"]
    if layout == "ep":  # a spike needs a (tiny) window of history first
        extra += ["--health.spike_window", "2", "--lr_scheduler.warmup_steps", "1"]
    out = launch_job(_launch_args(tmp_path, model, *extra), tmp_path, backend="local",
                     nproc_per_node=2)  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "health.jsonl").read_text().splitlines()]
    step = int(inject.split(":")[1])
    assert [(r["step"], r["quantity"], r["ranks"], r["action"]) for r in rows] == [
        (step, quantity, ranks, "skip")
    ]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [int(m["step"]) for m in metrics] == [1, 2, 3, 4]
    assert metrics[-1]["health/skipped_steps"] == 1.0
    assert out.count(f"health: step {step}:") == 1  # one line, from rank 0


# ------------------------------------------------------------------ stragglers, corruption
@pytest.mark.multiprocess
def test_a_slow_rank_is_named_within_two_log_intervals(tmp_path: Path) -> None:
    """Rank 1 computes 3x as long from step 5 on: it is named at a log step within two log
    intervals, in a console line, a health.jsonl row and the metrics; rank 0 never is."""
    args = [*_launch_args(tmp_path, MODEL, "--debug.inject", "slow_rank:5:1", stragglers=True),
            "--training.steps", "12", "--metrics.log_freq", "4"]  # fmt: skip
    out = launch_job(args, tmp_path, backend="local", nproc_per_node=2)
    rows = [json.loads(line) for line in (tmp_path / "health.jsonl").read_text().splitlines()]
    assert rows and all(r["kind"] == "straggler" for r in rows), rows
    assert {tuple(r["ranks"]) for r in rows} == {(1,)}, rows
    first = rows[0]
    assert 5 <= first["step"] <= 5 + 2 * 4 and first["quantity"] == "compute", first
    assert first["value"] > 1.5 * first["median"]
    assert set(first["timings"]) == {"data_wait", "collective_wait", "compute"}
    assert f"health: step {first['step']}: straggler rank 1: compute" in out
    metrics = {
        int(m["step"]): m
        for m in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
    }
    assert metrics[first["step"]]["health/slowest_rank"] == 1.0
    assert metrics[first["step"]]["health/slowest_factor"] > 1.5
    assert metrics[12]["health/stragglers"] >= 1.0
    assert metrics[12]["health/incidents"] == 0.0  # reported, not an anomaly of the update


@pytest.mark.multiprocess
@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_a_flipped_bit_is_found_by_the_recompute_on_its_rank(tmp_path: Path, policy: str) -> None:
    """A bit flipped in rank 1's working copy of a weight during step 4's forward: the
    recompute of step 4 differs on rank 1 (and on no checked step without a flip), and the
    policy acts: stop (exit 4, one line naming rank 1) or skip (the run goes on)."""
    args = [*_launch_args(tmp_path, MODEL, "--debug.inject", "bitflip:4:1",
                          "--health.sdc_every", "2", "--health.sdc", policy),
            "--training.steps", "8"]  # fmt: skip
    if policy == "stop":
        with pytest.raises(AssertionError) as failed:
            launch_job(args, tmp_path, backend="local", nproc_per_node=2)
        first = str(failed.value).splitlines()[0]
        assert first.startswith("training: stopped by the health guard: health: step 4: sdc ")
        assert "recompute differs (loss and gradients, relative" in first and "on rank 1;" in first
        assert "health.sdc = stop: stopped before applying it" in first
    else:
        launch_job(args, tmp_path, backend="local", nproc_per_node=2)
    rows = [json.loads(line) for line in (tmp_path / "health.jsonl").read_text().splitlines()]
    assert [(r["step"], r["kind"], r["ranks"], r["action"]) for r in rows] == [
        (4, "sdc", [1], policy)
    ]
    assert rows[0]["differs"] == "loss and gradients" and rows[0]["value"] > 0


def test_the_recompute_verdict_tells_noise_from_a_fault() -> None:
    """Exact on CPU (any difference counts), a relative tolerance elsewhere; two non-finite
    results agree, one non-finite result does not."""
    from titan_core.components.health import SDC_RTOL, recompute_verdict

    def verdict(a: float, b: float, exact: bool) -> list[float]:
        loss = (torch.tensor(a), torch.tensor(b))
        grads = (torch.tensor([1.0, 2.0], dtype=torch.float64),) * 2
        return recompute_verdict((loss[0], grads[0]), (loss[1], grads[1]), exact).tolist()

    assert verdict(2.0, 2.0, exact=True) == [0.0, 0.0, 0.0, 0.0]
    assert verdict(2.0, 2.0 + 2e-7, exact=True)[:2] == [1.0, 0.0]
    assert verdict(2.0, 2.0 * (1 + SDC_RTOL / 2), exact=False)[:2] == [0.0, 0.0]
    assert verdict(2.0, 2.5, exact=False)[0] == 1.0
    assert verdict(math.nan, math.nan, exact=True)[:2] == [0.0, 0.0]
    assert verdict(math.nan, 2.0, exact=False)[0] == 1.0


# ------------------------------------------------------------------ rollback
@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> str:
    from prepared_helpers import prepare_corpus

    from titan_core.data import Tokenizer, bundled_corpus_dir, default_tokenizer_path

    url = str(tmp_path_factory.mktemp("prepared") / "corpus")
    return prepare_corpus(url, Tokenizer(str(default_tokenizer_path())), bundled_corpus_dir(), 2)


def _rollback_args(dump: Path, prepared: str, *extra: str) -> list[str]:
    """10 steps on prepared data, a full checkpoint every 4 (global batch 4: 2 ranks x 2)."""
    return [
        *_launch_args(dump, MODEL, "--dataloader.dataset", prepared, "--debug.deterministic"),
        "--training.steps", "10", "--checkpoint.enable", "--checkpoint.interval", "4",
        "--checkpoint.keep_latest_k", "0", "--checkpoint.no_last_save_model_only", *extra,
    ]  # fmt: skip


@pytest.mark.multiprocess
def test_rollback_equals_a_resume_that_excludes_the_same_samples(
    tmp_path: Path, prepared: str
) -> None:
    """2 ranks, FSDP: a NaN at step 6 rolls back to step 4 and skips the samples read since;
    the final weights and optimizer state are bitwise those of a run resumed from step 4 with
    those samples excluded by `dataloader.exclude`."""
    run_dir, ref_dir = tmp_path / "rollback", tmp_path / "reference"
    args = _rollback_args(run_dir, prepared, "--debug.inject", "nan_loss:6:1",
                          "--health.nonfinite", "rollback")  # fmt: skip
    out = launch_job(args, run_dir, backend="local", nproc_per_node=2)
    rows = [json.loads(line) for line in (run_dir / "health.jsonl").read_text().splitlines()]
    assert rows[1] == {"step": 6, "action": "rollback", "to_step": 4, "skipped_samples": [16, 24]}
    assert "health: step 6: rolled back to step 4; samples 16:24 of the data order skipped" in out
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [int(m["step"]) for m in metrics] == [1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10]
    assert metrics[-1]["health/rollbacks"] == 1.0

    shutil.copytree(run_dir / "checkpoint" / "step-4", ref_dir / "checkpoint" / "step-4")
    launch_job(_rollback_args(ref_dir, prepared, "--dataloader.exclude", "16:24"), ref_dir,
               backend="local", nproc_per_node=2)  # fmt: skip
    got, want = (checkpoint_tensors(d / "checkpoint" / "step-10") for d in (run_dir, ref_dir))
    assert got.keys() == want.keys() and any(k.startswith("optimizer.") for k in got)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_rollbacks_are_capped_and_damp_the_learning_rate(tmp_path: Path, prepared: str) -> None:
    args = _args(
        tmp_path, "--training.steps", "10", "--checkpoint.interval", "4",
        "--dataloader.dataset", prepared, "--training.seq_len", "32", "--debug.drill",
        "--health.nonfinite", "rollback", "--health.rollback_lr_factor", "0.5",
        "--health.rollback_lr_steps", "2", "--health.max_rollbacks", "1",
        "--debug.inject", "nan_grad:6", "nan_grad:7",
    )  # fmt: skip
    with pytest.raises(HealthStop) as stop:
        run(parse_args(args))
    assert str(stop.value).startswith(
        "health: step 7: nonfinite grad_norm nan; 1 rollbacks within 1000 steps "
        "(health.max_rollbacks = 1): stopped"
    )
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # Steps 1-5, the rollback at 6 to step 4, then 5 and 6 again at half the learning rate.
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 5, 6]
    assert rows[5]["lr"] == pytest.approx(0.5 * rows[4]["lr"])
    health = [json.loads(line) for line in (tmp_path / "health.jsonl").read_text().splitlines()]
    # The second incident could not roll back: its row says what was done (stop).
    assert [r["action"] for r in health] == ["rollback", "rollback", "stop"]
    assert health[1] == {"step": 6, "action": "rollback", "to_step": 4, "skipped_samples": [16, 24]}


def test_rollback_without_a_checkpoint_stops_with_one_line(tmp_path: Path, assets: Path) -> None:
    extra = ["--checkpoint.no_enable", "--debug.inject", "nan_loss:3", "--debug.drill",
             "--health.nonfinite", "rollback"]  # fmt: skip
    with pytest.raises(HealthStop, match=r"no checkpoint to roll back to: stopped; no checkpoint"):
        run(parse_args(_args(tmp_path, *extra)))
    row = json.loads((tmp_path / "health.jsonl").read_text())
    assert (row["step"], row["action"]) == (3, "stop")


def test_a_rollback_to_the_seed_skips_the_samples_since_the_start(
    tmp_path: Path, prepared: str
) -> None:
    """No step checkpoint before the anomaly: the rollback goes to the seed checkpoint, and the
    samples skipped are those since the run's start (0:12, not an empty 12:12), a range
    dataloader.exclude takes: a run from the same seed excluding it ends bitwise alike."""
    run_dir, ref_dir = tmp_path / "rollback", tmp_path / "reference"
    common = ["--dataloader.dataset", prepared, "--training.seq_len", "32",
              "--training.steps", "5", "--checkpoint.interval", "4"]  # fmt: skip
    run(parse_args(_args(run_dir, *common, "--checkpoint.create_seed_checkpoint")))
    shutil.copytree(run_dir / "checkpoint" / "seed", ref_dir / "checkpoint" / "seed")
    run(parse_args(_args(run_dir, *common, "--debug.drill", "--debug.inject", "nan_loss:3",
                         "--health.nonfinite", "rollback")))  # fmt: skip
    rows = [json.loads(line) for line in (run_dir / "health.jsonl").read_text().splitlines()]
    assert rows[-1] == {"step": 3, "action": "rollback", "to_step": 0, "skipped_samples": [0, 12]}
    run(parse_args(_args(ref_dir, *common, "--dataloader.exclude", "0:12")))
    got, want = (checkpoint_tensors(d / "checkpoint" / "step-5") for d in (run_dir, ref_dir))
    assert got.keys() == want.keys() and any(k.startswith("optimizer.") for k in got)
    for key in want:
        assert torch.equal(got[key], want[key]), key


# ------------------------------------------------------------------ in the pipeline
@pytest.mark.parametrize("policy", ["stop", "rollback"])
def test_pipeline_shows_the_incident_and_stops_or_completes(
    policy: str, prefect_harness: Path, tmp_path: Path
) -> None:
    """Under stop the train stage fails with the guard's line and nothing is exported; under
    rollback the pipeline completes, and MLflow and Prefect show the incident."""
    from mlflow.tracking import MlflowClient
    from pipeline_helpers import run_flow, task_runs, tiny_values
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.pipeline import pretrain_pipeline

    storage, tracking = str(tmp_path / "out"), f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = tiny_values(steps=6, nproc=1) | {
        "job.dump_folder": storage, "tracking.uri": tracking, "debug.drill": True,
        "debug.inject": ["nan_grad:3"], "health.nonfinite": policy, "evaluate.batches": 1,
    }  # fmt: skip
    state, flow_run_id = run_flow(
        pretrain_pipeline, recipe="llama3_debugmodel_tiny", overrides=overrides
    )
    runs = task_runs(flow_run_id)
    if policy == "stop":
        assert state.is_failed()
        error = str(state.result(raise_on_failure=False))
        assert error.startswith("training: stopped by the health guard: health: step 3: ")
        assert "\n" not in error
        assert runs["train"][-1].state.is_failed() and len(runs["train"]) == 1  # no retry
        assert "convert_to_hf" not in runs and "publish" not in runs
    else:
        assert state.is_completed(), state.message
        assert "publish" in runs
        result = state.result()
        health = result["health"]  # the train task's typed counts, in the flow's result
        assert health == {"incidents": 1, "skipped_steps": 0, "rollbacks": 1, "stragglers": 0}
    client = MlflowClient(tracking_uri=tracking)
    train_run = next(
        r for r in client.search_runs([e.experiment_id for e in client.search_experiments()])
        if r.data.tags.get("titan.stage") == "train"
    )  # fmt: skip
    expected = "1 incident, 1 rollback" if policy == "rollback" else "1 incident, 0 rollbacks"
    assert train_run.data.tags["titan.health"] == expected
    assert "health.jsonl" in [a.path for a in client.list_artifacts(train_run.info.run_id)]
    with get_client(sync_client=True) as prefect:
        found = prefect.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["training-health"]))
        )
    table = next(a for a in found if a.flow_run_id == flow_run_id).data
    assert "| 3 | nonfinite grad_norm | nan | all |" in table
    if policy == "rollback":
        _check_a_drill_publishes_nothing(result, flow_run_id, client, storage)


def _check_a_drill_publishes_nothing(
    result: dict, flow_run_id: Any, client: Any, root: str
) -> None:
    """A drill is summarised (Prefect artifact, MLflow description, the CLI's closing lines)
    with its incident, marked as a drill, registers no model version, moves no alias, and is no
    part of its model line (retrain never continues it)."""
    from pipeline_helpers import flow_run
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from titan_core.cli.pipeline import where_to_look
    from titan_core.pipeline.stages.model_line import latest_checkpoint

    incident = "step 3: nonfinite grad_norm, nan (all ranks) -> rollback"
    assert result["drill"] and result["health_summary"] == "1 incident, 1 rollback"
    assert result["incidents"][0] == incident and result["model_version"] == ""
    assert client.search_registered_models() == [] and client.search_model_versions() == []
    parent = client.get_run(result["mlflow_run_id"])
    assert parent.data.tags["titan.drill"] == "true" and "drill" in flow_run(flow_run_id).tags
    description = parent.data.tags["mlflow.note.content"]
    with get_client(sync_client=True) as prefect:
        artifacts = prefect.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    summary = next(a for a in artifacts if a.key == "run-summary").data
    assert summary == description  # the same summary in Prefect and MLflow
    assert summary.startswith(f"# Run `{result['run_id']}` (drill)")
    assert "- model version: none: a drill (debug.drill) registers no model version" in summary
    assert "## Training health: 1 incident, 1 rollback" in summary and f"- {incident}" in summary
    closing = where_to_look(result, "home")  # what `titan pipeline run` prints at the end
    assert "  drill (debug.drill): no model version registered, no alias moved" in closing
    assert f"    {incident}" in closing
    experiment = result["run_root"].rstrip("/").rsplit("/", 2)[-2]
    assert latest_checkpoint(root, experiment) is None


def test_the_report_table_reads_every_kind_of_row() -> None:
    """The train task's Prefect table: a straggler and a recompute mismatch read as such."""
    from titan_core.components.health import Incident
    from titan_core.components.stragglers import Straggler
    from titan_core.pipeline.stages.training import health_markdown

    timings = {"data_wait": 0.001, "collective_wait": 0.004, "compute": 0.0613}
    rows = [
        Straggler(8, 1, "compute", 0.0613, 0.0198, timings).row(),
        Incident(4, "recompute", "sdc", 0.00412, "stop", [1], differs="loss and gradients").row(),
    ]
    table = health_markdown(json.loads(json.dumps(rows)))  # as read back from health.jsonl
    straggler = "| 8 | straggler (compute) | 61.3 ms/step (others' median 19.8 ms) | 1 | report |"
    assert straggler in table
    assert "| 4 | recompute differs | loss and gradients, relative 0.00412 | 1 | stop |" in table
