"""In-loop evaluation (``[evaluators]``): metrics logged as ``eval/<name>/<metric>`` at their
steps, training bitwise the same with evaluation on, numbers equal to scoring the saved
checkpoint afterwards, and bad input refused in one line before anything starts."""

from __future__ import annotations

import itertools
import json
import math
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from titan_core.build import check_job
from titan_core.components.evaluators import Evaluators, HeldOutSet, build_evaluators
from titan_core.components.ranked_choice import build_requests, score_choice_task
from titan_core.data import Tokenizer, default_tokenizer_path
from titan_core.data.assets import bundled_tasks_dir
from titan_core.data.choice_tasks import ChoiceExample, read_choice_task, write_choice_task
from titan_core.errors import ConfigError
from titan_core.evaluate import compute_metrics, token_byte_lengths, validation_loader
from titan_core.evaluate.loading import build_model, load_weights
from titan_core.resolve import parse_args
from titan_core.train import main as train_main
from titan_core.train import run

TINY = ["--module", "llama3", "--config", "llama3_debugmodel_tiny"]
CPU = torch.device("cpu")
STEPS = 5
TASK_METRICS = ("acc", "acc_per_token", "acc_per_char", "bits_per_byte", "seconds")
HELDOUT_METRICS = ("loss", "perplexity", "bits_per_byte", "seconds")


def _args(dump: Path, *extra: str) -> list[str]:
    return [
        *TINY,
        "--job.dump_folder",
        str(dump),
        "--training.steps",
        str(STEPS),
        "--metrics.log_freq",
        "1",
        "--metrics.cpu_peak_tflops",
        "1",
        "--debug.deterministic",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "100",  # the last step's save only: model-only, float32
        "--validation.no_enable",
        *extra,
    ]


