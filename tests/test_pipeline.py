"""The Prefect pipeline end to end, against real services: a Prefect API (test harness), MLflow on
SQLite, a real S3 server with enforced credentials (SeaweedFS) and a hub endpoint with a token.

One model line on S3 is trained three times and inspected by most tests:
  1. ``first_run``: pretrain_pipeline, 2 processes, tokenizer from ``hf://`` behind a token;
  2. ``second_run``: the same config again: cached tokenizer and seed, and training killed
     (SIGKILL) mid-save on its first attempt, so the retry must resume;
  3. ``retrained``: the retrain flow continuing the line on newly arrived data (prepare_data).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pipeline_helpers import (
    flow_logs,
    flow_run,
    run_flow,
    task_runs,
    tiny_values,
    unique_prefix,
)

from titan_core.checkpoint.manager import FAULT_ENV, complete_steps
from titan_core.config.schema import flatten

EXPERIMENT = "s3line"
HF_REPO, HF_FILE = "titan-org/tiny-bpe", "tokenizer/titan_bpe.tiktoken"
STAGES = [
    "start_tracking",
    "prepare_storage",
    "download_tokenizer",
    "preflight",
    "create_seed_checkpoint",
    "train",
    "upload_run_files",
    "convert_to_hf",
    "evaluate",
    "publish",
]
pytestmark = pytest.mark.multiprocess


# ------------------------------------------------------------------ the shared model line


@pytest.fixture(scope="module")
def hub(assets: Path) -> Iterator[Any]:
    """A hub endpoint serving the bundled tokenizer from a private repo (token required)."""
    from hf_hub_server import start_hf_hub

    from titan_core.data import default_tokenizer_path

    files = {HF_FILE: default_tokenizer_path().read_bytes()}
    server = start_hf_hub(HF_REPO, files, token="hf_" + secrets.token_hex(16))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def line(s3_server: Any, hub: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Output root on S3, MLflow on SQLite, and the S3 + hub credentials in the environment."""
    with pytest.MonkeyPatch.context() as mp:
        s3_server.set_env(mp)
        mp.setenv("HF_ENDPOINT", hub.endpoint)
        mp.setenv("HF_TOKEN", hub.token)
        mp.setenv("MLFLOW_S3_ENDPOINT_URL", s3_server.endpoint_url)
        db = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
        yield {"storage": s3_server.url(unique_prefix("line")), "tracking": f"sqlite:///{db}"}


def _line_form(line: dict) -> dict[str, Any]:
    """Where the line lives and its eval, as the typed ``config`` parameter takes them."""
    return {
        "job": {"dump_folder": line["storage"], "experiment": EXPERIMENT},
        "tracking": {"uri": line["tracking"]},
        "evaluate": {"batches": 2},
        "tokenizer": {"path": f"hf://{HF_REPO}@main/{HF_FILE}"},
    }


def _line_values(line: dict, steps: int, nproc: int) -> dict[str, Any]:
    """The tiny run's dotted-key overrides, with the line's form flattened in."""
    form = {f"{s}.{k}": v for s, table in _line_form(line).items() for k, v in table.items()}
    return form | tiny_values(steps=steps, nproc=nproc)


def _pretrain(line: dict, steps: int, nproc: int) -> tuple[Any, Any]:
    from flows.pipeline import pretrain_pipeline

    return run_flow(
        pretrain_pipeline,
        recipe="llama3_debugmodel_tiny",
        config=_line_form(line),
        overrides=tiny_values(steps=steps, nproc=nproc),
    )


@pytest.fixture(scope="module")
def first_run(prefect_harness: Path, line: dict) -> dict:
    """pretrain_pipeline on S3: 4 steps on 2 processes."""
    state, flow_run_id = _pretrain(line, steps=4, nproc=2)
    assert state.is_completed(), state.message
    return {"result": state.result(), "flow_run_id": flow_run_id}


