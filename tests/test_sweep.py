"""Sweeps: trials from a grid or a seeded random search, each a real ``pretrain_pipeline`` run
against a Prefect API (test harness) and MLflow on SQLite, nested under one MLflow run and
compared at the end; bad input is one line before any trial starts."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from helpers import TINY
from pipeline_helpers import flow_run, run_flow, task_runs, tiny_overrides, tiny_values

from titan_core.cli import main as titan_main
from titan_core.errors import ConfigError
from titan_core.pipeline.sweep.plan import (
    BEST_ALIAS,
    expand,
    parse_grid_arg,
    parse_random_arg,
    plan_sweep,
)
from titan_core.pipeline.sweep.report import format_table

ROOT = Path(__file__).resolve().parents[1]
RECIPE = TINY[-1]  # llama3_debugmodel_tiny

# ------------------------------------------------------------------ expansion (no runs)


def test_grid_is_the_cartesian_product_first_key_slowest() -> None:
    trials = expand({"optimizer.lr": [1e-3, 3e-3], "training.steps": [2, 3]})
    assert [t.overrides for t in trials] == [
        {"optimizer.lr": 1e-3, "training.steps": 2},
        {"optimizer.lr": 1e-3, "training.steps": 3},
        {"optimizer.lr": 3e-3, "training.steps": 2},
        {"optimizer.lr": 3e-3, "training.steps": 3},
    ]
    assert [t.label() for t in trials][1] == "trial-2 lr=0.001 steps=3"
    # Field names that clash across sections are shown in full.
    both = expand({"training.steps": [1], "validation.steps": [2]})
    assert both[0].label() == "trial-1 training.steps=1 validation.steps=2"


def test_random_search_is_seeded_and_within_its_space() -> None:
    space = {
        "optimizer.lr": {"log_uniform": [1e-4, 1e-2]},
        "training.local_batch_size": {"choice": [2, 4]},
        "training.steps": {"int_uniform": [2, 9]},
    }
    first = [t.overrides for t in expand(random=space, trials=6, seed=7)]
    assert first == [t.overrides for t in expand(random=space, trials=6, seed=7)]
    assert first != [t.overrides for t in expand(random=space, trials=6, seed=8)]
    assert len(first) == 6
    for values in first:
        assert 1e-4 <= values["optimizer.lr"] <= 1e-2
        assert values["optimizer.lr"] == float(f"{values['optimizer.lr']:.4g}")
        assert values["training.local_batch_size"] in (2, 4)
        assert 2 <= values["training.steps"] <= 9 and isinstance(values["training.steps"], int)
    # A grid and a random space: every cell with every draw.
    mixed = expand({"training.steps": [2, 3]}, {"optimizer.lr": {"uniform": [0.1, 0.2]}}, 3, 0)
    assert len(mixed) == 6 and {t.overrides["training.steps"] for t in mixed} == {2, 3}


def test_trials_are_pinned_to_the_sweeps_root_and_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trial (a subflow, or a run on a work pool whose worker has another working directory)
    writes under the sweep's absolute root and records in its store; a server URI, which may
    carry credentials, is not copied into the trials' parameters."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    plan = plan_sweep("s1", RECIPE, "", {"job.dump_folder": "runs"}, grid={"optimizer.lr": [1, 2]})
    root = str(tmp_path / "runs")
    first = plan.overrides(plan.trials[0])
    assert first["job.dump_folder"] == root
    assert first["tracking.uri"] == f"sqlite:///{root}/mlflow.db"
    assert first["optimizer.lr"] == 1 and first["tracking.registered_model"] == plan.model_name
    assert plan.run_root(plan.trials[1]) == f"{root}/{plan.experiment}/s1-t2"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://user:pw@mlflow.example")
    served = plan_sweep("s2", RECIPE, "", {}, grid={"optimizer.lr": [1]})
    assert "tracking.uri" not in served.overrides(served.trials[0])


def test_cli_values_are_parsed_in_the_fields_types() -> None:
    assert parse_grid_arg("optimizer.lr=1e-3,3e-3") == ("optimizer.lr", [1e-3, 3e-3])
    assert parse_grid_arg("training.local_batch_size=2,4") == ("training.local_batch_size", [2, 4])
    assert parse_grid_arg("model.flavor=debugmodel,tiny") == (
        "model.flavor",
        ["debugmodel", "tiny"],
    )
    assert parse_random_arg("optimizer.lr=log_uniform:1e-4,1e-2") == (
        "optimizer.lr",
        {"log_uniform": [1e-4, 1e-2]},
    )
    assert parse_random_arg("training.steps=choice:2,4") == ("training.steps", {"choice": [2, 4]})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"grid": {"optimizer.lrr": [1]}}, "sweep.grid: unknown config key 'optimizer.lrr'; "),
        ({"grid": {"job.experiment": ["a", "b"]}}, "job.experiment cannot be swept"),
        ({"grid": {"optimizer.lr": 1e-3}}, "sweep.grid.optimizer.lr: expected a non-empty list"),
        ({"random": {"optimizer.lr": {"normal": [0, 1]}}}, "sweep.random.optimizer.lr: expected"),
        ({"random": {"optimizer.lr": {"log_uniform": [0, 1]}}}, "expected low > 0"),
        ({"random": {"optimizer.lr": {"uniform": [1, 1]}}}, "low < high"),
        ({"random": {"optimizer.lr": {"choice": [1]}}, "trials": 0}, "sweep.trials: expected"),
        ({}, "sweep: nothing to sweep"),
    ],
)
def test_bad_sweeps_are_one_line(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        expand(**kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--grid", "optimizer.lrr=1e-3,3e-3"],
            "unknown config key 'optimizer.lrr'; did you mean optimizer.lr",
        ),
        (["--grid", "optimizer.lr"], "--grid 'optimizer.lr': expected KEY=VALUES"),
        (["--grid", "training.steps=2,x"], "training.steps: expected an int, got 'x'"),
        (["--random", "optimizer.lr=gauss:0,1"], "KIND one of log_uniform"),
        (["--grid", "training.steps=2", "--trials", "3"], "--trials: counts random draws"),
        # 0 is not "unset" (it used to run the default 4 draws).
        (["--random", "optimizer.lr=choice:1e-3,3e-3", "--trials", "0"], "--trials: expected"),
        # An unknown metric would run the whole sweep and pick no best.
        (["--grid", "training.steps=2", "--metric", "accuracy"], "--metric: expected train/loss"),
        # Resolved per trial before any runs: the trial and its key are named.
        (["--grid", "training.steps=2,0"], "trial-2 steps=0: training.steps: expected"),
        (["--grid", "training.steps=2", "--concurrency", "0"], "--concurrency: expected"),
        (["--grid", "training.steps=2", "--training.stepz", "3"], "training.stepz"),
        (["--grid", "training.steps=2", "--early-stop-window", "2"], "give --early-stop too"),
        (
            ["--grid", "training.steps=2", "--early-stop", "--early-stop-min-trials", "0"],
            "--early-stop-min-trials: input should be greater than or equal to 1, got 0",
        ),
    ],
)
def test_titan_sweep_bad_input_prints_one_line_and_runs_nothing(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    argv = ["sweep", "--config", RECIPE, *args, "--job.dump_folder", str(root)]
    assert titan_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err
    assert not root.exists()


def _doc_commands() -> list[str]:
    text = (ROOT / "docs" / "sweeps.md").read_text()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("titan sweep"):
                lines.append(line)
    return lines


def test_documented_sweeps_resolve_every_trial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from titan_core.cli.sweep import sweep_kwargs

    monkeypatch.chdir(tmp_path)
    commands = _doc_commands()
    assert len(commands) >= 3
    for line in commands:
        kwargs = sweep_kwargs(shlex.split(line)[2:])  # every trial resolves, or this raises
        assert kwargs["grid"] or kwargs["random"], line


def test_best_trial_is_the_lowest_finished_metric() -> None:
    from titan_core.pipeline.sweep.report import TrialRow, best_trial

    def row(index: int, status: str, metric: float | None) -> TrialRow:
        return TrialRow(index, f"trial-{index}", f"r{index}", status, (), metric=metric)

    rows = [row(1, "completed", 2.0), row(2, "failed", 0.5), row(3, "completed", float("nan"))]
    assert best_trial([*rows, row(4, "completed", 1.5), row(5, "completed", 1.5)]).index == 4
    assert best_trial(rows[1:3]) is None


def test_a_trial_stopped_early_is_best_only_when_none_completed() -> None:
    from titan_core.pipeline.sweep.report import TrialRow, best_trial

    stopped = TrialRow(1, "trial-1", "r1", "stopped", (), metric=1.0, stopped_at=4)
    completed = TrialRow(2, "trial-2", "r2", "completed", (), metric=2.0)
    failed = TrialRow(3, "trial-3", "r3", "failed", (), error="boom")
    assert best_trial([stopped, completed, failed]) == completed
    assert best_trial([stopped, failed]) == stopped
    assert stopped.outcome == "stopped at step 4" and completed.outcome == "completed"


# ------------------------------------------------------------------ the median stopping rule


def _curve(*losses: float, every: int = 1) -> list[tuple[int, float]]:
    """Losses logged at steps every, 2*every, ..."""
    return [(every * (i + 1), loss) for i, loss in enumerate(losses)]


def _rule(**settings: Any) -> Any:
    from titan_core.pipeline.sweep.early_stop import EarlyStopping

    return EarlyStopping(
        **{"enable": True, "min_steps": 2, "min_trials": 2, "window": 1} | settings
    )


def test_median_rule_stops_a_trial_worse_than_the_median_at_its_step() -> None:
    from titan_core.pipeline.sweep.early_stop import median_stop

    others = [_curve(5, 4, 3), _curve(5, 4.5, 3.5), _curve(5, 6, 7)]  # median at step 3: 3.5
    decision = median_stop(_curve(5, 5, 4), others, _rule())
    assert decision is not None
    assert (decision.step, decision.loss, decision.median, decision.num_trials) == (3, 4, 3.5, 3)
    assert decision.reason() == (
        "training loss 4.0000 at step 3 is worse than the median 3.5000 of 3 other trials"
    )
    assert median_stop(_curve(5, 5, 3.2), others, _rule()) is None  # better than the median
    assert median_stop(_curve(5, 5, 3.5), others, _rule()) is None  # a tie is never stopped
    # A relative margin: 4 is within 20% of 3.5, not within 10%.
    assert median_stop(_curve(5, 5, 4), others, _rule(margin=0.2)) is None
    assert median_stop(_curve(5, 5, 4), others, _rule(margin=0.1)) is not None


def test_median_rule_waits_for_the_grace_period_and_enough_trials() -> None:
    from titan_core.pipeline.sweep.early_stop import median_stop

    bad = _curve(9, 9, 9)
    assert median_stop(bad, [_curve(1, 1, 1)] * 2, _rule(min_steps=4)) is None  # grace
    assert median_stop(bad, [_curve(1, 1, 1)] * 2, _rule(min_steps=3)) is not None
    # Only trials that reached the step count: ahead of one of two (at step 2), the trial is
    # judged at step 2, where both are; in the grace period that is no judgement at all.
    assert median_stop(bad, [_curve(1, 1, 1), _curve(1, 1)], _rule()).step == 2
    assert median_stop(bad, [_curve(1, 1, 1), _curve(1, 1)], _rule(min_steps=3)) is None
    assert median_stop(bad, [_curve(1, 1, 1), _curve(1, 1, 1, 1)], _rule()).step == 3
    assert median_stop(bad, [_curve(1, 1, 1)] * 2, _rule(min_trials=3)) is None
    assert median_stop([], [_curve(1, 1, 1)] * 2, _rule()) is None


def test_median_rule_judges_a_trial_ahead_of_the_others_where_they_are() -> None:
    """Trials running side by side: the one in the lead is judged at the newest step that
    ``min_trials`` others reached, not left alone until they catch up."""
    from titan_core.pipeline.sweep.early_stop import judged_step, median_stop

    ahead = _curve(9, 9, 9, 9, 9, every=10)  # at step 50
    others = [_curve(3, 3, 3, every=10), _curve(3, 3, 3, 3, every=10), _curve(3, every=10)]
    assert judged_step(ahead, others, 1) == 40 and judged_step(ahead, others, 2) == 30
    assert judged_step(ahead, others, 3) == 10 and judged_step(ahead, others, 4) is None
    decision = median_stop(ahead, others, _rule(min_steps=20, min_trials=2))
    assert decision is not None and (decision.step, decision.num_trials) == (30, 2)
    # Behind the others it is judged at its own newest step.
    assert judged_step(_curve(9, every=10), others, 2) == 10


def test_median_rule_smooths_losses_and_treats_divergence_as_worst() -> None:
    from titan_core.pipeline.sweep.early_stop import median_stop, smoothed

    noisy = _curve(4, 2, 4, every=10)  # one lucky log step
    assert smoothed(noisy, 30, 3) == pytest.approx(10 / 3) and smoothed(noisy, 20, 3) == 3
    assert smoothed(noisy, 25, 1) == 2 and smoothed(noisy, 40, 1) is None
    others = [_curve(3, 3, 3, every=10)] * 2
    # One bad log step: stopped on its last value alone (3.5 > 3), not on its mean (2.83 < 3).
    bumpy = _curve(3, 2, 3.5, every=10)
    assert median_stop(bumpy, others, _rule(window=1)) is not None
    assert median_stop(bumpy, others, _rule(window=3)) is None
    nan = float("nan")
    decision = median_stop(_curve(5, nan, nan), [_curve(3, 3, 3)] * 2, _rule())
    assert decision is not None and decision.loss == float("inf")
    # Peers that diverged count as the worst, not as a median of NaN.
    assert median_stop(_curve(5, 5, 9), [_curve(5, 5, nan)] * 3, _rule()) is None


def test_a_training_job_stopped_early_only_by_its_record_of_that_step() -> None:
    """The train task takes a checkpoint short of training.steps as the end of a job that
    honoured a stop request only when the job's ``stopped-early`` record is of that step."""
    from titan_core.pipeline.stages.training import trained_to
    from titan_core.stop_request import StopRecord

    record = StopRecord(6, "enough")
    assert trained_to([4, 8, 12], 12, None, "ck") == (12, None)
    assert trained_to([4, 8, 12], 12, record, "ck") == (12, None)  # an old stop, trained on
    assert trained_to([4, 6], 12, record, "ck") == (6, record)
    for steps, stop in (([4, 8], record), ([4, 6], None), ([], record)):
        with pytest.raises(RuntimeError, match="newest complete checkpoint in ck is"):
            trained_to(steps, 12, stop, "ck")


