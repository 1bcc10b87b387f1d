"""Fault-tolerant replica groups (torchft): real processes on gloo, a real lighthouse, a group
killed with SIGKILL and restarted by its own torchrun agent.

Each job here is 2 replica groups x 2 ranks (FSDP inside a group), started by ``titan train
--ngpu 4`` (the replica-groups launcher: a lighthouse and one torchrun agent per group).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TINY, free_port, process_env, titan_in_process, wait_until

from titan_core.data.reader import DUMP_ENV
from titan_core.distributed.fault_tolerance import DIGEST_ENV, KILL_ENV, LIGHTHOUSE_ENV, SLOW_ENV

pytestmark = pytest.mark.multiprocess

GROUPS = ["--parallelism.data_parallel_replicate_degree", "2"]
FT = [*GROUPS, "--fault_tolerance.enable", "--fault_tolerance.heartbeat_timeout_ms", "500"]


@pytest.fixture(scope="module")
def dataset(prepared_corpus: str) -> str:
    """Replica groups read a prepared dataset's global order."""
    return prepared_corpus


def _train_argv(dump: Path, dataset: str, steps: int, *extra: str, ngpu: int = 4) -> list[str]:
    argv = [sys.executable, "-m", "titan_core.cli", "train", "--ngpu", str(ngpu), "--log-rank"]
    argv += ["all"]
    argv += ["--module", "llama3", "--config", "llama3_debugmodel_tiny"]
    argv += ["--job.dump_folder", str(dump), "--training.steps", str(steps)]
    argv += ["--dataloader.dataset", dataset, "--validation.no_enable", "--metrics.log_freq", "1"]
    return [*argv, "--checkpoint.interval", "100", "--checkpoint.no_last_save_model_only", *extra]


def _train(
    dump: Path,
    dataset: str,
    steps: int,
    *extra: str,
    env: dict[str, str] | None = None,
    ngpu: int = 4,
) -> subprocess.CompletedProcess[str]:
    argv = _train_argv(dump, dataset, steps, *extra, ngpu=ngpu)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)


def _losses(dump: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}  # not evaluation rows