@pytest.fixture(scope="module")
def second_run(first_run: dict, line: dict) -> dict:
    """The same config for 6 steps on 1 process; attempt 1 is SIGKILLed before committing step 4."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FAULT_ENV, "4")
        state, flow_run_id = _pretrain(line, steps=6, nproc=1)
    assert state.is_completed(), state.message
    return {"result": state.result(), "flow_run_id": flow_run_id}


def _client(line: dict) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=line["tracking"])


# ------------------------------------------------------------------ first run: the whole DAG


def test_every_artifact_lands_in_s3(first_run: dict, s3_server: Any) -> None:
    result = first_run["result"]
    root = result["run_root"]
    assert root.startswith(f"s3://{s3_server.bucket}/") and f"/{EXPERIMENT}/" in root
    fs = s3_server.filesystem()
    files = {p.removeprefix(root.removeprefix("s3://") + "/") for p in fs.find(root)}
    expected = {
        "config.toml",
        "tokenizer/titan_bpe.tiktoken",
        "checkpoint/seed/.titan_complete",
        "checkpoint/seed/.metadata",
        "checkpoint/step-2/.titan_complete",
        "checkpoint/step-4/.titan_complete",
        "hf/config.json",
        "hf/model.safetensors.index.json",
        "hf/tokenizer.json",
        "eval/report.json",
        "eval/report.md",
        "metrics.jsonl",
    }
    assert expected <= files, sorted(expected - files)
    assert any(f.startswith("hf/model-") and f.endswith(".safetensors") for f in files)
    assert any(f.startswith("logs/attempt-1/") for f in files)  # per-rank logs, uploaded
    assert complete_steps(root + "/checkpoint") == [2, 4]
    assert result["checkpoint"] == root + "/checkpoint/step-4"
    # The run trains with the stored tokenizer, downloaded from the hub with the token.
    config = fs.cat(root.removeprefix("s3://") + "/config.toml").decode()
    assert f'path = "{root}/tokenizer/titan_bpe.tiktoken"' in config
    jsonl = fs.cat(root.removeprefix("s3://") + "/metrics.jsonl").decode()
    rows = [json.loads(line) for line in jsonl.splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    report = json.loads(fs.cat(root.removeprefix("s3://") + "/eval/report.json"))
    assert report["step"] == 4 and report["metrics"]["loss"] == result["metrics"]["eval/loss"]


def _stored_params(s3_server: Any, run_root: str) -> dict[str, str]:
    """The run's config.toml flattened as MLflow params are: ``section.key`` -> str(value)."""
    import tomllib

    text = s3_server.filesystem().cat(run_root.removeprefix("s3://") + "/config.toml").decode()

    def flat(table: dict[str, Any], prefix: str) -> dict[str, str]:
        out: dict[str, str] = {}
        for key, v in table.items():
            if isinstance(v, dict):  # a nested section such as [launch.slurm]
                out |= flat(v, f"{prefix}{key}.")
            else:
                out[prefix + key] = json.dumps(v) if isinstance(v, list) else str(v)
        return out

    return flat(tomllib.loads(text), "")


