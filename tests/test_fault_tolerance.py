"""Restart and auto-resume: kill -9 of one rank mid-run → torchrun restarts the worker group →
training resumes from the newest complete checkpoint → the losses equal an uninterrupted run.

And a stalled rank: every rank dumps its flight recorder, the launch fails in one line naming
the dump folder, and torch's analyzer names the stuck rank.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from parallel_harness import train_layout

from titan_core.config.job import Launch
from titan_core.launch import LaunchError, LaunchSpec, get_launcher

pytestmark = pytest.mark.multiprocess

STEPS = 40
INTERVAL = 8  # checkpoint every 8 steps: the kill lands after step-8 or a later one is committed
KILL_AFTER = 11  # rank 1 is killed when rank 0 logs this step
SAVES = [
    "--checkpoint.no_load_only",
    "--checkpoint.interval",
    str(INTERVAL),
    "--checkpoint.async_mode",
    "disabled",
]


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory, parity_seed: Path) -> dict[int, float]:
    """Losses of the uninterrupted run (one agent; two agents are bitwise equal to it:
    tests/test_parallelism.py)."""
    dump = tmp_path_factory.mktemp("clean")
    return train_layout(dump, parity_seed, nproc=2, dp=2, steps=STEPS, extra=SAVES).losses


def _rank_pid(dump: Path, rank: int) -> int:
    """PID of the first-attempt worker process of ``rank`` training into ``dump``."""
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "titan_core.train" not in cmd or str(dump) not in cmd:
            continue
        try:
            env = proc.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if env.get("RANK") == str(rank) and env.get("TORCHELASTIC_RESTART_COUNT") == "0":
            return proc.pid
    raise AssertionError(f"no worker of rank {rank} for {dump}")


def test_kill_9_of_a_rank_restarts_and_resumes_bitwise(
    tmp_path: Path, parity_seed: Path, clean: dict[int, float]
) -> None:
    """Two agents (``local_multinode``), one rank each, against the uninterrupted run of one
    agent: rank 1 is the second agent's only worker, so its agent counts a restart while the
    first agent's (whose worker was healthy) only joins the new rendezvous round — the harder
    case (one agent: the same torchrun path with a single agent)."""
    nnodes = 2
    dump = tmp_path / "killed"
    killed: list[int] = []

    def kill_rank_1(line: str) -> None:
        if not killed and re.match(rf"\[rank0\]:.*step:\s+{KILL_AFTER}\s", line):
            pid = _rank_pid(dump, 1)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    run = train_layout(
        dump,
        parity_seed,
        nproc=2,
        dp=2,
        steps=STEPS,
        extra=SAVES,
        nnodes=nnodes,
        launch={"max_restarts": 1},
        on_line=kill_rank_1,
    )
    assert killed, "rank 1 was never killed"
    out = run.output
    assert "torchrun restart 1 of 1: resuming from the newest complete checkpoint" in out
    resumed = [int(s) for s in re.findall(r"Loaded \[.*?\] from \S+/step-(\d+) \(step", out)]
    assert resumed and resumed[0] >= INTERVAL and resumed[0] % INTERVAL == 0, resumed
    assert all(r == resumed[0] for r in resumed), resumed  # every rank from the same step
    # The killed attempt logged steps past the checkpoint; the restart logged them again.
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    steps = [int(r["step"]) for r in rows if "loss" in r]
    assert steps.count(resumed[0] + 1) == 2, steps
    assert run.losses == clean  # bitwise, every step, the final one included


def test_a_stalled_rank_fails_the_launch_naming_the_trace_folder(
    tmp_path: Path, assets: Path
) -> None:
    """Through the launcher: rank 1 stops before step 2's collectives, the 3 s train timeout
    fires, every rank dumps, and the one-line launch error names the dump folder."""
    dump = tmp_path / "out"
    args = ["--module", "llama3", "--config", "llama3_debugmodel_tiny"]
    args += ["--job.dump_folder", str(dump), "--training.steps", "4"]
    args += ["--comm.train_timeout_seconds", "3", "--checkpoint.no_enable"]
    args += ["--validation.no_enable", "--metrics.log_freq", "1"]
    launch = Launch(nproc_per_node=2, log_ranks="all")
    spec = LaunchSpec(args=args, launch=launch, env={"TITAN_FAULT_HANG_STEP": "2"}, timeout_s=300)
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        get_launcher(launch).run(spec, lambda line: None)
    assert time.monotonic() - start < 120
    error = info.value
    assert re.match(
        r"training: rank \d failed with exit code 3: rank \d: collective failed", str(error)
    )
    assert "Timed out waiting 3000ms" in str(error)  # the configured train timeout
    assert str(error).endswith(f"flight-recorder traces of every rank in {dump / 'comm_traces'}")
    assert error.retryable  # a stuck peer is not bad input: the pipeline relaunches
    traces = dump / "comm_traces"
    assert sorted(p.name for p in traces.iterdir()) == ["rank_0", "rank_1"]
    analyzer = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace"]
    analysis = subprocess.run(
        [*analyzer, str(traces), "--prefix", "rank_"], capture_output=True, text=True, timeout=120
    )
    assert analysis.returncode == 0, analysis.stderr[-2000:]
    assert "missing ranks: {1}" in analysis.stdout + analysis.stderr  # it logs to stderr
