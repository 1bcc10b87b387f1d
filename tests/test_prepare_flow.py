"""The ``prepare_data`` stage in Prefect: one ``tokenize_shard`` task run per source file on local
processes or a real Dask cluster, Cached when nothing changed, increments that tokenize only the
new file, and bad input that fails once, with one line.

One small corpus (three jsonl files of the bundled corpus's documents) is prepared by ``first``
and reused by every test; the append test removes its file again, so any order works.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pipeline_helpers import run_flow, task_runs
from prefect import flow

from tasks.data import prepare_data
from titan_core.pipeline.stages.data import PreparedData

pytestmark = pytest.mark.multiprocess
DOCS_PER_FILE = 30
VALIDATION_EVERY = 10


@flow(name="prepare_data_test")
def prepare_flow(params: dict[str, Any]) -> PreparedData:
    """The stage alone, as the pipeline runs it."""
    return prepare_data(**params)


def _params(corpus: Path, root: Path, **overrides: Any) -> dict[str, Any]:
    from titan_core.data import default_tokenizer_path

    return {
        "sources": [str(corpus)],
        "text_field": "text",
        "validation_every": VALIDATION_EVERY,
        "tokenizer_path": str(default_tokenizer_path()),
        "root": str(root),
        "workers": 2,
    } | overrides


def _runs(flow_run_id: Any) -> list[Any]:
    """Every task run of a flow run, in start order."""
    runs = [r for rs in task_runs(flow_run_id).values() for r in rs]
    return sorted(runs, key=lambda r: r.expected_start_time or r.created)


def _shard_runs(flow_run_id: Any) -> list[Any]:
    return [r for r in _runs(flow_run_id) if r.name.startswith("tokenize_shard[")]


def _stage_run(flow_run_id: Any) -> Any:
    (run,) = [r for r in _runs(flow_run_id) if r.name.startswith("prepare_data-")]
    return run


def _files(url: str) -> dict[str, bytes]:
    """Every file of a prepared dataset, by relative path."""
    base = Path(url)
    return {str(p.relative_to(base)): p.read_bytes() for p in base.rglob("*") if p.is_file()}


def _write_docs(path: Path, docs: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))


@pytest.fixture(scope="module")
def documents(assets: Path) -> list[str]:
    """Real English documents from the bundled corpus (four files' worth)."""
    lines = (assets / "corpus" / "train" / "part-0000.jsonl").read_text().splitlines()
    return [json.loads(line)["text"] for line in lines[: 4 * DOCS_PER_FILE]]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, documents: list[str]) -> Path:
    folder = tmp_path_factory.mktemp("prepare_flow") / "corpus"
    folder.mkdir()
    for i in range(3):
        _write_docs(
            folder / f"part-{i}.jsonl", documents[i * DOCS_PER_FILE : (i + 1) * DOCS_PER_FILE]
        )
    return folder


@pytest.fixture(scope="module")
def first(prefect_harness: Path, corpus: Path) -> dict[str, Any]:
    """The corpus prepared on two local processes."""
    root = corpus.parent / "data"
    state, flow_run_id = run_flow(prepare_flow, params=_params(corpus, root))
    assert state.is_completed(), state.message
    result = state.result()
    return {"root": root, "flow_run_id": flow_run_id, "result": result, "files": _files(result.url)}