def test_mlflow_parent_and_stage_runs(first_run: dict, line: dict, s3_server: Any) -> None:
    from titan_core.resolve import resolve_job

    client = _client(line)
    parent = client.get_run(first_run["result"]["mlflow_run_id"])
    assert (
        parent.info.status == "FINISHED" and parent.info.run_name == first_run["result"]["run_id"]
    )
    cfg = resolve_job("llama3_debugmodel_tiny", "", _line_values(line, 4, 2))
    params = parent.data.params
    assert set(params) == set(flatten(cfg)) and params["training.steps"] == "4"
    assert params["launch.nproc_per_node"] == "2"
    # The params are the config the ranks ran, key for key: the run's config.toml (auto values
    # resolved by preflight, the seed recorded); the train stage run carries the same.
    stored = _stored_params(s3_server, first_run["result"]["run_root"])
    # Tracking settings left empty in the config are logged as used: the registered model
    # defaults to the experiment (the store is this line's tracking.uri, given).
    assert stored["tracking.registered_model"] == "" and stored["tracking.uri"] == line["tracking"]
    stored["tracking.registered_model"] = EXPERIMENT
    assert params == stored
    auto = ["model.vocab_size", "model.n_layers", "model.max_seq_len"]
    auto += ["parallelism.data_parallel_shard_degree", "validation.local_batch_size"]
    assert all(params[k] not in ("-1", "-1.0") for k in auto), {k: params[k] for k in auto}
    assert params["parallelism.data_parallel_shard_degree"] == "2"
    assert params["checkpoint.initial_load_path"] == first_run["result"]["seed"]
    # One output root: the saved config's (and the params') job.dump_folder is the folder the
    # ranks wrote, <root>/<experiment>/<run_id>, and no storage.root is left to bridge.
    run_root = f"{line['storage']}/{EXPERIMENT}/{parent.info.run_name}"
    assert params["job.dump_folder"] == run_root == first_run["result"]["run_root"]
    assert not any(key.startswith("storage.root") for key in params)
    # What runs share comes from the root, never from a run's folder: the experiment's MLflow
    # artifacts (the store is the line's tracking.uri here) live under the root.
    experiment = client.get_experiment(parent.info.experiment_id)
    assert experiment.artifact_location == f"{line['storage']}/mlflow-artifacts/{EXPERIMENT}"
    tags = parent.data.tags
    assert tags["prefect.flow_run_id"] == str(first_run["flow_run_id"])
    assert tags["storage_root"] == first_run["result"]["run_root"]
    assert tags["world_size"] == "2" and tags["device"] == "cpu"
    assert len(tags["git_commit"]) == 40 or tags["git_commit"] == "unknown"
    children = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
    )
    stages = {run.data.tags["titan.stage"]: run for run in children}
    assert set(stages) == {"train", "convert", "evaluate"}
    assert all(run.info.status == "FINISHED" for run in children)
    # Step metrics streamed by rank 0 while training, equal to the run's metrics.jsonl.
    history = client.get_metric_history(stages["train"].info.run_id, "train/loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]
    assert history[-1].value == pytest.approx(first_run["result"]["metrics"]["train/loss"])
    # One naming scheme: the stage run and the parent chart the same train/* keys.
    names = {f"train/{k}" for k in ("loss", "tps", "mfu_pct", "grad_norm", "lr")}
    assert names <= set(stages["train"].data.metrics)
    assert not {"loss", "tps", "mfu_pct"} & set(stages["train"].data.metrics)
    assert {"train/loss", "train/tps", "eval/loss"} <= set(parent.data.metrics)
    # The config, plus the peak MFU divides by (recorded by rank 0's sink; a stage param).
    params = dict(stages["train"].data.params)
    assert params.pop("mfu.peak") == "metrics.cpu_peak_tflops"  # tiny_overrides set it
    assert float(params.pop("mfu.peak_tflops")) == float(stored["metrics.cpu_peak_tflops"])
    assert params == stored
    assert stages["evaluate"].data.metrics["eval/loss"] == pytest.approx(
        first_run["result"]["metrics"]["eval/loss"]
    )
    assert parent.data.metrics["eval/perplexity"] > 1
    # Every stage run reads on its own: the convert and evaluate runs carry the config too, the
    # train run its metrics.jsonl and config; a list param is JSON (items may hold commas).
    assert stages["convert"].data.params == stages["evaluate"].data.params == stored
    # The convert run says where its export is; its one metric is namespaced.
    convert = stages["convert"].data
    assert convert.tags["export/url"] == first_run["result"]["hf"]
    assert f"`{first_run['result']['hf']}`" in convert.tags["mlflow.note.content"]
    assert set(convert.metrics) == {"export/num_shards"} and convert.metrics["export/num_shards"]
    assert json.loads(stored["evaluate.prompts"]) == ["The Python language", "To be, or not to be,",
                                                      "A list comprehension"]  # fmt: skip
    train_files = {a.path for a in client.list_artifacts(stages["train"].info.run_id, "train")}
    assert train_files == {"train/metrics.jsonl", "train/config.toml"}
    # The parent: a description (the run summary), a source, curves, the model card.
    assert tags["mlflow.note.content"].startswith(f"# Run `{parent.info.run_name}`")
    assert tags["mlflow.source.name"].startswith("titan pipeline: ")
    parent_curve = client.get_metric_history(parent.info.run_id, "train/loss")
    assert {m.step for m in parent_curve} == {1, 2, 3, 4}
    run_files = {a.path for a in client.list_artifacts(parent.info.run_id, "run")}
    assert {"run/config.toml", "run/summary.md", "run/model_card.md"} <= run_files


def test_registered_model_version_loads_in_transformers(
    first_run: dict, line: dict, tmp_path: Path
) -> None:
    import mlflow
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = first_run["result"]
    assert result["model_name"] == EXPERIMENT and result["model_version"] == "1"
    client = _client(line)
    version = client.get_model_version(EXPERIMENT, "1")
    assert version.source == result["hf"] and version.run_id == result["mlflow_run_id"]
    eval_loss = result["metrics"]["eval/loss"]
    assert version.tags["eval_loss"] == f"{eval_loss:.4g}"  # rounded for people
    assert "recipe `llama3_debugmodel_tiny`" in version.description
    assert "4 steps" in version.description and f"eval loss {eval_loss:.4g}" in version.description
    assert str(client.get_model_version_by_alias(EXPERIMENT, "champion").version) == "1"
    # Resolved through the registry (no global tracking URI: other tests share this process).
    source = client.get_model_version_download_uri(EXPERIMENT, "1")
    local = mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(tmp_path))
    model = AutoModelForCausalLM.from_pretrained(local)
    tokenizer = AutoTokenizer.from_pretrained(local)
    # The model card: recipe, data, steps, tokens, eval numbers and which precision they are.
    card = (Path(local) / "README.md").read_text()
    assert "| recipe | `llama3_debugmodel_tiny` |" in card and "| training steps | 4 |" in card
    assert "llama3 / debugmodel_tiny" in card and f"| eval loss | {eval_loss:.4g} |" in card
    assert "The weights in this folder are **bfloat16**" in card
    assert "weights stored in float32, forward pass in float32" in card
    assert "AutoModelForCausalLM.from_pretrained(" in card and "aws s3 sync" in card
    ids = tokenizer("The quick brown fox", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits  # (1, seq, vocab)
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_prefect_flow_and_every_task_completed(first_run: dict) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    assert flow_run(first_run["flow_run_id"]).state.is_completed()
    runs = task_runs(first_run["flow_run_id"])
    assert list(runs) == STAGES
    assert all(r.state.is_completed() for rs in runs.values() for r in rs)
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[first_run["flow_run_id"]])
            )
        )
    by_key = {a.key: a for a in artifacts}
    assert {"run-summary", "run-metrics", "run-root", "hf-export"} <= set(by_key)
    # A count reads as one (eval/num_tokens 2,048, not 2048.0000); a healthy run is no drill.
    num_tokens = first_run["result"]["metrics"]["eval/num_tokens"]
    assert f"| eval/num_tokens | {int(num_tokens):,} |" in by_key["run-summary"].data
    assert "drill" not in by_key["run-summary"].data and not first_run["result"]["drill"]
    # The evaluation's report with its greedy samples, and the way to the run in MLflow.
    assert "## Greedy samples" in by_key["evaluation-report"].data
    mlflow_run = by_key["mlflow-run"].data
    assert first_run["result"]["mlflow_run_id"] in mlflow_run
    experiment_id = first_run["result"]["mlflow_experiment_id"]
    assert f"/#/experiments/{experiment_id}/runs/{first_run['result']['mlflow_run_id']}" in (
        mlflow_run
    )
    # Where the run lives, in a form that opens: the S3 URL and the CLI command, not file://.
    root = first_run["result"]["run_root"]
    assert by_key["run-root"].type == "markdown" and "aws s3 ls" in by_key["run-root"].data
    assert f"{root}/" in by_key["run-root"].data and by_key["run-root"].description
    # The flow run is named after the run id and tagged so it can be found.
    run = flow_run(first_run["flow_run_id"])
    assert run.name == f"{EXPERIMENT}/{first_run['result']['run_id']}"
    tags = {f"experiment:{EXPERIMENT}", "recipe:llama3_debugmodel_tiny"}
    assert tags | {"model:llama3/debugmodel_tiny"} <= set(run.tags)
    # Named from its start: the first log line names the run id, not a random name.
    beginning = [m for m in flow_logs(first_run["flow_run_id"]) if "Beginning flow run" in m]
    assert beginning == [f"Beginning flow run '{first_run['result']['run_id']}' for flow "
                         "'pretrain_pipeline'"], beginning  # fmt: skip