# ------------------------------------------------------------------ the monitor on MLflow


def _trial_runs(client: Any, tracking: Any, plan: Any, index: int, **state: Any) -> None:
    """Lay out trial ``index``'s runs as its pipeline does: a pipeline run nested under the
    sweep's run, its train stage run under it with a ``train/loss`` history; ``state`` gives
    the runs' statuses (``pipeline``, ``train``) and the ``losses`` (step -> loss)."""
    from mlflow.entities import Metric

    trial = plan.trials[index - 1]
    tags = {"mlflow.parentRunId": tracking.parent_run_id, "titan.stage": "pipeline"}
    pipeline = client.create_run(
        tracking.experiment_id, tags=tags | {"titan.run_id": plan.run_id(trial)}
    )
    tags = {"mlflow.parentRunId": pipeline.info.run_id, "titan.stage": "train"}
    train = client.create_run(tracking.experiment_id, tags=tags, run_name="train")
    metrics = [Metric("train/loss", loss, 0, step) for step, loss in state["losses"].items()]
    client.log_batch(train.info.run_id, metrics=metrics)
    for run, status in ((pipeline, state["pipeline"]), (train, state["train"])):
        if status != "RUNNING":
            client.set_terminated(run.info.run_id, status=status)


def test_monitor_asks_only_trials_still_training_to_stop(tmp_path: Path) -> None:
    """``TrialMonitor.poll`` on a real MLflow store (SQLite) laid out as a sweep's runs: it asks
    the clearly worse trial that is still training, and no trial whose training is over (its
    train run ended while its pipeline exports and evaluates, or its next log step, where its
    trainer would look for the request, is its last step) or already asked; it sets no MLflow
    tags (the train task tags a trial that really stopped)."""
    from mlflow import MlflowClient

    from titan_core.pipeline.sweep.early_stop import EarlyStopping
    from titan_core.pipeline.sweep.monitor import TrialMonitor
    from titan_core.pipeline.sweep.tracking import start_sweep_run
    from titan_core.resolve import resolve_job
    from titan_core.stop_request import pending_stop

    base = {
        "job.dump_folder": str(tmp_path / "runs"),
        "tracking.uri": f"sqlite:///{tmp_path}/m.db",
        "metrics.log_freq": 10,
    }
    grid = {"training.steps": [60, 110, 101, 102, 100]}
    plan = plan_sweep("s1", RECIPE, "", base, grid=grid)
    tracking = start_sweep_run(resolve_job(RECIPE, "", base), plan)
    client = MlflowClient(tracking.uri)

    def losses(loss: float, last: int) -> dict[int, float]:
        return {s: loss for s in range(10, last + 1, 10)}

    layout = {
        1: {"pipeline": "FINISHED", "train": "FINISHED", "losses": losses(2, 60)},  # a peer
        2: {"pipeline": "RUNNING", "train": "RUNNING", "losses": losses(2, 60)},  # not worse
        3: {"pipeline": "RUNNING", "train": "RUNNING", "losses": losses(5, 50)},  # of 101
        # Worse and far from its 102 steps, but its training is over: exporting, evaluating.
        4: {"pipeline": "RUNNING", "train": "FINISHED", "losses": losses(5, 50)},
        # Worse, logged step 90 of 100: its next log step is its last, where no one looks.
        5: {"pipeline": "RUNNING", "train": "RUNNING", "losses": losses(5, 90)},
    }
    for index, state in layout.items():
        _trial_runs(client, tracking, plan, index, **state)
    rule = EarlyStopping(enable=True, min_steps=10, min_trials=2, window=2)
    monitor = TrialMonitor(tracking, plan, rule)

    def asked() -> dict[int, str | None]:
        return {t.index: pending_stop(plan.run_root(t)) for t in plan.trials}

    def tags() -> dict[str, dict[str, str]]:
        runs = client.search_runs([tracking.experiment_id])
        return {r.info.run_id: r.data.tags for r in runs}

    before = tags()
    monitor.poll()
    reason = "training loss 5.0000 at step 50 is worse than the median 3.5000 of 4 other trials"
    assert asked() == {1: None, 2: None, 3: reason, 4: None, 5: None}
    assert tags() == before
    # Asked once: the trainer consumed the request, the next poll does not ask again.
    Path(plan.run_root(plan.trials[2]), "stop-requested").unlink()
    monitor.poll()
    assert set(asked().values()) == {None}