@pytest.fixture(scope="module")
def task_file(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> Path:
    """A small task: the first 16 examples of the bundled line_closing task."""
    examples = read_choice_task(str(bundled_tasks_dir() / "line_closing" / "test.jsonl"))[:16]
    path = tmp_path_factory.mktemp("tasks") / "lc.jsonl"
    write_choice_task(str(path), examples)
    return path


def _evaluators(task: Path) -> list[str]:
    shots = bundled_tasks_dir() / "line_closing" / "shots.jsonl"
    return [
        "--evaluators.sets",
        f"lc=task:{task}?num_shots=1&shots={shots}",
        "corpus=heldout:titan_corpus?batches=2",
        "--evaluators.freq",
        "2",
        "--evaluators.at_start",
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, task_file: Path) -> dict[str, Path]:
    """The same training with evaluation on and off."""
    dumps = {"on": tmp_path_factory.mktemp("on"), "off": tmp_path_factory.mktemp("off")}
    run(parse_args(_args(dumps["on"], *_evaluators(task_file))))
    run(parse_args(_args(dumps["off"])))
    return dumps


def _rows(dump: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def _weights(dump: Path) -> dict[str, torch.Tensor]:
    cfg = parse_args(_args(dump))
    model, _ = build_model(cfg, Tokenizer(str(default_tokenizer_path())).n_words, CPU, 1)
    load_weights(model, str(dump / "checkpoint" / f"step-{STEPS}"), cfg.model.flavor)
    return model.state_dict()


def test_metrics_are_logged_by_name_at_their_steps(runs: dict[str, Path], task_file: Path) -> None:
    rows = [r for r in _rows(runs["on"]) if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in rows] == [0, 2, 4, 5]  # at_start, every 2 steps, the last
    expected = {f"eval/lc/{m}" for m in TASK_METRICS} | {
        f"eval/corpus/{m}" for m in HELDOUT_METRICS
    }
    for row in rows:
        assert set(row) - {"step"} == expected
        assert all(0 <= row[f"eval/lc/{m}"] <= 1 for m in ("acc", "acc_per_token", "acc_per_char"))
        assert row["eval/corpus/perplexity"] == pytest.approx(math.exp(row["eval/corpus/loss"]))
        assert row["eval/lc/seconds"] > 0 and row["eval/corpus/seconds"] > 0
    # Training learns: the held-out loss goes down from the untrained model's.
    assert rows[-1]["eval/corpus/loss"] < rows[0]["eval/corpus/loss"]
    assert not any(k.startswith("eval/") for r in _rows(runs["off"]) for k in r)
    # Saved as run: the batch size resolved, the entries as given (their paths absolute).
    saved = parse_args([*TINY, "--job.config_file", str(runs["on"] / "config.toml")])
    assert saved.evaluators.batch_size == saved.training.local_batch_size
    assert (
        saved.evaluators.sets
        == parse_args(_args(runs["on"], *_evaluators(task_file))).evaluators.sets
    )


def test_training_is_bitwise_the_same_with_evaluation_on(runs: dict[str, Path]) -> None:
    def losses(dump: Path) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in _rows(dump) if "loss" in r}

    assert sorted(losses(runs["on"])) == list(range(1, STEPS + 1))
    assert losses(runs["on"]) == losses(runs["off"])
    on, off = _weights(runs["on"]), _weights(runs["off"])
    assert on.keys() == off.keys()
    for name, tensor in on.items():
        assert torch.equal(tensor, off[name]), name


def test_numbers_equal_scoring_the_saved_checkpoint(runs: dict[str, Path], task_file: Path) -> None:
    (last,) = [r for r in _rows(runs["on"]) if r["step"] == STEPS and "eval/lc/acc" in r]
    cfg = parse_args(_args(runs["on"]))
    tokenizer = Tokenizer(str(default_tokenizer_path()))
    model, _ = build_model(cfg, tokenizer.n_words, CPU, 1)
    load_weights(model, str(runs["on"] / "checkpoint" / f"step-{STEPS}"), cfg.model.flavor)
    shots = read_choice_task(str(bundled_tasks_dir() / "line_closing" / "shots.jsonl"))
    task = build_requests(
        "lc",
        read_choice_task(str(task_file)),
        tokenizer,
        max_seq_len=cfg.training.seq_len,
        shots=shots,
        num_shots=1,
    )
    scored = score_choice_task(model, task, batch_size=3, device=CPU)  # another batching
    for metric in TASK_METRICS[:-1]:
        assert last[f"eval/lc/{metric}"] == pytest.approx(getattr(scored, metric), rel=1e-5)
    # The held-out set as `titan eval` scores a validation split: the corpus's first 2 batches.
    batches = validation_loader(
        parse_args(_args(runs["on"], "--validation.dataset", "titan_corpus")), tokenizer
    )
    ref = compute_metrics(model, batches, token_byte_lengths(tokenizer), device=CPU, max_batches=2)
    assert ref.num_batches == 2
    for metric in HELDOUT_METRICS[:-1]:
        assert last[f"eval/corpus/{metric}"] == pytest.approx(getattr(ref, metric), rel=1e-5)


def test_titan_eval_reports_the_in_loop_numbers(runs: dict[str, Path], tmp_path: Path) -> None:
    """``titan eval`` on the saved checkpoint runs the run's own ``[evaluators]`` (its stored
    config.toml) and reports the names and numbers the loop logged at that step; the pipeline's
    evaluate stage hands them on as ``<name>/<metric>`` (published as ``eval/<name>/<metric>``)."""
    from titan_core.cli.evaluate import main as eval_main
    from titan_core.pipeline.stages.evaluation import evaluate_stage

    (last,) = [r for r in _rows(runs["on"]) if r["step"] == STEPS and "eval/lc/acc" in r]
    checkpoint = str(runs["on"] / "checkpoint")
    quick = ["--evaluate.batches", "1", "--evaluate.prompts"]
    assert eval_main(["--checkpoint", checkpoint, "--output", str(tmp_path / "cli"), *quick]) == 0
    report = json.loads((tmp_path / "cli" / "eval" / "report.json").read_text())
    assert set(report["evaluators"]) == set(last) - {"step"}
    for key, value in report["evaluators"].items():
        if not key.endswith("/seconds"):
            assert value == pytest.approx(last[key], rel=1e-5, abs=1e-5), key
    assert "## Evaluators" in (tmp_path / "cli" / "eval" / "report.md").read_text()
    stage = evaluate_stage(
        checkpoint,
        output=str(tmp_path / "stage"),
        overrides={"evaluate.batches": 1, "evaluate.prompts": []},
    )
    for key, value in last.items():
        if key.startswith("eval/") and not key.endswith("/seconds"):
            assert stage.metrics[key.removeprefix("eval/")] == pytest.approx(value, rel=1e-5)
    assert stage.metrics["loss"] == report["metrics"]["loss"]


def test_the_evaluate_flow_summarises_the_evaluators(
    prefect_harness: Path, runs: dict[str, Path], tmp_path: Path
) -> None:
    """The Prefect evaluate stage (as a flow of its own) scores the run's evaluators and shows
    them in its evaluation-report artifact."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )

    from flows.evaluate import evaluate

    (last,) = [r for r in _rows(runs["on"]) if r["step"] == STEPS and "eval/lc/acc" in r]
    state = evaluate(
        checkpoint=str(runs["on"] / "checkpoint"),
        output=str(tmp_path),
        overrides={"evaluate.batches": 1, "evaluate.prompts": []},
        return_state=True,
    )
    result = state.result()
    assert result.metrics["lc/acc"] == pytest.approx(last["eval/lc/acc"], rel=1e-5)
    assert result.metrics["corpus/bits_per_byte"] == pytest.approx(
        last["eval/corpus/bits_per_byte"], rel=1e-5
    )

    async def by_key() -> str:  # this flow run's report (the session's server holds others)
        async with get_client() as client:
            (found,) = await client.read_artifacts(
                artifact_filter=ArtifactFilter(
                    key=ArtifactFilterKey(any_=["evaluation-report"]),
                    flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id]),
                )
            )
            return found.data

    text = asyncio.run(by_key())
    assert "## Evaluators" in text and "eval/lc/acc" in text


def test_the_documented_curves_command_draws_a_run(runs: dict[str, Path], tmp_path: Path) -> None:
    from titan_core.evaluate.curves import main as curves_main
    from titan_core.evaluate.curves import read_curves

    curves = read_curves(str(runs["on"] / "metrics.jsonl"))
    assert [s for s, _ in curves["eval/lc/acc"]] == [0, 2, 4, 5]
    assert [s for s, _ in curves["train/loss"]] == list(range(1, STEPS + 1))
    assert not any(k.endswith("/seconds") for k in curves)
    png = tmp_path / "curves.png"
    assert curves_main([str(runs["on"] / "metrics.jsonl"), str(png), "--title", "t"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no eval/<name>/<metric> of loss"):
        curves_main([str(runs["off"] / "metrics.jsonl"), str(png), "--panels", "loss"])


def test_the_demo_trains_with_two_heldout_sets_and_a_task(tmp_path: Path, assets: Path) -> None:
    """The demo's evaluators: the validation split by genre (every document in one set, the
    same files on a rerun) and line_closing; they pass the check before training, at the demo's
    shapes and at the tiny ones its tests use; an explicit evaluators.sets replaces them."""
    from titan_core.cli.demo import DEMO_OVERRIDES, with_demo_evaluators
    from titan_core.data.assets import bundled_corpus_dir

    argv = with_demo_evaluators(["--training.steps", "3"], str(tmp_path))
    cfg = parse_args(["--module", "llama3", "--config", "llama3_debugmodel", *argv])
    kinds = [e.split("=", 1)[1].split(":", 1)[0] for e in cfg.evaluators.sets]
    assert kinds == ["heldout", "heldout", "task"] and cfg.evaluators.at_start
    plays, python = (tmp_path / "heldout" / f"{n}.jsonl" for n in ("plays", "python"))
    texts = [json.loads(line)["text"] for f in (plays, python) for line in f.open()]
    validation = bundled_corpus_dir() / "validation"
    corpus = [json.loads(line)["text"] for f in validation.glob("*.jsonl") for line in f.open()]
    assert sorted(texts) == sorted(corpus) and plays.stat().st_size and python.stat().st_size
    first = plays.read_bytes()
    with_demo_evaluators([], str(tmp_path))
    assert plays.read_bytes() == first
    check_job(cfg, 1)
    check_job(parse_args([*TINY, *argv, "--training.seq_len", "64"]), 1)
    assert with_demo_evaluators(["--evaluators.sets", LC], "unused") == ["--evaluators.sets", LC]
    assert "--evaluators.sets" not in DEMO_OVERRIDES  # written per output root, not fixed


class _RandomModel(torch.nn.Module):
    """A model whose forward draws from every RNG a training step might use."""

    def forward(self, inputs: torch.Tensor, **_: torch.Tensor) -> torch.Tensor:
        random.random(), np.random.rand(), torch.rand(1)
        return torch.randn(*inputs.shape, 8)


def test_a_prepared_datasets_heldout_set_scores_as_validation_does(
    tmp_path: Path, prepared_corpus: str
) -> None:
    """A held-out evaluator on a prepared dataset (one source of a mix, say) reads its
    validation split as validation does: over the same batches, the same loss, at every step
    both ran."""
    dump = tmp_path / "run"
    argv = [*_args(dump, "--dataloader.dataset", prepared_corpus, "--checkpoint.no_enable")]
    argv = [a for a in argv if a != "--validation.no_enable"]
    argv += ["--validation.enable", "--validation.dataset", prepared_corpus]
    argv += ["--validation.freq", "2", "--validation.steps", "3"]
    argv += ["--evaluators.sets", f"mine=heldout:{prepared_corpus}?batches=3"]
    argv += ["--evaluators.freq", "2"]
    run(parse_args(argv))
    rows = _rows(dump)
    validation = {r["step"]: r["validation/loss"] for r in rows if "validation/loss" in r}
    heldout = {r["step"]: r["eval/mine/loss"] for r in rows if "eval/mine/loss" in r}
    assert sorted(heldout) == sorted(validation) == [2, 4, 5], (heldout, validation)
    for step, loss in validation.items():
        assert heldout[step] == pytest.approx(loss, rel=1e-5), step


def test_evaluation_leaves_every_rng_where_it_was() -> None:
    from titan_core.config.job import Evaluators as EvaluatorsConfig

    batch = (torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long))
    evaluators = Evaluators(
        EvaluatorsConfig(sets=["x=heldout:unused"], freq=1),
        [HeldOutSet("x", (batch, batch))],
        batch_size=2,
        byte_lengths=torch.ones(8, dtype=torch.int64),
        device=CPU,
        pad_id=0,
    )
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    model = _RandomModel().train()
    scores = evaluators.run(model, 1)
    assert model.training and set(scores) == {f"eval/x/{m}" for m in HELDOUT_METRICS}
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


# --- bad input: one line, before anything starts -------------------------------------------


def _write(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GOOD = ChoiceExample("To be, or not to", ("be", "cat"), 0)
LC = "a=task:line_closing"


E = r"evaluators\.sets: "
FORM = E + r"expected NAME=KIND:SOURCE\[\?KEY=VALUE&\.\.\.\] with KIND heldout or task"
BAD = {  # (evaluators.sets, the error line's start); {tmp}: the test's folder
    "duplicate name": ([LC, "a=heldout:titan_corpus"], E + r"expected each evaluator name once"),
    "unknown kind": (["a=tasks:line_closing"], FORM + r", got 'a=tasks:line_closing'"),
    "bad name": (["a/b=task:line_closing"], FORM + r", NAME of letters"),
    "wrong option": (["a=heldout:x?num_shots=1"], E + r"expected heldout options among split"),
    "unknown bundled task": (
        ["a=task:line_closng"],
        E + r"a: unknown bundled task 'line_closng' \(bundled: next_sentence, line_closing;",
    ),
    "gold out of range": (
        ["a=task:{tmp}/gold.jsonl"],
        E + r"a: {tmp}/gold\.jsonl line 2: gold index 2 out of range for 2 choices \(0\.\.1\)",
    ),
    "empty choices": (["a=task:{tmp}/empty.jsonl"], E + r"a: {tmp}/empty\.jsonl line 1: 'choices'"),
    "missing task file": (["a=task:{tmp}/no.jsonl"], E + r"a: {tmp}/no\.jsonl: file not found"),
    "missing held-out set": (["a=heldout:{tmp}/no"], E + r"a: dataset '{tmp}/no'.*path not found"),
    "too many shots": (
        [f"{LC}?num_shots=21"],
        E + r"a: num_shots: expected 0\.\.20 \(the shots given\), got 21",
    ),
    "shots without a file": (["a=task:{tmp}/gold.jsonl?num_shots=1"], E + r"a: num_shots=1 needs"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_evaluators_are_one_config_error_line(case: str, tmp_path: Path, assets: Path) -> None:
    good = json.loads(GOOD.to_json())
    _write(tmp_path / "gold.jsonl", [good, {**good, "gold": 2}])
    _write(tmp_path / "empty.jsonl", [{**good, "choices": []}])
    sets, expected = BAD[case]
    sets = [entry.replace("{tmp}", str(tmp_path)) for entry in sets]
    with pytest.raises(ConfigError) as e:
        check_job(parse_args([*TINY, "--evaluators.sets", *sets]), 1)
    message = str(e.value)
    assert re.match(expected.replace("{tmp}", re.escape(str(tmp_path))), message), message
    assert "\n" not in message


@pytest.mark.parametrize(
    "key",
    [
        "data_parallel_shard_degree",
        "tensor_parallel_degree",
        "pipeline_parallel_degree",
        "context_parallel_degree",
    ],
)
def test_every_layout_is_accepted(key: str) -> None:
    """Evaluation scores under TP, PP and CP (and EP) as in one process: none is refused."""
    parse_args([*TINY, "--evaluators.sets", LC, f"--parallelism.{key}", "2"])


def test_train_prints_one_error_line_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture, assets: Path
) -> None:
    dump = tmp_path / "run"
    assert train_main([*_args(dump), "--evaluators.sets", "a=task:nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: evaluators.sets: a: unknown bundled task 'nope'")
    assert err.count("\n") == 1
    assert not (dump / "metrics.jsonl").exists() and not (dump / "config.toml").exists()


# --- two ranks, FSDP on gloo ---------------------------------------------------------------


@pytest.mark.multiprocess
def test_fsdp_two_ranks_shard_the_evaluation(tmp_path: Path, task_file: Path) -> None:
    """Under FSDP over 2 ranks each rank scores half the batches: training is bitwise the same
    as without evaluation, and the numbers are the saved checkpoint's, scored in one process."""
    from parallel_harness import launch_job

    dumps = {"on": tmp_path / "on", "off": tmp_path / "off"}
    fsdp = ["--parallelism.data_parallel_shard_degree", "2", "--dataloader.streams", "2"]
    for key, extra in (("on", _evaluators(task_file)), ("off", [])):
        launch_job(_args(dumps[key], *fsdp, *extra), dumps[key], backend="local", nproc_per_node=2)
    losses = [{r["step"]: r["loss"] for r in _rows(d) if "loss" in r} for d in dumps.values()]
    assert sorted(losses[0]) == list(range(1, STEPS + 1)) and losses[0] == losses[1]
    on, off = _weights(dumps["on"]), _weights(dumps["off"])
    assert all(torch.equal(tensor, off[name]) for name, tensor in on.items())
    (last,) = [r for r in _rows(dumps["on"]) if r["step"] == STEPS and "eval/lc/acc" in r]
    cfg = parse_args(_args(dumps["on"]))
    tokenizer = Tokenizer(str(default_tokenizer_path()))
    model, _ = build_model(cfg, tokenizer.n_words, CPU, 1)
    load_weights(model, str(dumps["on"] / "checkpoint" / f"step-{STEPS}"), cfg.model.flavor)
    evaluators = build_evaluators(
        parse_args(_args(dumps["on"], *_evaluators(task_file))), tokenizer, device=CPU
    )
    alone = evaluators.run(model, STEPS)
    for key, value in alone.items():
        if not key.endswith("/seconds"):
            assert last[key] == pytest.approx(value, rel=1e-5), key