def test_convert_and_evaluate_flows_on_a_stored_checkpoint(first_run: dict, tmp_path: Path) -> None:
    from flows.convert import convert
    from flows.evaluate import evaluate

    step2 = first_run["result"]["run_root"] + "/checkpoint/step-2"
    hf = convert(
        checkpoint=step2, output=str(tmp_path / "hf"), overrides={"convert.dtype": "float32"}
    )
    config = json.loads((Path(hf) / "config.json").read_text())
    assert hf == str(tmp_path / "hf") and config["torch_dtype"] == "float32"
    assert (Path(hf) / "model.safetensors.index.json").exists()
    report = evaluate(
        checkpoint=step2, output=str(tmp_path / "eval"), overrides={"evaluate.batches": 2}
    )
    assert report.step == 2 and report.checkpoint == step2
    saved = json.loads((tmp_path / "eval" / "eval" / "report.json").read_text())
    assert saved["metrics"]["num_batches"] == 2
    assert saved["metrics"]["loss"] == report.metrics["loss"]


# ------------------------------------------------------------------ second run: cache and faults


def test_second_run_reuses_cached_tokenizer_and_seed(first_run: dict, second_run: dict) -> None:
    runs = task_runs(second_run["flow_run_id"])
    for name in ("download_tokenizer", "create_seed_checkpoint"):
        (run,) = runs[name]
        assert run.state.name == "Cached", (name, run.state)
        assert run.total_run_time.total_seconds() < 1.0
    first, second = first_run["result"], second_run["result"]
    assert second["tokenizer"] == first["tokenizer"] and second["seed"] == first["seed"]
    logs = "\n".join(flow_logs(second_run["flow_run_id"]))
    assert f"from initial_load_path {first['seed']}" in logs  # the first run's seed, by reference


