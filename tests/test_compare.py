"""`compare_experiment` / `titan compare`: real MLflow runs (SQLite) → table, differing keys, PNG.

The runs are logged the way the pipeline logs them: a parent run with the flattened resolved
config as params, a nested train run whose per-step metrics come from the trainer's own
``MetricsProcessor`` through the ``MlflowSink``, and a nested evaluate run.
"""

from __future__ import annotations

import base64
import json
import math
import re
import struct
from pathlib import Path

import pytest
from mlflow import MlflowClient
from tracking_data import log_pipeline_run

from titan_core.cli import main as titan_main
from titan_core.errors import ConfigError
from titan_core.pipeline.compare import (
    PLOT_NAME,
    RunSummary,
    compare_experiment,
    split_run_specific,
    summarize_run,
)
from titan_core.pipeline.compare_view import MARKDOWN_WIDTH, render_markdown

EXPERIMENT = "cmp-test"
BASE = ["--module", "llama3", "--config", "llama3_debugmodel_tiny"]
# Two runs that differ in exactly these config keys.
VARIANTS = {
    "lr-high": ["--optimizer.lr", "1e-3", "--training.steps", "4"],
    "lr-low": ["--optimizer.lr", "1e-4", "--training.steps", "6"],
}


@pytest.fixture(scope="module")
def tracking(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """A SQLite tracking URI holding the two variant runs."""
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    client.create_experiment(EXPERIMENT, artifact_location=str(root / "artifacts"))
    runs = {
        name: log_pipeline_run(uri, EXPERIMENT, name, [*BASE, *overrides])
        for name, overrides in VARIANTS.items()
    }
    return uri, runs


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def _embedded_png(markdown: str) -> bytes:
    """The PNG that the markdown's loss-curve image embeds (a base64 ``data:`` URI)."""
    match = re.search(r"!\[loss curves\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", markdown)
    assert match, "no embedded loss-curve image"
    return base64.b64decode(match.group(1), validate=True)


def test_compare_table_differing_keys_and_plot(tracking: tuple[str, dict], tmp_path: Path) -> None:
    uri, runs = tracking
    client = MlflowClient(uri)
    exp_id = client.get_experiment_by_name(EXPERIMENT).experiment_id
    before = {r.info.run_id for r in client.search_runs([exp_id])}
    result = compare_experiment(EXPERIMENT, None, uri, log=True)
    by_name = {row["run"]: row for row in result.runs}
    summary = {
        name: summarize_run(client, client.get_run(run_id)) for name, (run_id, *_) in runs.items()
    }
    assert sorted(by_name) == sorted(VARIANTS)
    for name, (run_id, losses, ppl) in runs.items():
        row = by_name[name]
        assert row["run_id"] == run_id
        assert row["steps"] == len(losses)
        assert row["final_loss"] == pytest.approx(losses[-1])
        # The curve is the train stage's every step, not the parent's single final value.
        assert [v for _, v in summary[name].loss_curve] == pytest.approx(losses)
        assert row["eval_perplexity"] == pytest.approx(ppl)
        assert row["eval_loss"] == pytest.approx(math.log(ppl))  # what a sweep ranks by
        assert row["tokens_per_s"] > 0 and row["mfu_pct"] > 0
    # Exactly the keys the two configs differ in, with each run's value.
    assert sorted(result.differing_params) == ["optimizer.lr", "training.steps"]
    lr = result.differing_params["optimizer.lr"]
    assert float(lr[runs["lr-high"][0]]) == 1e-3 and float(lr[runs["lr-low"][0]]) == 1e-4
    assert "`optimizer.lr`" in result.markdown and "model.flavor" not in result.markdown
    assert result.run_specific_keys == []  # the runs were logged from configs, not run roots
    # For the Prefect UI's narrow artifact pane: a row per number and a column per run.
    table = result.markdown.splitlines()
    assert table[2] == "| run | lr-high | lr-low |"
    eval_row = next(line for line in table if line.startswith("| eval loss |"))
    assert eval_row.count("|") == 4

    record = client.get_run(result.compare_run_id)
    assert record.data.tags["titan.stage"] == "compare" and record.info.status == "FINISHED"
    assert sorted(a.path for a in client.list_artifacts(record.info.run_id)) == sorted(
        ["comparison.json", "comparison.md", PLOT_NAME]
    )
    png = Path(client.download_artifacts(record.info.run_id, PLOT_NAME, str(tmp_path)))
    width, height = _png_size(png.read_bytes())
    assert width >= 400 and height >= 200
    assert result.plot_uri.endswith(PLOT_NAME)
    # The image renders from the markdown itself, in MLflow's viewer as in Prefect's artifact.
    assert _embedded_png(result.markdown) == png.read_bytes()
    logged_md = Path(client.download_artifacts(record.info.run_id, "comparison.md", str(tmp_path)))
    # MLflow's viewer drops data: images: with a local store its copy names the PNG artifact
    # (with a server it links it: tests/test_deployments.py).
    assert f"*loss curves: `{PLOT_NAME}`, an artifact of this run.*" in logged_md.read_text()
    assert "data:image" not in logged_md.read_text()
    assert "data:image" not in result.table_markdown and "`optimizer.lr`" in result.table_markdown

    # The comparison run itself is never compared; chosen runs by name keep their order.
    again = compare_experiment(EXPERIMENT, ["lr-low", runs["lr-high"][0]], uri)
    assert [r["run"] for r in again.runs] == ["lr-low", "lr-high"]
    newest = compare_experiment(EXPERIMENT, None, uri, max_runs=1)
    assert [r["run"] for r in newest.runs] == ["lr-low"]
    # Unlogged comparisons leave the experiment alone: one run was added, by log=True.
    assert again.compare_run_id == newest.compare_run_id == "" and _embedded_png(again.markdown)
    after = {r.info.run_id for r in client.search_runs([exp_id])}
    assert after - before == {result.compare_run_id}


EVALS = {  # two runs' evaluators: the lower-loss run is the less accurate one
    "lr-high": {"eval/ns/acc": 0.3125, "eval/ns/acc_per_char": 0.25, "eval/ns/bits_per_byte": 2.5,
                "eval/corpus/loss": 4.25, "eval/corpus/perplexity": 70.1, "eval/ns/seconds": 1.5,
                "eval/lc/acc": 0.5, "eval/lc/acc_per_token": 0.375, "eval/lc/acc_per_char": 0.4},
    "lr-low": {"eval/ns/acc": 0.4375, "eval/corpus/loss": 4.5},
}  # fmt: skip


def test_compare_shows_the_evaluators_numbers(tmp_path: Path) -> None:
    """Each run's ``eval/<name>/<metric>`` (timings aside): in ``--json`` rows, as a row each
    in the markdown, and as a table of their own in the terminal, within 120 columns."""
    from rich.console import Console

    from titan_core.cli.compare import TEXT_WIDTH, print_comparison

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for name, overrides in VARIANTS.items():
        log_pipeline_run(uri, "evals", name, [*BASE, *overrides], evals=EVALS[name])
    result = compare_experiment("evals", None, uri)
    by_name = {row["run"]: row for row in result.runs}
    assert list(by_name["lr-high"]["evals"]) == [  # by evaluator, metrics in the docs' order
        "eval/corpus/loss", "eval/corpus/perplexity", "eval/lc/acc", "eval/lc/acc_per_token",
        "eval/lc/acc_per_char", "eval/ns/acc", "eval/ns/acc_per_char", "eval/ns/bits_per_byte",
    ]  # fmt: skip
    assert by_name["lr-low"]["evals"] == pytest.approx(EVALS["lr-low"])
    assert "| `eval/ns/acc` | 0.3125 | 0.4375 |" in result.markdown
    assert "| `eval/lc/acc` | 0.5000 | — |" in result.markdown  # the run without it: a dash
    assert "eval/ns/seconds" not in result.markdown
    assert max(len(line) for line in result.markdown.splitlines() if line[:1] == "|") <= 80
    console = Console(width=TEXT_WIDTH, record=True)
    print_comparison(result, console)
    text = console.export_text()
    assert max(map(len, text.splitlines())) <= TEXT_WIDTH
    assert "Evaluators on the final checkpoint (eval/<name>/<metric>)" in text
    assert "acc_per_token" in text and "0.3125" in text and "0.4375" in text
    assert "eval/<name>/<metric>: the run's [evaluators] on its final checkpoint" in text


def test_run_specific_keys_are_left_out_by_rule() -> None:
    """Keys that differ by construction are named apart from the differences: paths into each
    run's own folder (equal once run ids are masked, whichever run's folder they point into)
    and the sections that say where a run is recorded; a path into another place, or another
    step of a run, is a real difference."""
    run = "s3://bucket/out/exp/20261128-180000-ab12cd"  # a sweep's trials add -t<N>
    pairs = {
        "job.dump_folder": (f"{run}-t1", f"{run}-t2"),
        "tokenizer.path": (f"{run}-t1/tokenizer/t.model", f"{run}-t2/tokenizer/t.model"),
        "tracking.registered_model": ("exp", "exp-sweep"),
        "storage.progress": ("True", "False"),
        "optimizer.lr": ("0.001", "0.003"),
        "checkpoint.initial_load_path": (f"{run}/checkpoint/step-10", f"{run}/checkpoint/seed"),
        "data.path": ("/data/20261128-180000-ab12cd.jsonl", "/other/20261128-180000-ab12cd.jsonl"),
    }
    diff = {key: {"a": a, "b": b, "c": None} for key, (a, b) in pairs.items()}
    runs = [RunSummary(x, x, "FINISHED", params={"k": "v"} if x != "c" else {}) for x in "abc"]
    shown, left_out = split_run_specific(diff, runs)  # c logged no config: it has no say
    assert list(shown) == ["optimizer.lr", "checkpoint.initial_load_path", "data.path"]
    assert left_out == [
        "job.dump_folder",
        "tokenizer.path",
        "tracking.registered_model",
        "storage.progress",
    ]


def test_markdown_fits_a_narrow_pane() -> None:
    """Ten runs named by their (long) run ids and a long value: the runs are split over tables
    no wider than ``MARKDOWN_WIDTH`` characters, every run in one, the value cut in the middle."""
    ids = [f"{i}" * 32 for i in range(10)]
    rows = [
        {"run": f"20261128-1800{i:02d}-ab12cd", "run_id": run_id, "status": "FINISHED",
         "steps": 100, "final_loss": 8.1234, "eval_loss": 8.2345, "eval_perplexity": 3767.1,
         "tokens_per_s": 12345.6, "mfu_pct": 1.2345}
        for i, run_id in enumerate(ids)
    ]  # fmt: skip
    path = "s3://a-bucket/some/long/prefix/exp/20261128-180000-ab12cd/checkpoint/step-100"
    diff = {"checkpoint.initial_load_path": {run_id: path for run_id in ids}}
    markdown = render_markdown("exp", rows, diff, "", ["job.dump_folder"])
    tables = [line for line in markdown.splitlines() if line.startswith("|")]
    assert max(len(line) for line in tables) <= MARKDOWN_WIDTH
    heads = [line for line in tables if line.startswith("| run |")]
    assert len(heads) > 1 and sum(line.count("20261128-1800") for line in heads) == 10
    assert "| `checkpoint.initial_load_path` | s3://a-bucket…point/step-100 |" in markdown
    assert (
        "by construction (a run's own folder, where it is recorded): `job.dump_folder`." in markdown
    )


def test_compare_nests_under_a_parent_run(tracking: tuple[str, dict]) -> None:
    uri, runs = tracking
    client = MlflowClient(uri)
    exp_id = client.get_experiment_by_name(EXPERIMENT).experiment_id
    parent = client.create_run(exp_id, run_name="sweep-x", tags={"titan.stage": "sweep"})
    result = compare_experiment(
        EXPERIMENT,
        [r[0] for r in runs.values()],
        tracking_uri=uri,
        parent_run_id=parent.info.run_id,
    )
    record = client.get_run(result.compare_run_id)
    assert record.data.tags["mlflow.parentRunId"] == parent.info.run_id
    client.delete_run(parent.info.run_id)


def test_compare_bad_input_is_one_line(
    tracking: tuple[str, dict], capsys: pytest.CaptureFixture[str], monkeypatch, tmp_path: Path
) -> None:
    uri, _ = tracking
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))  # `titan compare` sets it
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    with pytest.raises(ConfigError) as missing:
        compare_experiment("no-such-experiment", None, uri)
    assert str(missing.value).startswith(
        f"job.experiment: no MLflow experiment named 'no-such-experiment' in {uri}"
    )
    with pytest.raises(ConfigError, match=r"^compare\.runs: no run nope"):
        compare_experiment(EXPERIMENT, ["nope"], uri)
    with pytest.raises(ConfigError, match=r"^compare\.runs: no run train"):  # a stage's name
        compare_experiment(EXPERIMENT, ["train"], uri)
    # A tracking server that does not answer: a one-line error before Prefect starts.
    code = titan_main(
        ["compare", "--experiment", EXPERIMENT, "--tracking.uri", "http://127.0.0.1:9"]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: tracking.uri: no MLflow server answers at")
    assert len(err.splitlines()) == 1
    code = titan_main(["compare", "--experiment", "missing", "--tracking.uri", uri])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(
        f"error: job.experiment: no MLflow experiment named 'missing' in {uri}"
    )
    # --experiment is an alias of the config key: one of the two.
    code = titan_main(["compare", "--experiment", "a", "--job.experiment", "b"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (
        "error: --experiment: an alias of --job.experiment, which is given too; give one"
    )
    # One spelling per setting, as in titan pipeline: the old flag names the config key.
    code = titan_main(["compare", "--experiment", EXPERIMENT, "--tracking-uri", uri])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (
        "error: --tracking-uri: now the config key --tracking.uri; use --tracking.uri VALUE"
    )
    # An unknown run, an experiment without runs: checked before Prefect starts (nothing of it
    # runs: no log lines, no PREFECT_HOME created).
    MlflowClient(uri).create_experiment("empty")
    for args, message in [
        (["--experiment", EXPERIMENT, "--runs", "lr-low", "nope"], "compare.runs: no run nope in "
         f"experiment {EXPERIMENT!r} (expected run ids or run names)"),
        (["--experiment", "empty"], "job.experiment: experiment 'empty' has no runs"),
    ]:  # fmt: skip
        code = titan_main(["compare", *args, "--tracking.uri", uri])
        out, err = capsys.readouterr()
        assert code == 2 and out == "" and err == f"error: {message}\n"
    assert not (tmp_path / "prefect").exists()


def test_compare_with_the_pipelines_recipe_reads_its_default_store(
    prefect_harness: Path,
    tracking: tuple[str, dict],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A pipeline run of a recipe records in the recipe's output root (``<root>/mlflow.db``,
    experiment job.experiment): ``titan compare --config RECIPE`` and the flow with ``recipe``
    find it there with nothing else given; another recipe's store is named as a hint."""
    from flows.compare import compare
    from titan_core.pipeline.compare import compare_target

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(prefect_harness))  # `titan compare` sets it
    recipe = "llama3_debugmodel_tiny"  # root ./outputs/llama3_debugmodel_tiny, experiment titan
    store = tmp_path / "outputs" / recipe / "mlflow.db"
    store.parent.mkdir(parents=True)
    run_id, *_ = log_pipeline_run(f"sqlite:///{store}", "titan", "only", BASE)
    code = titan_main(["compare", "--config", recipe, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out)  # stdout is the JSON alone: logs go to stderr
    assert result["experiment"] == "titan" and result["tracking_uri"] == f"sqlite:///{store}"
    assert [r["run_id"] for r in result["runs"]] == [run_id]
    state = compare(recipe=recipe, runs=["only"], return_state=True)
    assert [r["run_id"] for r in state.result().runs] == [run_id]
    # Found in the Prefect UI by what it compared: a name and tags, not a random name.
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as prefect:
        flow_run = prefect.read_flow_run(state.state_details.flow_run_id)
    assert flow_run.name == "compare/titan"
    assert {"experiment:titan", "compare"} <= set(flow_run.tags)
    # MLFLOW_TRACKING_URI wins over the root's store, as for the pipeline; tracking.uri over it.
    uri, _ = tracking
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert compare_target(recipe, "", {}) == ("titan", uri)
    assert compare_target(recipe, "", {"tracking.uri": "http://x:5000"}, "e") == (
        "e",
        "http://x:5000",
    )
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    # Another recipe's root has no store: one line naming where it looked and the stores found;
    # comparing only reads, so no store is created.
    capsys.readouterr()  # the flow run's log lines
    code = titan_main(["compare", "--config", "llama3_debugmodel"])
    err = capsys.readouterr().err.strip()
    looked = tmp_path / "outputs" / "llama3_debugmodel" / "mlflow.db"
    assert code == 2 and err == (
        f"error: job.experiment: no MLflow experiment named 'titan' in sqlite:///{looked}; other "
        f"stores: outputs/{recipe}/mlflow.db (titan compare --tracking.uri "
        f"sqlite:///outputs/{recipe}/mlflow.db --experiment titan)"
    )
    assert not looked.parent.exists()
    # The store exists but the experiment is another one (`make demo` records in "demo"): the
    # line says which experiments it has, as the command that reads them.
    code = titan_main(["compare", "--config", recipe, "--experiment", "titan-typo"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (
        f"error: job.experiment: no MLflow experiment named 'titan-typo' in sqlite:///{store}; "
        "it has 'titan' (titan compare --experiment titan)"
    )