P = "--parallelism."
QWEN3_MOE = ["--module", "qwen3_moe", "--config", "qwen3_moe_debugmodel_tiny"]
LAYOUTS = {  # (model, parallelism) on 2 ranks (4 for two degrees); 4 layers
    "TP 2": (TINY, [f"{P}tensor_parallel_degree", "2"]),
    "TP 2 no loss parallel": (
        TINY,
        [f"{P}tensor_parallel_degree", "2", f"{P}disable_loss_parallel"],
    ),
    "CP 2": (TINY, [f"{P}context_parallel_degree", "2"]),
    "PP 2": (TINY, [f"{P}pipeline_parallel_degree", "2"]),
    "EP 2": (QWEN3_MOE, [f"{P}expert_parallel_degree", "2", "--dataloader.streams", "2"]),
    # 4 ranks: data parallel shares the batches out, each pair's last stage scores them.
    "FSDP 2 x PP 2": (
        TINY,
        [
            f"{P}data_parallel_shard_degree",
            "2",
            f"{P}pipeline_parallel_degree",
            "2",
            "--dataloader.streams",
            "2",
        ],
    ),
    "TP 2 x CP 2": (TINY, [f"{P}tensor_parallel_degree", "2", f"{P}context_parallel_degree", "2"]),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_score_as_one_process(layout: str, tmp_path: Path, task_file: Path) -> None:
    """One training step on 2 ranks under each layout: the in-loop numbers equal the saved
    checkpoint's scored in one process (<= 1e-5)."""
    from parallel_harness import launch_job

    model, parallel = LAYOUTS[layout]
    dump = tmp_path / "run"
    base = [*model, *_args(dump)[len(TINY) :], "--training.steps", "1", "--model.n_layers", "4"]
    shots = bundled_tasks_dir() / "line_closing" / "shots.jsonl"
    sets = [
        f"lc=task:{task_file}?num_shots=1&shots={shots}",
        "corpus=heldout:titan_corpus?batches=2",
    ]
    evals = ["--evaluators.sets", *sets]
    nproc = math.prod(int(v) for k, v in itertools.pairwise(parallel) if k.endswith("_degree"))
    launch_job([*base, *parallel, *evals], dump, backend="local", nproc_per_node=nproc)
    (row,) = [r for r in _rows(dump) if "eval/lc/acc" in r]
    cfg = parse_args(base)
    tokenizer = Tokenizer(str(default_tokenizer_path()))
    alone, _ = build_model(cfg, tokenizer.n_words, CPU, 1)
    load_weights(alone, str(dump / "checkpoint" / "step-1"), cfg.model.flavor)
    expected = build_evaluators(parse_args([*base, *evals]), tokenizer, device=CPU).run(alone, 1)
    for key, value in expected.items():
        if not key.endswith("/seconds"):
            assert row[key] == pytest.approx(value, rel=1e-5, abs=1e-5), key


def _length_task(path: Path, gold_short: bool) -> Path:
    """12 questions of one short and one long choice: the raw sum of log-likelihoods prefers the
    one-word choice by far for any model this small, so ``acc`` is 1.0 when the short one is
    gold and 0.0 when the long one is, whatever the training did."""
    short, long = " yes.", " and then the whole of the rest of the story, told again at length."
    rows = [
        {
            "context": f"Question {i}: is it so?",
            "choices": [short, long],
            "gold": 0 if gold_short else 1,
        }
        for i in range(12)
    ]
    _write(path, rows)
    return path


def test_retrain_gated_on_accuracy_keeps_the_more_accurate_champion(
    prefect_harness: Path, tmp_path: Path, assets: Path
) -> None:
    """The retrain flow told to gate on a task's accuracy (``tracking.champion_metric``): its
    candidate trains on, so its eval loss is lower, but scores worse on the task, and the
    champion stays where it was."""
    from mlflow import MlflowClient
    from pipeline_helpers import run_flow, tiny_values

    from flows.pipeline import pretrain_pipeline
    from flows.retrain import retrain

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = {"job": {"dump_folder": str(tmp_path / "line"), "experiment": "gate"}}
    config["tracking"] = {"uri": uri, "champion_metric": "eval/lc/acc"}

    def gated(task: Path) -> dict[str, Any]:
        return tiny_values(steps=2, nproc=1) | {
            "evaluators.sets": [f"lc=task:{task}"],
            "evaluate.batches": 2,
        }

    state, _ = run_flow(
        pretrain_pipeline,
        recipe="llama3_debugmodel_tiny",
        config=config,
        overrides=gated(_length_task(tmp_path / "easy.jsonl", gold_short=True)),
    )
    assert state.is_completed(), state.message
    first = state.result()
    assert first["champion"] and first["metrics"]["eval/lc/acc"] == 1.0
    state, _ = run_flow(
        retrain,
        steps=2,
        recipe="llama3_debugmodel_tiny",
        config=config,
        overrides=gated(_length_task(tmp_path / "hard.jsonl", gold_short=False)),
    )
    assert state.is_completed(), state.message
    second = state.result()
    assert second["metrics"]["eval/lc/acc"] == 0.0
    assert second["metrics"]["eval/loss"] < first["metrics"]["eval/loss"]  # better on loss
    assert second["champion"] is False
    champion = MlflowClient(uri).get_model_version_by_alias("gate", "champion")
    assert str(champion.version) == str(first["model_version"])