def test_killed_training_resumes_from_newest_complete_checkpoint(
    second_run: dict, line: dict
) -> None:
    (train,) = task_runs(second_run["flow_run_id"])["train"]
    assert train.run_count == 2 and train.state.is_completed()
    logs = flow_logs(second_run["flow_run_id"])
    text = "\n".join(logs)
    assert "Attempt 1: training to step 6 from the seed checkpoint" in text
    assert "rank 0 was killed by SIGKILL" in text
    # step-4 was fully written but never committed: the retry must not take it for complete.
    assert "Attempt 2: training to step 6 from step-2, the newest complete checkpoint" in text
    root = second_run["result"]["run_root"]
    loaded = [m for m in logs if "INFO Loaded" in m]
    assert loaded and f"from {root}/checkpoint/step-2 (step 2)" in loaded[-1]
    assert complete_steps(root + "/checkpoint") == [2, 4, 6]
    assert second_run["result"]["checkpoint"] == root + "/checkpoint/step-6"
    client = _client(line)
    train_run = client.search_runs(
        [client.get_experiment_by_name(EXPERIMENT).experiment_id],
        filter_string=(
            f"tags.mlflow.parentRunId = '{second_run['result']['mlflow_run_id']}' "
            "and tags.`titan.stage` = 'train'"
        ),
    )
    assert len(train_run) == 1  # the retry logged into the same stage run
    steps = {m.step for m in client.get_metric_history(train_run[0].info.run_id, "train/loss")}
    # Every step of the attempt that finished (what the killed one had not sent yet is lost).
    assert {3, 4, 5, 6} <= steps <= {1, 2, 3, 4, 5, 6}


def test_secrets_never_reach_logs_params_artifacts_or_configs(
    first_run: dict, second_run: dict, line: dict, s3_server: Any, hub: Any, tmp_path: Path
) -> None:
    assert any(authorized for _, _, authorized in hub.requests)  # the token was really used
    needles = [s3_server.secret_key.encode(), hub.token.encode()]
    haystacks: dict[str, bytes] = {}
    for run in (first_run, second_run):
        fid = run["flow_run_id"]
        haystacks[f"prefect logs {fid}"] = "\n".join(flow_logs(fid)).encode()
        haystacks[f"prefect params {fid}"] = json.dumps(flow_run(fid).parameters).encode()
    client = _client(line)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    # MLflow's UI opens it on its model-training views, not the GenAI (traces) ones.
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    for run in client.search_runs([experiment.experiment_id]):
        rid = run.info.run_id
        haystacks[f"mlflow params/tags {rid}"] = json.dumps(
            [run.data.params, run.data.tags]
        ).encode()
        local = Path(client.download_artifacts(rid, "", str(tmp_path / rid)))
        for path in local.rglob("*"):
            if path.is_file():
                haystacks[f"mlflow artifact {path}"] = path.read_bytes()
    fs = s3_server.filesystem()
    prefix = line["storage"].removeprefix("s3://")
    for key in fs.find(prefix):
        if not key.endswith((".safetensors", ".distcp")):  # weights cannot hold a string
            haystacks[f"s3 {key}"] = fs.cat(key)
    assert any(k.endswith("config.toml") for k in haystacks)
    assert sum(k.startswith("mlflow artifact") for k in haystacks) >= 4
    leaks = [name for name, data in haystacks.items() for n in needles if n in data]
    assert not leaks


