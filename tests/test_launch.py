"""``titan_core.launch``: torchrun command, live output streaming, environment, failure mapping."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import wait_until

from titan_core.config.job import Launch, Slurm
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
    segv = describe_failure(1, _torchrun_report(-int(signal.SIGSEGV), rank=3))
    assert str(segv) == (
        "training: rank 3 was killed by SIGSEGV (a crash in native code: the rank's log shows "
        "its threads' Python stacks)"
    )
    crashed = describe_failure(1, ["Traceback ...", *_torchrun_report(1, rank=0)])
    assert "rank 0 failed with exit code 1" in str(crashed) and crashed.retryable
    oom = describe_failure(1, ["torch.OutOfMemoryError: CUDA out of memory", *_torchrun_report(1)])
    assert "ran out of device memory" in str(oom) and not oom.retryable
    agent = describe_failure(-int(signal.SIGTERM), [])
    assert str(agent) == "training: the launcher (torchrun) was killed by SIGTERM"


def test_a_lost_lighthouse_is_one_line_relaunched_unless_it_is_the_users_own() -> None:
    """Exit code 5 (replica groups that lost their lighthouse): the first line naming it (the
    step of the first failed quorum; a restarted group's line comes later) and exit code 5,
    locally and on Slurm; relaunched, unless it was ``fault_tolerance.lighthouse``."""
    from titan_core.config.job import FaultTolerance
    from titan_core.launch.replica_groups import ReplicaGroupsLauncher
    from titan_core.launch.slurm import _job_error

    lost = "lost the replica groups' lighthouse http://h:1 at step 7 (no quorum, and it does not…"
    restarted = "the replica groups' lighthouse http://h:1 does not answer (connection refused)"
    tail = [f"[rank0]:error: {lost}", f"[rank0]:error: {restarted}", *_torchrun_report(5, 0)]
    own = ReplicaGroupsLauncher(FaultTolerance(enable=True), 2)
    users = ReplicaGroupsLauncher(FaultTolerance(enable=True, lighthouse="http://h:1"), 2)
    local = own.verdict(describe_failure(1, tail))
    assert str(local) == f"training: {lost}" and local.retryable and local.exit_code == 5
    final = users.verdict(describe_failure(1, tail))
    assert str(final) == f"training: {lost}" and not final.retryable and final.exit_code == 5
    on_slurm = _job_error("7", "FAILED", "1:0", "", tail, Path("slurm-7.out"))
    assert f"FAILED (exit code 1:0): {lost}; output in" in str(on_slurm) and on_slurm.retryable
    assert on_slurm.exit_code == 5 and not users.verdict(on_slurm).retryable
    assert users.verdict(describe_failure(1, _torchrun_report(3))).retryable  # not the lighthouse


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
def _alive(pids: list[int]) -> list[int]:
    """The processes of ``pids`` still running (zombies count as gone)."""
    import psutil

    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


def test_sigterm_to_the_caller_ends_the_whole_job(tmp_path: Path) -> None:
    import subprocess

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
    # the agent stops its workers, then exits
    wait_until(lambda: not _alive(pids), timeout=30, what=f"workers {pids} gone", interval=0.05)


# ------------------------------------------------------------------ several nodes


def test_local_multinode_agents_share_one_rendezvous() -> None:
    from titan_core.launch.local import LocalMultinodeLauncher

    launch = Launch(backend="local_multinode", nnodes=3, nproc_per_node=2, max_restarts=2)
    spec = LaunchSpec(args=["--training.steps", "3"], launch=launch, log_dir="/tmp/l")
    cmds = LocalMultinodeLauncher().commands(spec)
    assert len(cmds) == 3
    for i, cmd in enumerate(cmds):
        assert "--nnodes=3" in cmd and "--nproc_per_node=2" in cmd and "--max_restarts=2" in cmd
        assert f"--log-dir=/tmp/l/agent{i}" in cmd
        assert not any(c.startswith("--local-ranks-filter") for c in cmd)  # global filter
        assert cmd[-4:] == ["-m", "titan_core.train", "--training.steps", "3"]
    for flag in ("--rdzv_endpoint=", "--rdzv_id="):
        assert len({next(c for c in cmd if c.startswith(flag)) for cmd in cmds}) == 1
    rendered = get_launcher(launch).render(spec).splitlines()
    assert len(rendered) == 4 and rendered[-1] == "wait"
    with pytest.raises(ConfigError, match=r"^launch.rdzv_endpoint: local_multinode rendezvous"):
        get_launcher(Launch(backend="local_multinode", rdzv_endpoint="10.1.2.3:29500"))


def test_rank_filter_keeps_global_ranks_and_agent_lines() -> None:
    from titan_core.launch.torchrun import rank_filter

    keep = rank_filter("0,3")
    assert keep("[rank0]:loss") and keep("[rank3]:x") and not keep("[rank1]:x")
    assert keep("[agent 1] torchrun: worker failed") and keep("plain line")
    assert rank_filter("all")("[rank7]:x")


@pytest.mark.multiprocess
def test_local_multinode_failure_of_one_agent_ends_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 (agent 1) fails; agent 0, whose rank succeeded, waits in torchrun's exit barrier
    for its peer until the launcher's grace period stops it."""
    import time

    from titan_core.launch import supervise

    monkeypatch.setattr(supervise, "PEER_GRACE_S", 1.0)
    (tmp_path / "job.py").write_text(JOB)
    launch = Launch(backend="local_multinode", nnodes=2, log_ranks="all")
    spec = LaunchSpec(args=[], launch=launch, module="job", env={"PYTHONPATH": str(tmp_path)})
    lines: list[str] = []
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        get_launcher(launch).run(spec, lines.append)
    assert time.monotonic() - start < 60  # torchrun's exit barrier alone waits 300 s
    assert str(info.value) == (
        "training: rejected its input: training.steps: expected an int > 0, got 0"
    )
    assert not info.value.retryable
    for rank in (0, 1):  # one rank per agent, both prefixed with their global rank
        assert any(line.startswith(f"[rank{rank}]:hello {rank} ") for line in lines), lines


# ------------------------------------------------------------------ slurm (no cluster needed)


def _script(launch: Launch, **spec: object) -> str:
    args = ["--module", "llama3", "--job.dump_folder", "out dir"]
    return get_launcher(launch).render(LaunchSpec(args=args, launch=launch, **spec))  # type: ignore[arg-type]


def test_slurm_script_runs_torchrun_on_every_node() -> None:
    launch = Launch(
        backend="slurm",
        nnodes=4,
        nproc_per_node=8,
        max_restarts=3,
        slurm=Slurm(
            partition="gpu",
            account="proj",
            time_limit="1-00:00:00",
            sbatch_args=["--gpus-per-node=8", "--exclusive"],
            setup=["source /shared/venv/bin/activate"],
            python="/shared/venv/bin/python",
            rdzv_port_base=31000,
        ),
    )
    secret = "s3cr3t-value"
    script = _script(
        launch, env={"AWS_SECRET_ACCESS_KEY": secret}, env_unset=("HIDDEN",), log_dir="/logs"
    )
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for directive in (
        "--nodes=4",
        "--ntasks-per-node=1",
        "--time=1-00:00:00",
        "--partition=gpu",
        "--account=proj",
        "--gpus-per-node=8",
        "--exclusive",
        "--output=/logs/slurm-%j.out",
        "--export=ALL",
    ):
        assert f"#SBATCH {directive}" in lines
    assert secret not in script  # the environment carries values; the script names them
    assert "# From the submitting environment: AWS_SECRET_ACCESS_KEY" in lines
    assert "unset HIDDEN" in lines and "source /shared/venv/bin/activate" in lines
    assert "$((31000 + SLURM_JOB_ID % 1000))" in script  # a rendezvous port per job
    joined = script.replace(" \\\n  ", " ")
    srun = "srun --nodes=4 --ntasks-per-node=1 --kill-on-bad-exit=1"
    cpus = "${SLURM_CPUS_PER_TASK:+--cpus-per-task=$SLURM_CPUS_PER_TASK}"  # srun does not inherit
    assert f"{srun} {cpus} bash -c" in joined
    assert "--rdzv_conf=is_host=$((SLURM_NODEID == 0))" in joined  # head node hosts the store
    assert (
        "/shared/venv/bin/python -m torch.distributed.run --nnodes=4 --nproc_per_node=8" in joined
    )
    assert '"--rdzv_endpoint=$rdzv_endpoint" "--rdzv_id=$SLURM_JOB_ID" --max_restarts=3' in joined
    assert joined.rstrip().endswith(
        "-m titan_core.train --module llama3 --job.dump_folder 'out dir'"
    )
    check = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert check.returncode == 0, check.stderr


def test_slurm_replica_groups_are_job_steps_of_one_script() -> None:
    from titan_core.config.job import FaultTolerance
    from titan_core.launch.replica_groups import ReplicaGroupsLauncher

    launch = Launch(backend="slurm", nnodes=6, nproc_per_node=8, max_restarts=2)
    spec = LaunchSpec(args=["--module", "llama3"], launch=launch, log_dir="/logs")
    ft = FaultTolerance(enable=True, min_replicas=2, join_timeout_ms=7000)
    script = ReplicaGroupsLauncher(ft, 3, "slurm").render(spec)
    joined = script.replace(" \\\n    ", " ")
    assert "#SBATCH --nodes=6" in script.splitlines()
    assert re.search(  # the lighthouse in the background, on the first node
        r"-m titan_core.launch.lighthouse --host .*--min_replicas 2 --join_timeout_ms 7000 .*&$",
        script,
        re.M,
    )
    assert "for g in $(seq 0 2); do" in script
    assert "$((29500 + (SLURM_JOB_ID * 3 + g) % 1000))" in script  # a port per job and group
    step = "srun --job-name=titan-group-$g --nodes=2 --ntasks=2 --ntasks-per-node=1"
    assert f"{step} --relative=$((g * 2)) --kill-on-bad-exit=1" in joined
    assert "--rdzv_conf=is_host=$((SLURM_PROCID == 0))" in joined  # the step's first node
    assert "--nnodes=2 --nproc_per_node=8" in joined and "--max_restarts=2" in joined
    assert '"--rdzv_id=$SLURM_JOB_ID-$g"' in joined
    assert '-m titan_core.train --module llama3 --fault_tolerance.group_id "$g" &' in joined
    assert script.rstrip().endswith('[ $finished -gt 0 ] || exit "$rc"')
    check = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert check.returncode == 0, check.stderr
    given = ReplicaGroupsLauncher(
        FaultTolerance(enable=True, lighthouse="http://lh.example:29510"), 3, "slurm"
    ).render(spec)
    assert "export TORCHFT_LIGHTHOUSE=http://lh.example:29510" in given
    assert "titan_core.launch.lighthouse" not in given


def test_slurm_explicit_endpoint_and_bad_settings() -> None:
    script = _script(Launch(backend="slurm", nnodes=2, rdzv_endpoint="store.example:29400"))
    assert "rdzv_endpoint=store.example:29400" in script and "is_host" not in script
    with pytest.raises(ConfigError, match=r"^launch.rdzv_endpoint: 127.0.0.1:29500 is loopback"):
        get_launcher(Launch(backend="slurm", nnodes=2, rdzv_endpoint="127.0.0.1:29500"))
    with pytest.raises(ConfigError, match=r"^launch.slurm.time_limit: expected minutes"):
        Slurm(time_limit="soon")
    with pytest.raises(ConfigError, match=r"^launch.slurm.sbatch_args: expected sbatch options"):
        Slurm(sbatch_args=["exclusive; rm -rf /"])
    slurm = Slurm(sbatch_args=["exclusive", "gpus-per-node=8"])
    plain = _script(Launch(backend="slurm", slurm=slurm))
    assert "#SBATCH --exclusive\n#SBATCH --gpus-per-node=8\n" in plain  # CLI-friendly spelling


def test_slurm_without_its_clients_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    launch = Launch(backend="slurm", nnodes=2)
    launcher = get_launcher(launch)  # settings are fine: a dry run needs no cluster
    with pytest.raises(ConfigError, match=r"^launch.backend: slurm needs sbatch, squeue"):
        launcher.probe()
    with pytest.raises(LaunchError, match=r"^launch.backend: slurm needs sbatch") as info:
        launcher.run(LaunchSpec(args=[], launch=launch, log_dir=str(tmp_path)), print)
    assert not info.value.retryable
    assert not list(tmp_path.iterdir())  # nothing written before the check


def test_slurm_states_map_to_one_line_errors(tmp_path: Path) -> None:
    from titan_core.launch.slurm import _job_error

    out = tmp_path / "slurm-7.out"
    timeout = _job_error("7", "TIMEOUT", "0:15", "TimeLimit", [], out)
    assert str(timeout).startswith("training: Slurm job 7 ended TIMEOUT (exit code 0:15, reason ")
    assert "killed by SIGTERM" in str(timeout) and timeout.retryable  # resumes on relaunch
    cancelled = _job_error("7", "CANCELLED", "0:0", "None", [], out)
    assert (
        str(cancelled) == f"training: Slurm job 7 ended CANCELLED (exit code 0:0); output in {out}"
    )
    assert not cancelled.retryable
    assert not _job_error("7", "OUT_OF_MEMORY", "0:125", "", [], out).retryable
    rejected = _job_error(
        "7", "FAILED", "1:0", "", ["[rank1]:error: training.steps: bad", *_torchrun_report(2)], out
    )
    assert "rejected its input: training.steps: bad" in str(rejected) and not rejected.retryable
    crashed = _job_error("7", "FAILED", "1:0", "", _torchrun_report(-int(signal.SIGKILL)), out)
    assert ": rank 1 was killed by SIGKILL" in str(crashed) and crashed.retryable


def test_titan_launch_dry_run_prints_without_running(
    capsys: pytest.CaptureFixture[str], assets: Path
) -> None:
    from titan_core.cli import main

    argv = ["launch", "--dry-run", "--module", "llama3", "--config", "llama3_debugmodel_tiny"]
    assert main([*argv, "--launch.backend", "slurm", "--launch.nnodes", "2"]) == 0
    script = capsys.readouterr().out
    assert script.startswith("#!/bin/bash\n#SBATCH --job-name=titan\n#SBATCH --nodes=2\n")
    assert main([*argv, "--launch.nproc_per_node", "2"]) == 0
    (command,) = capsys.readouterr().out.splitlines()
    assert "-m torch.distributed.run --nnodes=1 --nproc_per_node=2" in command
    bad = ["--launch.nproc_per_node", "2", "--parallelism.tensor_parallel_degree", "3"]
    assert main([*argv, *bad]) == 2
    out, err = capsys.readouterr()
    assert not out and err.count("\n") == 1 and err.startswith("error: parallelism:")


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend, nnodes", [("local", 1), ("local_multinode", 2)])
def test_launch_timeout_leaves_no_worker_behind(backend: str, nnodes: int, tmp_path: Path) -> None:
    """torch starts every worker in a session of its own: killing an agent's process group
    would orphan them. The launcher stops the agents and every worker it has seen."""

    (tmp_path / "sleeper.py").write_text(SLEEPER)
    launch = Launch(backend=backend, nnodes=nnodes, nproc_per_node=2 // nnodes, log_ranks="all")
    spec = LaunchSpec(
        args=[], launch=launch, module="sleeper", env={"PYTHONPATH": str(tmp_path)}, timeout_s=6
    )
    lines: list[str] = []
    with pytest.raises(LaunchError, match=r"^training: killed after the launch timeout of 6s$"):
        get_launcher(launch).run(spec, lines.append)
    pids = [int(line.rsplit(" ", 1)[1]) for line in lines if "worker pid" in line]
    assert len(pids) == 2, lines
    wait_until(lambda: not _alive(pids), timeout=10, what=f"workers {pids} gone after the timeout")


def test_slurm_output_follower_handles_split_characters_and_truncation(tmp_path: Path) -> None:
    from titan_core.launch.slurm import _Follower

    path = tmp_path / "slurm-1.out"
    follower = _Follower(path, lambda line: not line.startswith("[rank1]"))
    got: list[str] = []
    follower.drain(got.append)  # no file yet: the job has not started
    data = "titan: job 1 on 2 nodes é→\n[rank1]:hidden\n[rank0]:step ✓\npartial".encode()
    cut = data.index("→".encode()) + 1  # in the middle of a 3-byte character
    path.write_bytes(data[:cut])
    follower.drain(got.append)
    with open(path, "ab") as f:
        f.write(data[cut:])
    follower.drain(got.append)
    assert got == ["titan: job 1 on 2 nodes é→", "[rank0]:step ✓"]  # partial line held back
    assert follower.reached_srun and list(follower.tail)[-1] == "[rank0]:step ✓"
    path.write_bytes(b"requeued\n")  # Slurm truncates the file when it starts the job again
    follower.drain(got.append)
    follower.drain(got.append, final=True)
    assert got[-1] == "requeued"


def test_slurm_output_holds_back_torchrun_reports_of_failed_ranks(tmp_path: Path) -> None:
    """A failed replica group's torchrun report, interleaved with the live group's lines, is
    not streamed (the script's line on how the group ended says it); it stays in the tail."""
    from titan_core.launch.slurm import _Follower

    report = [
        "E1127 19:37:36.605000 29034 torch/distributed/elastic/multiprocessing/api.py:1002] "
        "failed (exitcode: -9) local_rank: 0 (pid: 29041) of binary: python",
        "Traceback (most recent call last):",
        '  File "torch/distributed/run.py", line 1032, in <module>',
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "=" * 54,
        "titan_core.train FAILED",
        "-" * 54,
        "Root Cause (first observed failure):",
        "[0]:",
        "  exitcode  : -9 (pid: 29041)",
        "=" * 54,
    ]
    other = "Traceback (most recent call last):\nValueError: the lighthouse broke"
    text = "\n".join(["titan: job 1 on 2 nodes", *report[:3], "[rank0]:step 5", *report[3:]])
    text += "\nsrun: error: n2: task 0: Exited with exit code 1\n" + other
    path = tmp_path / "slurm-1.out"
    path.write_text(text)
    follower = _Follower(path, lambda line: True)
    got: list[str] = []
    follower.drain(got.append, final=True)
    assert got == [
        "titan: job 1 on 2 nodes",
        "[rank0]:step 5",
        "srun: error: n2: task 0: Exited with exit code 1",
        *other.splitlines(),  # not torchrun's report: shown
    ]
    assert "Root Cause (first observed failure):" in follower.tail


@pytest.mark.parametrize(("launcher_env", "prefix"), [({}, "[rank1] [titan]"), (None, "[titan]")])
def test_engine_lines_carry_one_rank_tag(launcher_env: dict[str, str] | None, prefix: str) -> None:
    """Under plain torchrun the engine tags its lines with the rank; under titan's launchers
    (whose torchrun already writes ``[rankN]:``) it does not, so no line reads
    ``[rank1]:[rank1]``."""
    from titan_core.launch.torchrun import launcher_variables

    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2"}
    env.update(launcher_variables(Launch()) if launcher_env is None else launcher_env)
    code = "from titan_core.logging import init_logger, logger; init_logger(); logger.info('hi')"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith(f"{prefix} ") and out.rstrip().endswith("INFO hi"), out


def test_titan_train_run_train_sh_and_the_train_task_render_one_command(tmp_path: Path) -> None:
    """One launch path: ``titan train --ngpu 2``, ``NGPU=2 ./run_train.sh`` and the pipeline's
    train task build the same torchrun command (titan_core.launch's local backend) for one
    config. The task's only addition is a per-attempt ``--log-dir``."""
    import dataclasses
    import re

    from titan_core.config.job import JobConfig
    from titan_core.config.schema import to_toml
    from titan_core.config.toml import load_toml
    from titan_core.launch import train_spec

    root = Path(__file__).resolve().parents[1]
    config = tmp_path / "config.toml"
    cfg = JobConfig()
    cfg = dataclasses.replace(cfg, launch=dataclasses.replace(cfg.launch, nproc_per_node=2))
    config.write_text(to_toml(cfg))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("OMP_NUM_THREADS", None)

    def rendered(cmd: list[str], **extra: str) -> str:
        proc = subprocess.run(
            cmd, env={**env, **extra}, capture_output=True, text=True, cwd=tmp_path, timeout=120
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    titan = rendered(
        [sys.executable, "-m", "titan_core.cli", "train", "--ngpu", "2", "--dry-run",
         "--job.config_file", str(config)]
    )  # fmt: skip
    script = rendered([str(root / "run_train.sh"), "--dry-run"], NGPU="2", CONFIG_FILE=str(config))
    cfg = load_toml(str(config), JobConfig())
    spec = train_spec(str(config), cfg.launch, log_dir=str(tmp_path / "logs" / "attempt-1"))
    task = get_launcher(cfg.launch).render(spec)
    assert "--log-dir=" in task
    task = re.sub(r" --log-dir=\S+", "", task)
    assert titan == script == task
    assert "-m torch.distributed.run --nnodes=1 --nproc_per_node=2" in titan
    assert titan.endswith(f"-m titan_core.train --job.config_file {config}")


def test_titan_launch_runs_the_pipeline_preflight(
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    assets: Path,
    tmp_path: Path,
) -> None:
    """``titan launch`` goes through the pipeline's preflight (a fake-backend dry run and the
    memory budget) before it starts anything: too small a device is one line, nothing runs."""
    from titan_core.cli import main
    from titan_core.logging import init_logger, logger

    dump = tmp_path / "out"
    argv = ["launch", "--module", "llama3", "--config", "llama3_debugmodel_tiny"]
    argv += ["--job.dump_folder", str(dump), "--launch.device_memory_gib", "0.0001"]
    init_logger()  # the titan logger does not propagate: listen on it directly
    logger.addHandler(caplog.handler)
    try:
        assert main(argv) == 2
    finally:
        logger.removeHandler(caplog.handler)
    err = capsys.readouterr().err
    assert err.startswith("error: launch.device_memory_gib: the estimated peak of ") and (
        err.count("\n") == 1 and " MiB per rank does not fit in 0.1 MiB" in err
    ), err
    assert any("Fake-backend dry run at world size 1" in r.getMessage() for r in caplog.records)
    assert not dump.exists() or not any(dump.rglob("*.distcp"))  # nothing trained or saved


def test_a_rank_line_torchrun_read_in_two_parts_is_one_line() -> None:
    """torchrun's tee prefixes each read of a rank's log; a read that ended mid-line gives
    ``[rank0]:text[rank0]:`` for one line the rank wrote: the launcher shows it once."""
    from titan_core.launch.supervise import _one_write

    assert _one_write("[rank0]:error: lost it[rank0]:") == "[rank0]:error: lost it"
    assert _one_write("[rank3]:step 1 [rank3]:loss 2.0") == "[rank3]:step 1 loss 2.0"
    assert _one_write("[rank0]:asks about [rank1]:") == "[rank0]:asks about [rank1]:"
    assert _one_write("agent says [rank0]:") == "agent says [rank0]:"