def test_replica_groups_train_as_hsdp_and_resume_from_storage(tmp_path: Path, dataset: str) -> None:
    """Without failures the groups' losses are those of a plain HSDP run (dp_replicate 2) from
    the same seed; when every group died (both killed before step 6, no restarts left), the
    next job resumes from the checkpoint that the lowest group alone saved, on the
    uninterrupted run's losses, and stops where a stop request asks (all groups at one step).
    In-loop evaluation runs inside each group (its batches shared by the group's ranks) and
    gives the HSDP run's numbers, at step 4 and at the stop."""
    evals = ["--evaluators.sets", "corpus=heldout:titan_corpus?batches=3", "--evaluators.freq"]
    evals += ["4", "--evaluators.batch_size", "2"]
    hsdp = _train(tmp_path / "hsdp", dataset, 8, *GROUPS, *evals)
    assert hsdp.returncode == 0, hsdp.stdout[-3000:]
    saves = ["--checkpoint.interval", "4", *evals]
    first = _train(tmp_path / "ft", dataset, 8, *FT, *saves, env={KILL_ENV: "0,1:6"})
    assert first.returncode == 1, first.stdout[-3000:]
    assert "2 of 2 replica groups live" in first.stdout
    assert "was killed by SIGKILL" in first.stderr, first.stderr
    assert sorted(p.name for p in (tmp_path / "ft" / "checkpoint").iterdir()) == ["step-4"]
    # A stop request for the resumed job: every group sees it at once (their answers are
    # averaged with the step), so both stop at step 5; group 0 saved it and records it.
    (tmp_path / "ft" / "stop-requested").write_text("enough for now")
    again = _train(tmp_path / "ft", dataset, 8, *FT, *saves)
    assert again.returncode == 0, again.stdout[-3000:]
    assert "healed" not in again.stdout  # no group was ahead: both loaded step 4 from storage
    assert again.stdout.count("checkpoint/step-4 (step 4)") == 4  # every rank of both groups
    assert again.stdout.count("stopped early at step 5 (stop requested)") == 4
    record = json.loads((tmp_path / "ft" / "stopped-early").read_text())
    assert record == {"step": 5, "reason": "enough for now"}
    assert not (tmp_path / "ft" / "stop-requested").exists()
    got, want = _losses(tmp_path / "ft"), _losses(tmp_path / "hsdp")
    assert sorted(got) == [1, 2, 3, 4, 5]  # 1-5 before the kill; 5 again after the resume
    for step, loss in got.items():
        assert loss == pytest.approx(want[step], rel=1e-5, abs=1e-5), step
    rows = [
        json.loads(line) for line in (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()
    ]
    last = [r for r in rows if "ft/live_groups" in r][-1]
    assert last["ft/live_groups"] == 2 and last["ft/steps_redone"] == 0
    evaluated = {r["step"]: r["eval/corpus/loss"] for r in rows if "eval/corpus/loss" in r}
    plain = {
        r["step"]: r["eval/corpus/loss"]
        for r in map(json.loads, (tmp_path / "hsdp" / "metrics.jsonl").read_text().splitlines())
        if "eval/corpus/loss" in r
    }
    assert sorted(plain) == [4, 8] and sorted(evaluated) == [4, 5], (plain, evaluated)
    assert evaluated[4] == pytest.approx(plain[4], rel=1e-5)


def test_a_killed_group_heals_from_its_peer_and_rejoins(tmp_path: Path, dataset: str) -> None:
    """Group 1 is killed (SIGKILL, every rank) before step 5: group 0 steps on without
    restarting (its process ids unchanged), group 1's torchrun restarts it, it heals from group
    0 (no checkpoint exists to read: the interval is 100) and rejoins; at the end both groups'
    weights and optimizer state are bitwise equal. The global batches drawn while it was
    missing are skipped by its ranks, not read later. The console: every line tagged with its
    group, the kill said when it happens, no lighthouse INFO lines; no empty quorum folders."""
    # While group 1 is missing each step of group 0 takes 1 s more: it is back (a restart is
    # seconds) well before group 0 could finish alone, however loaded the machine.
    env = {KILL_ENV: "1:5", SLOW_ENV: "1.0", DIGEST_ENV: "1", DUMP_ENV: str(tmp_path / "read")}
    proc = _train(tmp_path / "run", dataset, 30, *FT, "--launch.max_restarts", "1", env=env)
    out = proc.stdout
    assert proc.returncode == 0, out[-5000:]
    assert f"{KILL_ENV}=1:5: 1 dies before step 5" in out
    assert "fault tolerance: 1 of 2 replica groups live (was 2)" in out
    assert "fault tolerance: 2 of 2 replica groups live (was 1)" in out
    starts = re.findall(
        r"fault tolerance: group (\d) of 2, rank (\d), pid (\d+), restart (\d)", out
    )
    pids = {(g, r): {p for gg, rr, p, _ in starts if (gg, rr) == (g, r)} for g, r, _, _ in starts}
    assert all(len(pids[("0", r)]) == 1 for r in "01"), starts  # the survivor never restarted
    assert all(len(pids[("1", r)]) == 2 for r in "01"), starts  # killed once, started again
    assert {s for g, _, _, s in starts if g == "1"} == {"0", "1"}
    assert re.search(r"group 1 healed from a live group in [\d.]+s", out)
    _check_group_console(out, proc.stderr)
    assert not (tmp_path / "run" / "checkpoint" / "step-5").exists()  # nothing saved to heal
    # torchft's Manager would leave comm_traces/rank__quorum_<id>/ (empty) at every quorum.
    assert not list(tmp_path.glob("run/**/comm_traces/*quorum*")), list(tmp_path.rglob("*quorum*"))
    digests = dict(
        ((g, r), d) for g, r, d in re.findall(r"group (\d) rank (\d) state digest (\w+)", out)
    )
    assert len(digests) == 4 and digests[("0", "0")] == digests[("1", "0")], digests
    assert digests[("0", "1")] == digests[("1", "1")], digests
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert steps[-1] == 30 and sorted(set(steps)) == list(range(1, 31))
    # The data: every global batch's start, by data-parallel rank (group g reads those of
    # ranks 2g and 2g + 1). Group 0 read every global batch in order; group 1 read the same ones
    # except those drawn while it was missing (from step 5's on): skipped, never read later.
    rows = [json.loads(line) for f in (tmp_path / "read").glob("*.jsonl") for line in f.open()]
    read = {d: sorted(r["start"] for r in rows if r["dp_rank"] == d) for d in range(4)}
    assert read[0] == read[1] and read[2] == read[3], read
    batch = read[0][1]
    assert read[0] == list(range(0, batch * len(read[0]), batch)), read[0]
    missed = sorted(set(read[0]) - set(read[2]))
    assert set(read[2]) < set(read[0]) and missed[0] == 4 * batch, (read[2], missed)
    assert missed == list(range(missed[0], missed[-1] + batch, batch))  # one gap, then in step
    # The health log of each group has what it went through: the quorum changes, the heal.
    for group, want in (("run", {"left", "joined"}), ("run/group-1", {"healed"})):
        rows = [json.loads(line) for line in (tmp_path / group / "health.jsonl").open()]
        events = {r["action"] for r in rows if r["kind"] == "replica_groups"}
        assert want <= events, rows


def _check_group_console(out: str, err: str) -> None:
    """What ``titan train --ngpu 4`` with two replica groups printed while group 1 was killed
    before step 5 and restarted: each rank's line tagged with its group, the kill said when it
    happened (before the restarted group's first line), and nothing of the lighthouse's INFO log
    (its quorum status, many lines a step)."""
    lines = out.splitlines()
    assert not [line for line in lines if line.startswith("[rank")], out[-3000:]  # all tagged
    for tag in ("[g0 rank0]:", "[g0 rank1]:", "[g1 rank0]:", "[g1 rank1]:"):
        assert any(line.startswith(tag + "[titan] ") for line in lines), tag
    assert any(line.startswith("[g1 rank") and "1 dies before step 5" in line for line in lines)
    said = [i for i, line in enumerate(lines) if line.startswith("[g1] launch: rank ")]
    assert len(said) == 1, out[-3000:]
    assert re.fullmatch(
        r"\[g1\] launch: rank \d \(pid \d+\) was killed by SIGKILL; torchrun restarts the "
        r"group \(restart 1 of 1\)",
        lines[said[0]],
    ), lines[said[0]]
    restarted = next(
        i for i, line in enumerate(lines) if re.search(r"group 1 of 2.*restart 1", line)
    )
    assert said[0] < restarted  # said when it happened, not held back to the end
    assert not re.search(r"\bINFO\b.*torchft::|torchft::\S*\] - Quorum", out + err), err[-3000:]


def test_a_rollback_takes_every_group_back_to_the_same_checkpoint(
    tmp_path: Path, dataset: str
) -> None:
    """The health guard with replica groups: a NaN loss in one group is in the averaged loss
    every group checks, so all of them roll back at step 6 to the step-4 checkpoint group 0
    saved, skip the same samples, and finish with bitwise equal weights."""
    run = tmp_path / "run"
    extra = ["--checkpoint.interval", "4", "--health.nonfinite", "rollback"]
    extra += ["--debug.inject", "nan_loss:6", "--debug.drill"]
    proc = _train(run, dataset, 8, *FT, *extra, env={DIGEST_ENV: "1"}, ngpu=2)
    out = proc.stdout
    assert proc.returncode == 0, out[-5000:]
    assert out.count("health: step 6: rolled back to step 4") == 2, out[-5000:]  # each group
    digests = re.findall(r"group (\d) rank 0 state digest (\w+)", out)
    assert len(digests) == 2 and digests[0][1] == digests[1][1], digests
    for folder in (run, run / "group-1"):
        rows = [json.loads(line) for line in (folder / "health.jsonl").open()]
        assert {"step": 6, "action": "rollback", "to_step": 4} in [
            {k: r.get(k) for k in ("step", "action", "to_step")} for r in rows
        ], rows
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").open()]
    assert steps == [1, 2, 3, 4, 5, 5, 6, 7, 8], steps


def test_a_lost_lighthouse_ends_the_job_in_one_line_naming_it(tmp_path: Path, dataset: str) -> None:
    """A lighthouse of the user's own (``python -m titan_core.launch.lighthouse``, what the Slurm
    script runs) is SIGKILLed mid-run: each group's next quorum fails (after the quorum
    timeout), its ranks find the lighthouse gone and exit 5. The job ends with one line (not
    one per group) naming the lighthouse and the step, exit code 5, and no traceback."""
    env_file, dump = tmp_path / "lighthouse.env", tmp_path / "run"
    lighthouse = subprocess.Popen(
        [sys.executable, "-m", "titan_core.launch.lighthouse", "--host", "127.0.0.1",
         "--min_replicas", "1", "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", "500",
         "--out", str(env_file)],
        env=process_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    proc = None
    try:
        wait_until(env_file.exists, timeout=120, what="the lighthouse's addresses")
        address = dict(line.split("=", 1) for line in env_file.read_text().split())[LIGHTHOUSE_ENV]
        extra = [*FT, "--fault_tolerance.lighthouse", address]
        extra += ["--fault_tolerance.quorum_timeout_seconds", "5"]  # how soon the loss is seen
        with out.open("w") as stdout, err.open("w") as stderr:
            argv = _train_argv(dump, dataset, 500, *extra, ngpu=2)
            proc = job = subprocess.Popen(argv, stdout=stdout, stderr=stderr, env=process_env())
        logs = [dump / "metrics.jsonl", dump / "group-1" / "metrics.jsonl"]
        wait_until(  # both groups in the quorum: each logged a step
            lambda: all(f.exists() and f.read_text() for f in logs) or job.poll() is not None,
            timeout=300,
            what="a step of each group",
        )
        lighthouse.kill()
        assert job.wait(timeout=300) == 5, out.read_text()[-5000:] + err.read_text()
    finally:
        for p in (lighthouse, proc):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    shown, said = out.read_text(), err.read_text()
    assert "Traceback" not in shown + said, shown[-5000:] + said
    last = {max(json.loads(line)["step"] for line in f.open()) for f in logs}
    step = re.search(r" at step (\d+) ", said)
    assert step is not None and int(step.group(1)) - 1 in last, (said, last)
    assert said == (
        f"error: training: lost the replica groups' lighthouse {address} at step {step.group(1)} "
        "(no quorum, and it does not answer: connection refused); start it again, then relaunch\n"
    )
    assert shown.count("]:error: lost the replica groups' lighthouse") == 2  # each group's rank


def test_a_group_that_starts_without_its_lighthouse_fails_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A group that torchrun restarts after the lighthouse was lost (or one started by hand
    against a dead one) fails in one line, exit code 5, before torchft's manager would wait out
    its connect timeout; "start it again" only for a lighthouse of the user's own."""
    from titan_core.config.job import FaultTolerance
    from titan_core.distributed.fault_tolerance import LighthouseLost, ReplicaGroup

    address = f"http://127.0.0.1:{free_port()}"
    said = f"the replica groups' lighthouse {address} does not answer (connection refused)"
    users = FaultTolerance(enable=True, group_id=1, lighthouse=address)
    with pytest.raises(LighthouseLost) as info:
        ReplicaGroup(users, 2, torch.device("cpu"), {}, lambda: None)
    assert str(info.value) == f"{said}; start it again, then relaunch"
    assert info.value.exit_code == 5
    monkeypatch.setenv(LIGHTHOUSE_ENV, address)  # the launcher's own
    own = FaultTolerance(enable=True, group_id=1)
    with pytest.raises(LighthouseLost, match=f"^{re.escape(said)}$"):
        ReplicaGroup(own, 2, torch.device("cpu"), {}, lambda: None)


def test_train_ngpu_refuses_an_unreachable_lighthouse_before_starting(
    tmp_path: Path, dataset: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``titan train --ngpu`` makes titan launch's check (the launcher's probe) before anything
    starts: one line, exit code 2, no worker (no output at all, no dump folder)."""
    address = f"http://127.0.0.1:{free_port()}"
    argv = ["train", "--ngpu", "4", *TINY, "--job.dump_folder", str(tmp_path / "run")]
    argv += ["--dataloader.dataset", dataset, *FT, "--fault_tolerance.lighthouse", address]
    code, out, err = titan_in_process(argv, capsys)
    assert (code, out) == (2, "")
    refused = "unreachable (connection refused)"
    assert err == f"error: fault_tolerance.lighthouse: {address}: {refused}\n"
    assert not (tmp_path / "run").exists()


def _model_digests(out: str) -> dict[tuple[str, str], str]:
    found = re.findall(r"group (\d) rank (\d) state digest \w+, model digest (\w+)", out)
    return {(g, r): d for g, r, d in found}


def test_semi_sync_groups_heal_and_agree_after_every_sync(tmp_path: Path, dataset: str) -> None:
    """semi_sync diloco, 2 groups x 2 ranks (FSDP inside), a weight sync every 3 steps: group 1
    is killed before step 5, restarted and healed from group 0 (with the outer optimizer's
    state and the last sync's weights); after the last step's sync both groups' weights are
    bitwise equal (their inner optimizers' moments are their own)."""
    semi = ["--fault_tolerance.semi_sync", "diloco", "--fault_tolerance.sync_every", "3"]
    env = {KILL_ENV: "1:5", SLOW_ENV: "1.0", DIGEST_ENV: "1"}
    run = tmp_path / "run"
    # 24 steps: group 0, slowed while group 1 is missing, is still training when it is back
    # (a restart takes seconds, however loaded the machine), as in the synchronous heal test.
    proc = _train(run, dataset, 24, *FT, *semi, "--launch.max_restarts", "1", env=env)
    out = proc.stdout
    assert proc.returncode == 0, out[-5000:]
    assert f"{KILL_ENV}=1:5: 1 dies before step 5" in out
    assert "this group's loss is logged" in out  # the step it died in: no average, no redo
    assert re.search(r"group 1 healed from a live group in [\d.]+s", out)
    digests = _model_digests(out)
    assert len(digests) == 4, out[-3000:]
    assert digests[("0", "0")] == digests[("1", "0")] and digests[("0", "1")] == digests[("1", "1")]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == list(range(1, 25))
    # A sync after every third step (group 0 alone at step 6), the last one at 24.
    assert [r["ft/syncs"] for r in rows if r["step"] in (2, 3, 6, 24)] == [0, 1, 2, 8]


def test_semi_sync_groups_stop_together_at_the_next_sync(tmp_path: Path, dataset: str) -> None:
    """A stop request seen at step 1 (each group votes, the votes are averaged) stops every
    semi-synchronous group at the next sync, step 3, with the same weights; group 0 records it."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "stop-requested").write_text("enough")
    semi = ["--fault_tolerance.semi_sync", "local_sgd", "--fault_tolerance.sync_every", "3"]
    proc = _train(run, dataset, 8, *FT, *semi, env={DIGEST_ENV: "1"}, ngpu=2)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert proc.stdout.count("stopped early at step 3 (stop requested)") == 2
    assert json.loads((run / "stopped-early").read_text()) == {"step": 3, "reason": "enough"}
    digests = _model_digests(proc.stdout)
    assert len(digests) == 2 and len(set(digests.values())) == 1, digests


def test_semi_sync_math_local_sgd_diloco_and_the_state_that_heals() -> None:
    """Two groups' weights drift apart; a sync gives both the average (local_sgd), or the last
    sync's weights moved by an outer SGD step on the average drift (diloco): at lr 1 without
    momentum that is the average again. The state a healing group receives (last sync's
    weights, outer momentum) makes its next sync the same as its peer's."""
    from titan_core.config.job import FaultTolerance
    from titan_core.distributed.fault_tolerance import SemiSync

    def groups(mode: str, **outer: float) -> list[SemiSync]:
        cfg = FaultTolerance(enable=True, semi_sync=mode, sync_every=2, **outer)  # type: ignore[arg-type]
        params = [
            lambda: torch.nn.Parameter(torch.ones(3)),
            lambda: torch.nn.Parameter(torch.zeros(2)),
        ]
        return [SemiSync(cfg, [make() for make in params]) for _ in range(2)]

    def drift(gs: list[SemiSync], by: float) -> None:
        with torch.no_grad():
            for i, g in enumerate(gs):
                for p in g.params:
                    p.add_(by * (i + 1))

    def sync(gs: list[SemiSync]) -> None:
        payloads = [g.payload() for g in gs]
        average = [torch.stack(ts).mean(0) for ts in zip(*payloads, strict=True)]
        for g in gs:
            g.apply([a.clone() for a in average])

    local, plain = groups("local_sgd"), groups("diloco", outer_lr=1.0, outer_momentum=0.0)
    for gs in (local, plain):
        drift(gs, 0.5)
        sync(gs)
    for p, q, r in zip(local[0].params, local[1].params, plain[0].params, strict=True):
        assert torch.equal(p, q) and torch.allclose(p, r)
    assert local[0].params[0].tolist() == [1.75] * 3  # 1 + mean(0.5, 1.0)
    assert local[0].due(4, False) and local[0].due(5, True) and not local[0].due(5, False)

    nesterov = groups("diloco", outer_lr=0.7, outer_momentum=0.9)
    drift(nesterov, 0.5)
    sync(nesterov)  # pseudo-gradient -0.75; Nesterov's first step: lr * (g + 0.9 * g)
    assert nesterov[0].params[0].tolist() == pytest.approx([1 + 0.7 * 0.75 * 1.9] * 3)
    healed = groups("diloco", outer_lr=0.7, outer_momentum=0.9)[1]
    healed.load_state_dict(nesterov[0].state_dict())
    with torch.no_grad():
        for p, q in zip(healed.params, nesterov[0].params, strict=True):
            p.copy_(q)  # the model heals alongside
    twins = [nesterov[0], healed]
    drift(twins, 0.25)
    sync(twins)
    assert healed.syncs == nesterov[0].syncs == 2
    for p, q in zip(healed.params, nesterov[0].params, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--fault_tolerance.enable"],
         "fault_tolerance.enable: expected parallelism.data_parallel_replicate_degree >= 2"),
        ([*FT, "--fault_tolerance.min_replicas", "3"],
         "fault_tolerance.min_replicas: expected at most the 2 replica groups"),
        ([*FT, "--fault_tolerance.lighthouse", "http://127.0.0.1:1"],
         "fault_tolerance.lighthouse: http://127.0.0.1:1: unreachable (connection refused)"),
        ([*FT, "--dataloader.dataset", "RAW"],
         "fault_tolerance.enable: needs a prepared dataset (titan data prepare)"),
        ([*FT, "--launch.backend", "slurm", "--launch.nnodes", "3"],
         "launch.nnodes: 3 nodes do not split into 2 replica groups"),
        ([*FT, "--fault_tolerance.semi_sync", "diloco", "--health.nonfinite", "rollback"],
         "health.nonfinite: expected skip or stop with fault_tolerance.semi_sync"),
        ([*FT, "--launch.backend", "local_multinode", "--launch.nnodes", "2"],
         "launch.backend: fault_tolerance.enable runs its replica groups with the local"),
    ],
    ids=["one-replica", "min-replicas", "lighthouse-unreachable", "raw-text", "slurm-nodes",
         "semi-sync-rollback", "multinode"],
)  # fmt: skip
def test_bad_fault_tolerance_input_is_one_line_before_anything_starts(
    extra: list[str],
    expected: str,
    tmp_path: Path,
    dataset: str,
    assets: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``titan launch`` (in this process: its checks run before anything is started)."""
    from titan_core.data.assets import bundled_corpus_dir

    raw = str(bundled_corpus_dir() / "train")
    extra = [raw if e == "RAW" else e for e in extra]
    argv = ["launch", "--module", "llama3", "--config", "llama3_debugmodel_tiny"]
    argv += ["--launch.nproc_per_node", "4", "--job.dump_folder", str(tmp_path / "run")]
    argv += ["--dataloader.dataset", dataset, *extra]
    code, _, err = titan_in_process(argv, capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and expected in err, err
    assert not (tmp_path / "run").exists()
