"""Which way each metric improves (``titan_core.config.metrics``), and the rules that read it:
the champion gate (``tracking.champion_metric``), a sweep's best trial and its early stopping.
A name no run logs is one ConfigError line before anything runs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from titan_core.config.metrics import check_metric, direction, is_better
from titan_core.errors import ConfigError
from titan_core.resolve import parse_args

TINY = ["--module", "llama3", "--config", "llama3_debugmodel_tiny"]
SETS = ["--evaluators.sets", "corpus=heldout:titan_corpus", "ns=task:next_sentence"]
NAN = math.nan


@pytest.mark.parametrize(
    ("name", "way"),
    [
        ("eval/ns/acc", "higher"),
        ("eval/ns/acc_per_token", "higher"),
        ("eval/lc/acc_per_char", "higher"),
        ("eval/ns/bits_per_byte", "lower"),
        ("eval/corpus/perplexity", "lower"),
        ("eval/corpus/seconds", "lower"),
        ("eval/loss", "lower"),
        ("train/loss", "lower"),
    ],
)
def test_a_metric_is_known_by_its_last_part(name: str, way: str) -> None:
    assert direction(name) == way


def test_better_is_strict_and_nan_never_wins() -> None:
    assert is_better("eval/ns/acc", 0.5, 0.4) and not is_better("eval/ns/acc", 0.4, 0.5)
    assert is_better("eval/loss", 2.0, 3.0) and not is_better("eval/loss", 3.0, 2.0)
    assert not is_better("eval/loss", 2.0, 2.0)  # a tie keeps the champion
    assert is_better("eval/ns/acc", 0.1, None) and is_better("eval/loss", 9.0, NAN)
    assert not is_better("eval/loss", NAN, None) and not is_better("eval/ns/acc", NAN, 0.1)
    with pytest.raises(ConfigError, match="metric 'eval/ns/f1': no known direction for 'f1'"):
        direction("eval/ns/f1")


def test_check_metric_knows_what_each_evaluator_logs() -> None:
    evaluators = {"corpus": "heldout", "ns": "task"}
    for name in ("eval/loss", "train/loss", "eval/ns/acc", "eval/corpus/bits_per_byte"):
        assert check_metric(name, "k", evaluators) == name
    for name, why in [
        ("eval/accuracy", "got 'eval/accuracy'$"),
        ("eval/hs/acc", "no evaluator 'hs' in evaluators.sets \\(its names: corpus, ns\\)"),
        ("eval/corpus/acc", "a heldout evaluator logs loss, perplexity, bits_per_byte, seconds"),
        ("eval/ns/loss", "a task evaluator logs acc, acc_per_token, acc_per_char, bits_per_byte"),
    ]:
        with pytest.raises(ConfigError, match=f"^k: expected train/loss, eval/loss, .*{why}"):
            check_metric(name, "k", evaluators)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "tracking.champion_metric: .*got 'eval/ns/acc'; no evaluator 'ns' in evaluators"),
        (SETS[:2], "got 'eval/ns/acc'; no evaluator 'ns' in evaluators.sets \\(its names: corpus"),
    ],
)
def test_an_unknown_gate_metric_is_one_line(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        parse_args([*TINY, *args, "--tracking.champion_metric", "eval/ns/acc"])
    assert "\n" not in str(info.value)
    cfg = parse_args([*TINY, *SETS, "--tracking.champion_metric", "eval/ns/acc"])
    assert cfg.tracking.champion_metric == "eval/ns/acc"
    assert parse_args(TINY).tracking.champion_metric == "eval/loss"


# --- the champion gate, on a real MLflow store ----------------------------------------------


def _versions(tmp_path: Path) -> tuple[Any, Any, str, str]:
    """A registered model whose champion (v1) has eval loss 3.0 and task accuracy 0.5, and a
    new version (v2) with a lower loss, 2.5, but a worse accuracy, 0.3."""
    from mlflow import MlflowClient

    from titan_core.pipeline.run.tracking import TrackingContext

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("line")
    runs = []
    for loss, acc in ((3.0, 0.5), (2.5, 0.3)):
        run = client.create_run(experiment).info.run_id
        client.log_metric(run, "eval/loss", loss, step=10)
        client.log_metric(run, "eval/ns/acc", acc, step=10)
        runs.append(run)
    client.create_registered_model("line")
    for run in runs:
        client.create_model_version("line", source=str(tmp_path), run_id=run)
    client.set_registered_model_alias("line", "champion", "1")
    return client, TrackingContext(uri, "line", experiment, runs[1]), runs[0], runs[1]


@pytest.mark.parametrize(("gate", "promoted"), [("eval/ns/acc", False), ("eval/loss", True)])
def test_a_lower_loss_with_worse_accuracy_is_promoted_by_the_loss_gate_only(
    tmp_path: Path, gate: str, promoted: bool
) -> None:
    from titan_core.pipeline.stages.publish import champion_value, promote_if_better

    client, tracking, _, _ = _versions(tmp_path)
    candidate = {"eval/loss": 2.5, "eval/ns/acc": 0.3}[gate]
    moved, previous = promote_if_better(tracking, "line", "2", candidate, gate)
    assert moved is promoted
    assert previous == {"eval/loss": 3.0, "eval/ns/acc": 0.5}[gate]
    champion = client.get_model_version_by_alias("line", "champion").version
    assert str(champion) == ("2" if promoted else "1")
    assert champion_value(tracking, "line", "eval/ns/acc") == (0.3 if promoted else 0.5)


def test_a_champion_without_the_gate_metric_is_beaten(tmp_path: Path) -> None:
    """A champion registered before its line gated on a metric has nothing to compare: the
    first version scored by the new gate takes the alias."""
    from titan_core.pipeline.stages.publish import promote_if_better

    client, tracking, _, _ = _versions(tmp_path)
    moved, previous = promote_if_better(tracking, "line", "2", 0.2, "eval/lc/acc")
    assert moved and previous is None
    assert str(client.get_model_version_by_alias("line", "champion").version) == "2"


@pytest.mark.parametrize(("gate", "expected"), [("eval/loss", "3"), ("eval/ns/acc", "1")])
def test_settling_replays_the_rule_over_versions_published_at_once(
    tmp_path: Path, gate: str, expected: str
) -> None:
    """Three trials published at once and the slowest, not the best, wrote @champion last:
    settling replays the rule in registration order and points the alias at the version a
    sequence of publishes would have kept (ties keep the first); a version whose run never
    logged the metric is passed over."""
    from titan_core.pipeline.stages.publish import settle_champion

    client, tracking, _, _ = _versions(tmp_path)  # v1: loss 3.0 acc 0.5; v2: 2.5, 0.3
    experiment = (
        client.get_experiment_by_name("line")
        or client.get_run(client.get_model_version("line", "1").run_id).info
    )
    experiment_id = getattr(experiment, "experiment_id", None)
    for metrics in ({"eval/loss": 2.0, "eval/ns/acc": 0.5}, {}, {"eval/loss": 2.0}):
        run = client.create_run(experiment_id).info.run_id
        for key, value in metrics.items():
            client.log_metric(run, key, value, step=10)
        client.create_model_version("line", source=str(tmp_path), run_id=run)
    client.set_registered_model_alias("line", "champion", "5")  # the last to write
    assert settle_champion(tracking, "line", gate) == expected
    assert str(client.get_model_version_by_alias("line", "champion").version) == expected
    assert settle_champion(tracking, "line", "eval/other/acc") == ""  # nobody logged it


# --- sweeps: the best trial and early stopping in the metric's direction --------------------


def test_the_best_trial_follows_the_metrics_direction() -> None:
    from titan_core.pipeline.sweep.report import TrialRow, best_trial, render_markdown

    rows = [
        TrialRow(i, f"trial-{i}", f"r{i}", "completed", (), metric=m)
        for i, m in enumerate((0.25, 0.5, 0.5, 0.1), start=1)
    ]
    assert best_trial(rows, "eval/ns/acc").index == 2  # the highest, the first on a tie
    assert best_trial(rows, "eval/ns/bits_per_byte").index == 4
    assert best_trial(rows).index == 4  # eval/loss by default
    text = render_markdown("s1", rows, [], "eval/ns/acc", best_trial(rows, "eval/ns/acc"))
    assert "Best by highest `eval/ns/acc`: **trial-2** (0.5000)." in text


def test_early_stopping_on_an_accuracy_stops_the_least_accurate() -> None:
    from titan_core.pipeline.sweep.early_stop import EarlyStopping, median_stop

    rule = EarlyStopping(
        enable=True, min_steps=2, min_trials=2, window=1, metric="eval/ns/acc", margin=0.1
    )
    others = [[(2, 0.4), (4, 0.5)], [(2, 0.4), (4, 0.6)], [(2, 0.3), (4, 0.7)]]  # median 0.6
    decision = median_stop([(2, 0.3), (4, 0.5)], others, rule)
    assert decision is not None and (decision.loss, decision.median) == (0.5, 0.6)
    assert decision.reason() == (
        "eval/ns/acc 0.5000 at step 4 is worse than the median 0.6000 of 3 other trials"
    )
    assert median_stop([(2, 0.3), (4, 0.55)], others, rule) is None  # within the 10% margin
    assert median_stop([(2, 0.3), (4, 0.9)], others, rule) is None  # more accurate
    assert median_stop([(2, 0.3), (4, NAN)], others, rule) is not None  # diverged: the worst


@pytest.mark.parametrize(
    ("metric", "early", "message"),
    [
        ("eval/ns/acc", "train/loss", None),
        ("eval/ns/acc", "eval/ns/acc", None),
        ("eval/hs/acc", "train/loss", "sweep.metric: .*no evaluator 'hs' in evaluators.sets"),
        ("eval/loss", "eval/loss", "sweep.early_stop.metric: expected train/loss or eval/"),
        ("eval/loss", "eval/corpus/acc", "sweep.early_stop.metric: .*a heldout evaluator logs"),
    ],
)
def test_sweep_metrics_are_checked_against_the_trials_evaluators(
    tmp_path: Path, metric: str, early: str, message: str | None
) -> None:
    from titan_core.pipeline.sweep.plan import plan_sweep

    base = {
        "job.dump_folder": str(tmp_path),
        "tracking.uri": f"sqlite:///{tmp_path}/m.db",
        "evaluators.sets": ["corpus=heldout:titan_corpus", "ns=task:next_sentence"],
    }
    kwargs: dict[str, Any] = {
        "grid": {"optimizer.lr": [1e-3, 3e-3]},
        "metric": metric,
        "early_stop": {"enable": True, "metric": early},
    }
    if message is None:
        plan = plan_sweep("s1", "llama3_debugmodel_tiny", "", base, **kwargs)
        assert plan.metric == metric and plan.early_stop.metric == early
        return
    with pytest.raises(ConfigError, match=message) as info:
        plan_sweep("s1", "llama3_debugmodel_tiny", "", base, **kwargs)
    assert "\n" not in str(info.value)