def test_each_file_is_a_tokenize_shard_task_run_under_prepare_data(
    first: dict[str, Any], documents: list[str]
) -> None:
    from titan_core.data import Tokenizer, default_tokenizer_path

    stage = _stage_run(first["flow_run_id"])
    assert stage.state.name == "Completed" and stage.run_count == 1
    shards = _shard_runs(first["flow_run_id"])
    assert sorted(r.name for r in shards) == [
        f"tokenize_shard[corpus/part-{i}.jsonl]" for i in range(3)
    ]
    for run in shards:
        assert run.state.is_completed()
        assert [p.id for p in run.task_inputs["__parents__"]] == [stage.id]  # nested in the UI
    result = first["result"]
    assert isinstance(result, PreparedData)
    assert result.url == f"{first['root']}/{result.url.rsplit('/', 1)[1]}"
    assert (result.train_shards, result.new_shards, result.reused_units) == (3, 6, 0)
    tokenizer = Tokenizer(str(default_tokenizer_path()))
    lengths = [len(tokenizer.encode(d, bos=True, eos=True)) for d in documents[: 3 * DOCS_PER_FILE]]
    held_out = [n for i, n in enumerate(lengths) if i % DOCS_PER_FILE % VALIDATION_EVERY == 9]
    assert result.validation_tokens == sum(held_out)
    assert result.train_tokens == sum(lengths) - sum(held_out)
    names = [s["name"] for s in json.loads(first["files"]["manifest.json"])["shards"]]
    shard_files = [f"shards/{n}.{ext}" for n in names for ext in ("docs", "tokens")]
    assert sorted(first["files"]) == sorted(["manifest.json", *shard_files])


def test_rerun_is_cached_and_tokenizes_nothing(first: dict[str, Any], corpus: Path) -> None:
    state, flow_run_id = run_flow(prepare_flow, params=_params(corpus, first["root"]))
    assert state.is_completed()
    assert _stage_run(flow_run_id).state.name == "Cached"
    assert _shard_runs(flow_run_id) == []
    assert state.result() == first["result"]
    assert _files(first["result"].url) == first["files"]


def test_appended_file_tokenizes_only_its_shards(
    first: dict[str, Any], corpus: Path, documents: list[str]
) -> None:
    new = corpus / "part-3.jsonl"
    _write_docs(new, documents[3 * DOCS_PER_FILE :])
    try:
        state, flow_run_id = run_flow(prepare_flow, params=_params(corpus, first["root"]))
    finally:
        new.unlink()  # the corpus as the other tests know it (the dataset keeps the shards)
    assert state.is_completed(), state.message
    assert _stage_run(flow_run_id).state.name == "Completed"
    assert [r.name for r in _shard_runs(flow_run_id)] == ["tokenize_shard[corpus/part-3.jsonl]"]
    result = state.result()
    assert result.url == first["result"].url
    assert (result.train_shards, result.new_shards, result.reused_units) == (4, 2, 3)
    files = _files(result.url)
    old_shards = {k: v for k, v in first["files"].items() if k != "manifest.json"}
    assert {k: files[k] for k in old_shards} == old_shards  # old bytes never rewritten
    assert len(files) == len(first["files"]) + 4
    manifest = json.loads(files["manifest.json"])
    assert [Path(f["url"]).name for f in manifest["files"]][-1] == "part-3.jsonl"


