"""The ``slurm`` launcher on a real two-node Slurm cluster started on this host (as root, with
Debian's slurm-wlm; skipped with the reason elsewhere — `.ci/run` installs it): FSDP over two
nodes matches the single process, the pipeline's ``train`` task runs on Slurm, a killed job
step fails with the Slurm state, and an interrupted caller cancels its job."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import TINY, wait_until
from parallel_harness import assert_parity, train_layout
from pipeline_helpers import run_flow, task_runs, tiny_values
from slurm_cluster import SlurmCluster, start_cluster, unavailable

from titan_core.config.job import Launch, Slurm
from titan_core.launch import LaunchError, LaunchSpec, get_launcher

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "Slurm available"),
]
FAST = {"slurm": Slurm(poll_seconds=1.0, time_limit="10")}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """Controller + nodes n1, n2; clients in this process (and its children) point at it."""
    c = start_cluster(tmp_path_factory.mktemp("slurm"))
    try:
        with pytest.MonkeyPatch.context() as mp:
            for key, value in c.env.items():
                mp.setenv(key, value)
            yield c
    finally:
        c.stop()


def _job_state(cluster: SlurmCluster, job_id: str) -> str:
    out = cluster.run("scontrol", "-o", "show", "job", job_id).stdout
    return re.search(r"JobState=(\S+)", out).group(1)  # type: ignore[union-attr]


def _job_id(output: str) -> str:
    return re.search(r"submitted Slurm job (\d+)", output).group(1)  # type: ignore[union-attr]


def test_fsdp_over_two_slurm_nodes_matches_one_process(
    cluster: SlurmCluster, tmp_path: Path, parity_seed: Path, parity_reference: dict
) -> None:
    run = train_layout(tmp_path, parity_seed, nproc=2, dp=2, nnodes=2, backend="slurm", launch=FAST)
    out = run.output
    job = _job_id(out)
    assert re.search(rf"titan: job {job} on 2 nodes \(n\[1-2\]\), rendezvous [\d.]+:\d+", out)
    assert f"titan: Slurm job {job} RUNNING" in out
    assert f"titan: Slurm job {job} ended COMPLETED" in out
    for rank in (0, 1):  # one rank per node, both streamed from the job's output file
        assert re.search(rf"\[rank{rank}\]:.*Applied FSDP on mesh \{{'dp_shard': 2\}}", out)
    assert_parity(run.losses, parity_reference, what="slurm 2 nodes x 1 process")
    assert _job_state(cluster, job) == "COMPLETED"


def test_killed_job_step_fails_with_the_slurm_state(cluster: SlurmCluster, tmp_path: Path) -> None:
    launch = Launch(backend="slurm", nnodes=2, log_ranks="all", **FAST)  # type: ignore[arg-type]
    args = [*TINY, "--job.dump_folder", str(tmp_path), "--training.steps", "100000"]
    args += ["--checkpoint.no_enable", "--validation.no_enable", "--metrics.log_freq", "1"]
    spec = LaunchSpec(args=args, launch=launch, log_dir=str(tmp_path / "logs"), timeout_s=300)
    lines: list[str] = []

    def kill_step_once_training(line: str) -> None:
        lines.append(line)
        if "step:" in line and not any("scancel" in s for s in lines):
            job = _job_id("\n".join(lines))
            lines.append("scancel sent")
            cluster.run("scancel", "--signal=KILL", f"{job}.0")

    with pytest.raises(LaunchError) as info:
        get_launcher(launch).run(spec, kill_step_once_training)
    job = _job_id("\n".join(lines))
    error = str(info.value)
    assert error.startswith(f"training: Slurm job {job} ended FAILED (exit code "), error
    assert re.search(r": job step task \d on n[12]: Killed; output in ", error), error
    assert error.endswith(f"slurm-{job}.out")
    assert info.value.retryable  # a killed step is not bad input: the pipeline may relaunch
    assert _job_state(cluster, job) == "FAILED"
    assert not cluster.run("squeue", "-h", "-j", job, check=False).stdout.strip()


def test_replica_groups_are_job_steps_that_outlive_each_other(
    cluster: SlurmCluster, tmp_path: Path, prepared_corpus: str
) -> None:
    """fault_tolerance on Slurm: 2 replica groups of one node each, each its own job step, the
    lighthouse started by the batch script. Group 1 dies at step 4 with no restarts left: its
    step fails, group 0 trains on to the last step, and the job ends COMPLETED."""
    from titan_core.distributed.fault_tolerance import KILL_ENV
    from titan_core.launch import job_launcher
    from titan_core.resolve import parse_args

    dump = tmp_path / "run"
    args = [*TINY, "--job.dump_folder", str(dump), "--training.steps", "10"]
    args += ["--dataloader.dataset", prepared_corpus, "--validation.no_enable"]
    args += ["--metrics.log_freq", "1", "--checkpoint.interval", "100"]
    args += ["--parallelism.data_parallel_replicate_degree", "2", "--fault_tolerance.enable"]
    args += ["--fault_tolerance.heartbeat_timeout_ms", "500"]
    args += ["--launch.backend", "slurm", "--launch.nnodes", "2", "--launch.log_ranks", "all"]
    args += ["--launch.slurm.poll_seconds", "1", "--launch.slurm.time_limit", "10"]
    cfg = parse_args(args)
    spec = LaunchSpec(
        args=args,
        launch=cfg.launch,
        log_dir=str(tmp_path / "logs"),
        timeout_s=300,
        env={KILL_ENV: "1:4"},
    )
    lines: list[str] = []
    result = job_launcher(cfg).run(spec, lines.append)
    out = "\n".join(lines)
    job = result.job_id
    assert re.search(rf"titan: job {job} on 2 nodes \(n\[1-2\]\), 2 replica groups of 1 node", out)
    assert re.search(r"titan: torchft lighthouse at http://[\d.]+:\d+", out), out[-3000:]
    for g, node in ((0, "n1"), (1, "n2")):
        assert re.search(rf"titan: replica group {g} on {node}, rendezvous [\d.]+:\d+", out)
        assert f"fault tolerance: group {g} of 2, rank 0" in out
    assert f"{KILL_ENV}=1:4: 1 dies before step 4" in out
    assert "1 of 2 replica groups live (was 2)" in out, out[-3000:]
    assert "titan: replica group 0 ended with exit code 0" in out
    assert re.search(r"titan: replica group 1 ended with exit code [1-9]", out), out[-3000:]
    assert "titan: 1 of 2 replica groups finished" in out
    assert f"titan: Slurm job {job} ended COMPLETED" in out
    steps = [json.loads(line)["step"] for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 10, steps
    assert not list((tmp_path / "logs").glob("lighthouse-*"))  # removed when the job ended


SLEEPER = textwrap.dedent(
    """
    import os, time
    print(f"worker on {os.environ['SLURMD_NODENAME']} rank {os.environ['RANK']}", flush=True)
    time.sleep(600)
    """
)
DRIVER = textwrap.dedent(
    """
    import sys
    from titan_core.config.job import Launch, Slurm
    from titan_core.launch import LaunchSpec, get_launcher
    launch = Launch(backend="slurm", nnodes=2, log_ranks="all",
                    slurm=Slurm(poll_seconds=1.0, time_limit="10"))
    spec = LaunchSpec(args=[], launch=launch, module="sleeper", env={"PYTHONPATH": sys.argv[1]},
                      log_dir=sys.argv[1] + "/logs")
    get_launcher(launch).run(spec, lambda line: print(line, flush=True))
    """
)


def test_interrupted_caller_cancels_its_job(cluster: SlurmCluster, tmp_path: Path) -> None:
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen: list[str] = []
    assert driver.stdout is not None
    for line in driver.stdout:
        seen.append(line)
        if sum("worker on" in s for s in seen) == 2:
            break
    out = "".join(seen)
    assert "worker on n1 rank" in out and "worker on n2 rank" in out, out
    job = _job_id(out)
    driver.send_signal(signal.SIGTERM)
    rest, _ = driver.communicate(timeout=120)
    assert driver.returncode == 128 + signal.SIGTERM, out + rest
    assert f"titan: cancelled Slurm job {job}" in rest
    wait_until(
        lambda: not cluster.run("squeue", "-h", "-j", job, check=False).stdout.strip(),
        timeout=60,
        what=f"job {job} gone from the queue after its caller stopped",
        interval=0.5,
    )
    assert _job_state(cluster, job) == "CANCELLED"


def test_pipeline_trains_replica_groups_on_slurm(
    cluster: SlurmCluster, prefect_harness: Path, tmp_path: Path, prepared_corpus: str
) -> None:
    """The pipeline's train stage with fault tolerance on Slurm: two replica groups, each a job
    step on a node of its own; export and evaluation read what group 0 saved."""
    from pipeline_helpers import flow_logs

    from flows.pipeline import pretrain_pipeline

    overrides = tiny_values(steps=4, nproc=1) | {"launch.backend": "slurm", "launch.nnodes": 2}
    overrides |= {"launch.slurm.poll_seconds": 1, "launch.slurm.time_limit": "10"}
    overrides |= {"parallelism.data_parallel_replicate_degree": 2, "fault_tolerance.enable": True}
    overrides |= {"dataloader.dataset": prepared_corpus}
    overrides |= {"job.dump_folder": str(tmp_path / "runs"), "evaluate.batches": 1}
    overrides["tracking.uri"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    state, flow_run_id = run_flow(pretrain_pipeline, recipe=TINY[3], overrides=overrides)
    assert state.is_completed(), state.message
    runs = task_runs(flow_run_id)
    assert [r.state.type.value for r in runs["train"]] == ["COMPLETED"]
    logs = "\n".join(flow_logs(flow_run_id))
    job = _job_id(logs)
    assert "Launching (slurm): #!/bin/bash" in logs
    assert "titan: 2 of 2 replica groups finished" in logs
    assert f"titan: Slurm job {job} ended COMPLETED" in logs
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=overrides["tracking.uri"])
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    metrics = {name for run in runs for name in run.data.metrics}
    assert {"ft/live_groups", "ft/quorum_changes", "ft/heals"} <= metrics, sorted(metrics)
    assert re.search(r"\[rank0\]:.*step:\s+4\s", logs)  # rank 0's metrics, live in Prefect
    assert _job_state(cluster, job) == "COMPLETED"


def test_failing_setup_is_final_and_named(cluster: SlurmCluster, tmp_path: Path) -> None:
    slurm = Slurm(setup=["module load nonexistent"], poll_seconds=1.0, time_limit="10")
    launch = Launch(backend="slurm", nnodes=2, slurm=slurm)
    spec = LaunchSpec(args=[], launch=launch, log_dir=str(tmp_path), timeout_s=120)
    lines: list[str] = []
    with pytest.raises(LaunchError) as info:
        get_launcher(launch).run(spec, lines.append)
    job = _job_id("\n".join(lines))
    assert str(info.value).startswith(
        f"training: Slurm job {job} FAILED before srun started (exit code 127:0): check "
        "launch.slurm.setup"
    ), info.value
    assert not info.value.retryable
