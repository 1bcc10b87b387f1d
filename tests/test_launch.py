"""``titan_core.launch``: torchrun command, live output streaming, environment, failure mapping."""

from __future__ import annotations

import signal
import sys
import textwrap
from pathlib import Path

import pytest

from titan_core.config.job import Launch
from titan_core.errors import ConfigError
from titan_core.launch import LaunchError, LaunchSpec, describe_failure, get_launcher

JOB = textwrap.dedent(
    """
    import os, sys
    rank = os.environ["RANK"]
    print(f"hello {rank} omp={os.environ.get('OMP_NUM_THREADS')} "
          f"extra={os.environ.get('EXTRA')} hidden={os.environ.get('HIDDEN')}", flush=True)
    if rank == "1":
        print("error: training.steps: expected an int > 0, got 0", file=sys.stderr, flush=True)
        sys.exit(2)
    """
)


def test_command_is_torchrun_with_the_configured_world() -> None:
    launch = Launch(nproc_per_node=4, max_restarts=1, log_ranks="0,2", rdzv_endpoint="h:29500")
    cmd = get_launcher(launch).command(
        LaunchSpec(args=["--training.steps", "3"], launch=launch, log_dir="/tmp/logs")
    )
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    for flag in (
        "--nnodes=1",
        "--nproc_per_node=4",
        "--rdzv_endpoint=h:29500",
        "--max_restarts=1",
        "--local-ranks-filter=0,2",
        "--log-dir=/tmp/logs",
    ):
        assert flag in cmd
    assert cmd[-4:] == ["-m", "titan_core.train", "--training.steps", "3"]


def test_local_backend_runs_one_node_only() -> None:
    launch = Launch(nnodes=2)
    with pytest.raises(ConfigError, match=r"^launch.nnodes: the local backend runs one node"):
        get_launcher(launch).command(LaunchSpec(args=[], launch=launch))


def test_bad_launch_values_are_one_line_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"^launch.log_ranks: expected a comma list"):
        Launch(log_ranks="zero")
    with pytest.raises(ConfigError, match=r"^launch.rdzv_endpoint: expected host:port"):
        Launch(rdzv_endpoint="localhost")


@pytest.mark.multiprocess
def test_output_streams_live_and_a_user_error_is_not_retryable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "job.py").write_text(JOB)
    monkeypatch.setenv("HIDDEN", "inherited")
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    launch = Launch(nproc_per_node=2, log_ranks="all", omp_num_threads=1)
    spec = LaunchSpec(
        args=[],
        launch=launch,
        module="job",
        env={"EXTRA": "x1", "PYTHONPATH": str(tmp_path)},
        env_unset=("HIDDEN",),
        log_dir=str(tmp_path / "logs"),
    )
    lines: list[str] = []
    with pytest.raises(LaunchError) as info:
        get_launcher(launch).run(spec, lines.append)
    error = info.value
    assert str(error) == "training: rejected its input: training.steps: expected an int > 0, got 0"
    assert not error.retryable and error.exitcode == 2 and error.rank == 1
    for rank in (0, 1):  # both ranks' output, prefixed, with the job's environment
        assert f"[rank{rank}]:hello {rank} omp=1 extra=x1 hidden=None" in lines
    assert any((tmp_path / "logs").rglob("stdout.log"))


def _torchrun_report(exitcode: int, rank: int = 1) -> list[str]:
    """The tail torchrun prints when a worker fails (ChildFailedError's report)."""
    return [
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "============================================================",
        "titan_core.train FAILED",
        "Root Cause (first observed failure):",
        "[0]:",
        f"  rank      : {rank} (local_rank: {rank})",
        f"  exitcode  : {exitcode} (pid: 4242)",
        "============================================================",
    ]


def test_failures_map_to_clear_retryable_or_final_errors() -> None:
    killed = describe_failure(1, _torchrun_report(-int(signal.SIGKILL)))
    assert str(killed).startswith("training: rank 1 was killed by SIGKILL") and killed.retryable
    crashed = describe_failure(1, ["Traceback ...", *_torchrun_report(1, rank=0)])
    assert "rank 0 failed with exit code 1" in str(crashed) and crashed.retryable
    oom = describe_failure(1, ["torch.OutOfMemoryError: CUDA out of memory", *_torchrun_report(1)])
    assert "ran out of device memory" in str(oom) and not oom.retryable
    agent = describe_failure(-int(signal.SIGTERM), [])
    assert str(agent) == "training: the launcher (torchrun) was killed by SIGTERM"


SLEEPER = textwrap.dedent(
    """
    import os, time
    print(f"worker pid {os.getpid()}", flush=True)
    time.sleep(600)
    """
)
DRIVER = textwrap.dedent(
    """
    import sys
    from titan_core.config.job import Launch
    from titan_core.launch import LaunchSpec, get_launcher
    launch = Launch(nproc_per_node=2, log_ranks="all")
    spec = LaunchSpec(args=[], launch=launch, module="sleeper", env={"PYTHONPATH": sys.argv[1]})
    get_launcher(launch).run(spec, lambda line: print(line, flush=True))
    """
)


@pytest.mark.multiprocess
def test_sigterm_to_the_caller_ends_the_whole_job(tmp_path: Path) -> None:
    import subprocess
    import time

    import psutil

    (tmp_path / "sleeper.py").write_text(SLEEPER)
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    pids = []
    assert driver.stdout is not None
    for line in driver.stdout:
        if "worker pid" in line:
            pids.append(int(line.rsplit(" ", 1)[1]))
        if len(pids) == 2:
            break
    driver.send_signal(signal.SIGTERM)
    assert driver.wait(timeout=60) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 30  # the agent stops its workers, then exits
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids):
        assert time.monotonic() < deadline, f"workers {pids} outlived their launcher"
        time.sleep(0.05)