def test_dask_cluster_prepares_the_same_bytes_as_local_processes(
    first: dict[str, Any], corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dask.distributed import LocalCluster

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with LocalCluster(
        n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None
    ) as cluster:
        params = _params(corpus, tmp_path / "data", dask_address=cluster.scheduler_address)
        state, flow_run_id = run_flow(prepare_flow, params=params)
        ran_on_cluster = "tokenize_shard" in cluster.scheduler.task_prefixes
    assert state.is_completed(), state.message
    assert ran_on_cluster
    shards = _shard_runs(flow_run_id)
    assert len(shards) == 3 and all(r.state.is_completed() for r in shards)
    dask_files = _files(state.result().url)
    assert sorted(dask_files) == sorted(first["files"])
    for name, data in first["files"].items():
        assert dask_files[name] == data, name


@pytest.mark.parametrize("case", ["unknown_source", "missing_field", "missing_field_later"])
def test_bad_input_fails_the_stage_once_with_one_line(
    case: str, first: dict[str, Any], corpus: Path, tmp_path: Path
) -> None:
    if case == "unknown_source":
        params = _params(tmp_path / "nosuch", tmp_path / "data")
        expected, failed_in = f"{tmp_path / 'nosuch'}: source not found", "prepare_data"
    elif case == "missing_field":
        params = _params(corpus, tmp_path / "data", text_field="body")
        expected, failed_in = "rows have no field 'body'", "prepare_data"
    else:  # the plan reads only the first file: the second one's rows fail in its shard task
        folder = tmp_path / "mixed"
        folder.mkdir()
        (folder / "a.jsonl").write_text('{"text": "a fine document"}\n')
        (folder / "b.jsonl").write_text('{"body": "no text field"}\n')
        params = _params(folder, tmp_path / "data", workers=1)
        expected, failed_in = f"{folder / 'b.jsonl'}: rows have no field 'text'", "tokenize_shard"
    state, flow_run_id = run_flow(prepare_flow, params=params)
    assert state.is_failed()
    error = str(state.result(raise_on_failure=False))
    assert expected in error and "\n" not in error
    stage = _stage_run(flow_run_id)
    assert stage.state.is_failed() and stage.run_count == 1  # user input: never retried
    shards = _shard_runs(flow_run_id)
    if failed_in == "tokenize_shard":
        (bad,) = [r for r in shards if r.name == "tokenize_shard[mixed/b.jsonl]"]
        assert bad.state.is_failed() and bad.run_count == 1
    else:
        assert shards == []
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").rglob("manifest.json"))


def test_retrain_drops_the_data_position_only_when_the_dataset_grew(tmp_path: Path) -> None:
    import dataclasses

    from titan_core.pipeline.stages.data import dataset_grew, record_dataset
    from titan_core.pipeline.stages.model_line import CheckpointInfo, continued_config
    from titan_core.resolve import resolve_job

    prepared = PreparedData(
        url=str(tmp_path / "data" / "0123456789abcdef"),
        train_shards=3,
        train_tokens=900,
        validation_tokens=90,
        new_shards=6,
        reused_units=0,
    )
    run_root = str(tmp_path / "line" / "run-1")
    assert not dataset_grew(run_root, prepared)  # a run from before prepare_data: no record
    record_dataset(run_root, prepared)
    grown = dataclasses.replace(prepared, train_shards=4, train_tokens=1200)
    assert not dataset_grew(run_root, prepared)
    assert dataset_grew(run_root, grown)
    assert not dataset_grew(run_root, dataclasses.replace(grown, url=str(tmp_path / "other")))
    cfg = resolve_job("llama3_debugmodel_tiny", "", {"dataloader.dataset": prepared.url})
    latest = CheckpointInfo(
        step_dir=f"{run_root}/checkpoint/step-6",
        run_root=run_root,
        step=6,
        model_only=False,
        time=0.0,
        config_url=f"{run_root}/config.toml",
    )
    same = continued_config(cfg, latest, cfg, 2)
    assert "dataloader" not in same.checkpoint.exclude_from_loading and same.training.steps == 8
    more = continued_config(cfg, latest, cfg, 2, new_data=True)
    assert "dataloader" in more.checkpoint.exclude_from_loading


def test_retrain_re_resolves_the_autos_a_saved_config_froze() -> None:
    """A saved config.toml holds its run's resolved autos: a retrain resolves the FSDP degree
    again (the world may change), and the RoPE length / validation batch when the new run
    changes the sequence length / batch they follow; a value given for the new run stays."""
    import dataclasses

    from titan_core.config.job import JobConfig
    from titan_core.pipeline.stages.model_line import reresolve_autos

    cfg = JobConfig()
    saved = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, max_seq_len=256),
        parallelism=dataclasses.replace(cfg.parallelism, data_parallel_shard_degree=2),
        validation=dataclasses.replace(cfg.validation, local_batch_size=8),
    )
    same = reresolve_autos(saved, {"launch.nproc_per_node": 4})
    assert same.parallelism.data_parallel_shard_degree == -1
    assert same.model.max_seq_len == 256 and same.validation.local_batch_size == 8
    longer = reresolve_autos(saved, {"training.seq_len": 512, "training.local_batch_size": 4})
    assert longer.model.max_seq_len == -1 and longer.validation.local_batch_size == -1
    given = reresolve_autos(saved, {"parallelism.data_parallel_shard_degree": 2})
    assert given.parallelism.data_parallel_shard_degree == 2