# ------------------------------------------------------------------ a real sweep

# 2 x 2 grid of batch size and sequence length under a 18 MiB per-device budget: the estimated
# peaks are about 7.6, 14.3, 9.5 and 24 MiB, so the largest cell is refused by the pipeline's
# preflight (at run time, after its MLflow run opened) and the other three train.
GRID = {"training.local_batch_size": [2, 4], "training.seq_len": [32, 128]}
BUDGET_GIB = 0.018
EXPERIMENT = "sweep-test"


@pytest.fixture(scope="module")
def swept(prefect_harness: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One sweep of 4 trials (one refused by preflight), concurrency 2."""
    from flows.sweep import sweep

    root = tmp_path_factory.mktemp("sweep")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    overrides = tiny_values(steps=2, nproc=1) | {
        "job.dump_folder": str(root / "runs"),
        "tracking.uri": uri,
        "job.experiment": EXPERIMENT,
        "evaluate.batches": 2,
        "launch.device_memory_gib": BUDGET_GIB,
    }
    state, flow_run_id = run_flow(
        sweep, recipe=RECIPE, overrides=overrides, grid=GRID, concurrency=2
    )
    assert state.is_completed(), state.message
    return {"result": state.result(), "flow_run_id": flow_run_id, "uri": uri, "root": root}


@pytest.mark.multiprocess
def test_sweep_nests_four_trials_and_reports_the_refused_one(swept: dict[str, Any]) -> None:
    from mlflow import MlflowClient

    result = swept["result"]
    assert [t.status for t in result.trials] == ["completed"] * 3 + ["failed"]
    failed = result.trials[3]
    assert dict(failed.values) == {"training.local_batch_size": 4, "training.seq_len": 128}
    assert "launch.device_memory_gib" in failed.error and "\n" not in failed.error

    client = MlflowClient(swept["uri"])
    sweep_run = client.get_run(result.mlflow_run_id)
    assert sweep_run.info.status == "FINISHED"
    assert sweep_run.data.tags["titan.stage"] == "sweep"
    children = client.search_runs(
        [sweep_run.info.experiment_id],
        filter_string=f"tags.`mlflow.parentRunId` = '{result.mlflow_run_id}'",
    )
    assert len(children) == 4
    # Named by the trial first, so MLflow's run list tells them apart at a glance.
    names = sorted(c.info.run_name for c in children)
    assert names == [f"{t.name} · {result.sweep_id}" for t in result.trials]
    by_run_id = {c.data.tags["titan.run_id"]: c for c in children}
    assert sorted(by_run_id) == sorted(t.run_id for t in result.trials)
    statuses = sorted(c.info.status for c in children)
    assert statuses == ["FAILED", "FINISHED", "FINISHED", "FINISHED"]
    for trial in result.trials[:3]:
        assert trial.final_loss is not None and trial.metric is not None
        assert by_run_id[trial.run_id].data.metrics["eval/loss"] == pytest.approx(trial.metric)


@pytest.mark.multiprocess
def test_comparison_lists_swept_keys_and_losses(swept: dict[str, Any], tmp_path: Path) -> None:
    from mlflow import MlflowClient

    result = swept["result"]
    client = MlflowClient(swept["uri"])
    names = {a.path for a in client.list_artifacts(result.mlflow_run_id)}
    assert {"comparison.md", "comparison.json", "loss_curves.png"} <= names
    assert {f"eval_loss_by_{key}.png" for key in GRID} <= names
    local = Path(client.download_artifacts(result.mlflow_run_id, "comparison.json", str(tmp_path)))
    doc = json.loads(local.read_text())
    assert doc["keys"] == list(GRID)
    rows = doc["trials"]
    assert [(r["training.local_batch_size"], r["training.seq_len"]) for r in rows] == [
        (2, 32),
        (2, 128),
        (4, 32),
        (4, 128),
    ]
    assert all(isinstance(r["eval/loss"], float) for r in rows[:3])
    assert all(isinstance(r["final_train_loss"], float) for r in rows[:3])
    assert rows[3]["status"] == "failed" and "device_memory_gib" in rows[3]["error"]
    md = Path(client.download_artifacts(result.mlflow_run_id, "comparison.md", str(tmp_path)))
    text = md.read_text()
    # The sweep run's description in MLflow is the comparison.
    assert client.get_run(result.mlflow_run_id).data.tags["mlflow.note.content"] == text
    assert "| trial | status | training.local_batch_size | training.seq_len |" in text
    # The loss curves and one chart per key. MLflow's viewer shows http(s) images only: with a
    # local store (here) its copy names the run's PNG artifacts; Prefect's embeds them.
    named = re.findall(r"^\*[^*]+: `([^`]+)`, an artifact of this run\.\*$", text, re.MULTILINE)
    assert len(named) == 1 + len(GRID) and set(named) <= names and "data:image" not in text


@pytest.mark.multiprocess
def test_compare_after_the_sweep_shows_its_trials_and_the_best(swept: dict[str, Any]) -> None:
    """`titan compare` of the sweep's experiment (nothing else named): a row per trial, named
    sweep-<id>/<trial>, the sweep's choice marked (best), each with its own numbers; the columns
    say which statistic they are."""
    from titan_core.pipeline.compare import compare_experiment

    result = swept["result"]
    compared = compare_experiment(EXPERIMENT, None, swept["uri"])
    names = [t.name for t in result.trials]
    best = f"sweep-{result.sweep_id}/{result.best.name} (best)"
    expected = [f"sweep-{result.sweep_id}/{n}" for n in names]
    expected[names.index(result.best.name)] = best
    assert [r["run"] for r in compared.runs] == expected
    by_run = {r["run"]: r for r in compared.runs}
    for trial, name in zip(result.trials, expected, strict=True):
        assert by_run[name]["run_id"] == trial.mlflow_run_id
        if trial.status == "completed":
            assert by_run[name]["final_loss"] == pytest.approx(trial.final_loss)
    assert f"# Comparison of {len(names)} runs in `{EXPERIMENT}`" in compared.table_markdown
    assert "\n| tokens/s (median) | " in compared.table_markdown
    assert "the median over the logged steps" in compared.table_markdown
    # What the trials differ in is what the sweep varied (and what follows from it, such as
    # validation.local_batch_size; the refused trial logged no config). Each trial's own folder
    # differs too, by construction: named apart.
    assert "training.local_batch_size" in compared.differing_params
    per_run = {"job.dump_folder", "tokenizer.path", "checkpoint.initial_load_path"}
    assert not per_run & set(compared.differing_params)
    assert "job.dump_folder" in compared.run_specific_keys
    for trial, row in zip(result.trials, compared.runs, strict=True):
        if trial.status == "completed":  # the metric the sweep ranked by
            assert row["eval_loss"] == pytest.approx(trial.metric)


@pytest.mark.multiprocess
def test_best_trial_is_aliased(swept: dict[str, Any]) -> None:
    from mlflow import MlflowClient

    result = swept["result"]
    completed = [t for t in result.trials if t.status == "completed"]
    assert result.best == min(completed, key=lambda t: t.metric)
    assert result.model_name == f"{EXPERIMENT}-sweep" and result.alias == BEST_ALIAS
    client = MlflowClient(swept["uri"])
    version = client.get_model_version_by_alias(result.model_name, BEST_ALIAS)
    assert version.run_id == result.best.mlflow_run_id
    assert version.tags["titan.sweep_id"] == result.sweep_id
    assert {t.model_version for t in completed} == {"1", "2", "3"}


@pytest.mark.multiprocess
def test_trials_are_subflows_at_most_two_at_a_time(swept: dict[str, Any]) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    result = swept["result"]
    assert flow_run(swept["flow_run_id"]).name == f"sweep-{result.sweep_id}"
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"sweep:{result.sweep_id}"]))
        )
    trials = {r.name: r for r in runs if r.id != swept["flow_run_id"]}
    # Each trial's pipeline is named after its run id, tagged with the sweep and its index.
    assert sorted(trials) == sorted(f"{EXPERIMENT}/{t.run_id}" for t in result.trials)
    for t in result.trials:
        run = trials[f"{EXPERIMENT}/{t.run_id}"]
        assert f"trial:{t.index}" in run.tags
        assert run.parent_task_run_id is not None
        assert run.state.type.value == ("COMPLETED" if t.status == "completed" else "FAILED")
    # The trial tasks in the sweep's flow run carry the trials' names and values.
    prefix = f"sweep-{result.sweep_id}/"
    runs_by_name = task_runs(swept["flow_run_id"])
    names = sorted(r.name for rs in runs_by_name.values() for r in rs if r.name.startswith(prefix))
    assert names == sorted(f"sweep-{result.sweep_id}/{t.name}" for t in result.trials)
    # Never more than `concurrency` trials at once (and the two first did overlap).
    events = sorted(
        [(r.start_time, 1) for r in trials.values()] + [(r.end_time, -1) for r in trials.values()]
    )
    running, most = 0, 0
    for _, step in events:
        running += step
        most = max(most, running)
    assert most == 2


@pytest.mark.multiprocess
def test_titan_sweep_runs_a_random_search_and_prints_the_table(
    prefect_harness: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The CLI's Prefect settings: this session's harness, nothing left in the environment after.
    monkeypatch.setenv("PREFECT_HOME", str(prefect_harness))
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    monkeypatch.setenv("PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT", "false")
    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    argv = ["sweep", "--config", RECIPE, "--random", "optimizer.lr=log_uniform:1e-4,1e-2"]
    argv += ["--trials", "2", "--seed", "3", *tiny_overrides(steps=2, nproc=1)]
    argv += ["--job.dump_folder", str(tmp_path / "runs"), "--tracking.uri", uri]
    argv += ["--evaluate.batches", "1", "--job.experiment", "cli-sweep"]
    assert titan_main(argv) == 0
    out = capsys.readouterr().out
    # A quiet console: what runs, one line per trial, the table once; no Prefect log lines
    # (they are in the UI), no rank output, no progress bars.
    lines = out.splitlines()
    assert lines[0] == (
        "sweep: 2 random draws of optimizer.lr, 2 at a time; every log line is in the Prefect UI"
    )
    assert [line.split(": ")[-1] for line in lines[1:3]] == ["completed", "completed"]
    assert not any("Task run" in line or "[titan]" in line or "%|" in line for line in lines)
    assert sum(line.startswith("trial ") for line in lines) == 1 and len(lines) <= 9, out
    space = {"optimizer.lr": {"log_uniform": [1e-4, 1e-2]}}
    drawn = [t.overrides["optimizer.lr"] for t in expand(random=space, trials=2, seed=3)]
    lines = out.splitlines()
    table = lines[next(i for i, line in enumerate(lines) if re.match(r"sweep \S+: ", line)) :]
    assert table[0].endswith("2 of 2 trials completed")
    assert table[1].split() == ["trial", "lr", "final_loss", "eval/loss", "status"]
    for index, (line, lr) in enumerate(zip(table[2:4], drawn), start=1):
        assert line.split()[:2] == [f"trial-{index}", f"{lr:g}"] and "completed" in line
    assert sum("(best)" in line for line in table[2:4]) == 1
    assert "model cli-sweep-sweep @sweep-best" in out and "MLflow: sweep run " in out
    _compare_shows_the_sweep(uri, [line.split() for line in table[2:4]], capsys)


def _compare_shows_the_sweep(
    uri: str, trials: list[list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    """`titan compare` after the two-trial sweep of `optimizer.lr`: the trials in 120 columns
    (the output is no terminal here), each with the eval loss the sweep ranked by,
    `optimizer.lr` the one config key that differs (each trial's own folder named apart, as
    different by construction); its Prefect artifact drawn for a narrow pane. The sweep's
    model also took `@champion` (each trial's publish stage runs the champion rule in it)."""
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    argv = ["compare", "--config", RECIPE, "--tracking.uri", uri, "--experiment", "cli-sweep"]
    assert titan_main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 120, "\n".join(lines)
    assert lines[0].strip().startswith("Comparison of 2 runs in cli-sweep, the trials of sweep-")
    for name, lr, _, eval_loss, *_ in trials:  # the sweep's table: trial, lr, ..., eval/loss
        numbers, values = [line.split() for line in lines if f" {name} " in line]
        assert "FINISHED" in numbers and numbers[-4] == eval_loss  # 4th number from the right
        assert float(values[-1]) == pytest.approx(float(lr))  # its optimizer.lr
    keys = lines.index(next(line for line in lines if "Config keys that differ" in line))
    assert next(line.split() for line in lines[keys + 1 :] if line.strip()) == [
        "run",
        "optimizer.lr",
    ]
    start = lines.index(next(line for line in lines if line.startswith("Also different, by")))
    end = next(i for i in range(start, len(lines)) if lines[i].endswith("."))  # wrapped at 120
    left_out = " ".join(lines[start : end + 1])
    assert "job.dump_folder" in left_out and "optimizer.lr" not in left_out
    with get_client(sync_client=True) as prefect:
        (artifact,) = prefect.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["compare-cli-sweep"]))
        )
    table = [line for line in artifact.data.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| run | trial-1 lr=") and len(table[0].split(" | ")) == 3
    assert any(line.startswith("| eval loss | ") for line in table)
    keys = table.index(next(line for line in table if line.startswith("| key | ")))
    assert [line.split(" | ")[0] for line in table[keys + 2 :]] == ["| `optimizer.lr`"]
    client = MlflowClient(uri)
    champion = client.get_model_version_by_alias("cli-sweep-sweep", "champion")
    assert client.get_run(champion.run_id).data.tags["titan.trial"].startswith("trial-")


def test_a_missing_deployment_is_one_line_before_anything_runs(
    prefect_harness: Path, tmp_path: Path
) -> None:
    from flows.sweep import sweep

    overrides = {
        "job.dump_folder": str(tmp_path / "runs"),
        "tracking.uri": f"sqlite:///{tmp_path}/m.db",
    }
    state, _ = run_flow(
        sweep,
        recipe=RECIPE,
        overrides=overrides,
        grid={"optimizer.lr": [1e-3, 3e-3]},
        deployment="no-such-deployment",
    )
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, ConfigError)
    expected = "no deployment 'pretrain_pipeline/no-such-deployment' on the Prefect server"
    assert str(error) == f"sweep.deployment: {expected}"
    assert not (tmp_path / "runs").exists() and not (tmp_path / "m.db").exists()