def test_retrain_continues_line_and_moves_champion_only_if_better(
    second_run: dict, line: dict, s3_server: Any, assets: Path, tmp_path: Path
) -> None:
    from flows.retrain import retrain

    # New data arrives with the retrain: a local folder, prepared on S3 (the line's data root).
    lines = (assets / "corpus" / "train" / "part-0001.jsonl").read_text().splitlines()
    (tmp_path / "newdata").mkdir()
    for i, name in enumerate(["a.jsonl", "b.jsonl"]):
        (tmp_path / "newdata" / name).write_text("\n".join(lines[i * 40 : (i + 1) * 40]) + "\n")
    client = _client(line)
    before = client.get_model_version_by_alias(EXPERIMENT, "champion")
    # The line's recipe, with the root and store pretrain_pipeline was given over the recipe's.
    state, flow_run_id = run_flow(
        retrain,
        steps=2,
        recipe="llama3_debugmodel_tiny",
        config={
            "job": {"dump_folder": line["storage"], "experiment": EXPERIMENT},
            "tracking": {"uri": line["tracking"]},
        },
        overrides={
            # The line's last run trained on 1 rank and saved FSDP degree 1: 2 ranks now.
            "launch.nproc_per_node": 2,
            "launch.retry_delay_seconds": 0,
            "data.sources": [str(tmp_path / "newdata")],
            "data.validation_every": 5,
            "data.workers": 1,
        },
    )
    assert state.is_completed(), state.message
    result = state.result()
    assert result["continued_from"] == second_run["result"]["checkpoint"]
    assert result["checkpoint"].endswith("/checkpoint/step-8")  # 6 + 2 steps
    new_loss = result["metrics"]["eval/loss"]
    old_loss = client.get_run(before.run_id).data.metrics["eval/loss"]  # exact; the tag rounds
    after = client.get_model_version_by_alias(EXPERIMENT, "champion")
    assert result["champion"] == (new_loss < old_loss)
    expected = result["model_version"] if result["champion"] else before.version
    assert str(after.version) == str(expected)
    # The prepare_data stage ran (one shard task per file) before preflight, and the run trained
    # on the prepared dataset: its config names it, its dataset.json records it.
    runs = task_runs(flow_run_id)
    names = list(runs)
    shard_tasks = ["tokenize_shard[newdata/a.jsonl]", "tokenize_shard[newdata/b.jsonl]"]
    assert names.index("prepare_data") < names.index("preflight")
    assert sorted(n for n in names if n.startswith("tokenize_shard")) == shard_tasks
    assert all(r.state.is_completed() for n in ["prepare_data", *shard_tasks] for r in runs[n])
    # Data is shared by the runs of a root: under the root, not under a run's folder.
    assert result["dataset"].startswith(line["storage"] + "/data/")
    assert not result["dataset"].startswith(result["run_root"] + "/")
    assert "recipe:llama3_debugmodel_tiny" in flow_run(flow_run_id).tags
    assert result["dataset_train_shards"] == 2 and result["dataset_grew"] is False
    fs = s3_server.filesystem()
    config = fs.cat(result["run_root"].removeprefix("s3://") + "/config.toml").decode()
    assert f'dataset = "{result["dataset"]}"' in config
    record = json.loads(fs.cat(result["run_root"].removeprefix("s3://") + "/dataset.json"))
    assert record["url"] == result["dataset"] and record["train_shards"] == 2


def test_retrain_looks_for_the_line_where_its_recipe_writes(
    prefect_harness: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given only the recipe, retrain looks where pretrain_pipeline of that recipe writes: the
    recipe's output root and experiment (no line there yet: one line saying so)."""
    from flows.retrain import retrain
    from titan_core.errors import CheckpointError

    monkeypatch.chdir(tmp_path)
    for recipe, root in [
        ("llama3_debugmodel_tiny", "outputs/llama3_debugmodel_tiny"),
        ("", "outputs"),
    ]:
        with pytest.raises(CheckpointError) as err:
            retrain(steps=1, recipe=recipe)
        assert str(err.value) == (
            f"retrain: no complete checkpoint under {tmp_path / root / 'titan'}; run the "
            "pretrain pipeline for this experiment first"
        )