@pytest.mark.multiprocess
def test_early_stopping_stops_the_clearly_worse_trial(
    prefect_harness: Path, tmp_path: Path
) -> None:
    """Two trials side by side: the second (a learning rate too small to learn) is judged
    against the first at every log step from step 10 on and stopped long before its end; it
    still exports and evaluates what it trained, and the first one is the best. Both trials
    are judged; the rule (a mean of 3 log steps, a 5% margin, past warmup) stops only the
    clearly worse one: the good trial's losses are ~10% below the bad one's from step 10 on.
    (A monitor that never stops it makes the test run the bad trial's steps, then fail; the
    monitor's cases are ``test_monitor_asks_only_trials_still_training_to_stop``.)"""
    from mlflow import MlflowClient

    from flows.sweep import sweep
    from titan_core.checkpoint.manager import COMMIT_MARKER, complete_steps
    from titan_core.pipeline.stages.training import REASON_TAG, STOPPED_TAG
    from titan_core.stop_request import StopRecord, stopped_early

    # The good trial trains them all (~35 s); the bad one is stopped within its first 100-200
    # (the monitor polls every 0.2 s, and the good trial's live curve in MLflow lags).
    steps = 600
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = tiny_values(steps=steps, nproc=1, interval=steps) | {
        "job.dump_folder": str(tmp_path / "runs"),
        "tracking.uri": uri,
        "job.experiment": "early-stop",
        "evaluate.batches": 1,
        "metrics.log_freq": 5,  # fewer MLflow batches: its live curve lags training less
    }
    rule = {"enable": True, "min_steps": 10, "min_trials": 1, "window": 3, "margin": 0.05}
    rule["poll_seconds"] = 0.2
    state, _ = run_flow(
        sweep,
        recipe=RECIPE,
        overrides=overrides,
        grid={"optimizer.lr": [1e-2, 1e-7]},
        concurrency=2,
        early_stop=rule,
    )
    assert state.is_completed(), state.message
    result = state.result()
    good, bad = result.trials
    assert (good.status, good.steps, good.stopped_at) == ("completed", steps, None)
    assert bad.status == "stopped" and 10 <= bad.stopped_at < steps, bad
    assert bad.steps == bad.stopped_at and bad.metric is not None and bad.model_version
    assert result.best == good and result.stopped == (bad,) and not result.failed
    assert f"stopped at step {bad.stopped_at}" in format_table(result)
    # Its MLflow run says when and why; its run root holds the record of the stop (the
    # request consumed) and the stop's checkpoint, a full one that a later run resumes.
    client = MlflowClient(uri)
    tags = client.get_run(bad.mlflow_run_id).data.tags
    assert tags[STOPPED_TAG] == str(bad.stopped_at)
    reason = r"training loss \S+ at step \d+ is worse than the median \S+ of 1 other trials"
    assert re.fullmatch(reason, tags[REASON_TAG]), tags[REASON_TAG]
    run_root = Path(tags["storage_root"])
    assert stopped_early(str(run_root)) == StopRecord(bad.stopped_at, tags[REASON_TAG])
    assert not (run_root / "stop-requested").exists()
    step_dir = run_root / "checkpoint" / f"step-{bad.stopped_at}"
    assert complete_steps(str(run_root / "checkpoint"))[-1] == bad.stopped_at
    assert json.loads((step_dir / COMMIT_MARKER).read_text())["model_only"] is False
    good_tags = client.get_run(good.mlflow_run_id).data.tags
    assert REASON_TAG not in good_tags and STOPPED_TAG not in good_tags
