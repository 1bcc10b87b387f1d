"""``pretrain_pipeline``: config → tokenizer → [prepare_data] → preflight → seed → train → export
→ eval → publish.

Every stage is a task in ``tasks/`` passing URLs; this module only composes them. Stages that
need a service come in the order of need, so a bad tracking URI, storage URL or tokenizer source
fails at its own stage, before anything is trained.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefect import flow

from flows.config import resolve_job, run_config
from tasks.convert import convert_to_hf
from tasks.data import (
    PreparedData,
    is_stored,
    prepare_data,
    prepare_params,
    record_dataset,
    train_on,
)
from tasks.evaluate import evaluate
from tasks.preflight import preflight
from tasks.publish import publish
from tasks.runs import prepare_storage, start_tracking
from tasks.seed import create_seed_checkpoint, is_complete, seed_identity
from tasks.storage import RunPaths, absolute, new_run_id
from tasks.tokenizer import download_tokenizer, tokenizer_source
from tasks.tracking import TrackingContext, end_pipeline_run
from tasks.train import train, upload_run_files
from titan_core import storage
from titan_core.config.job import JobConfig
from titan_core.config.manager import to_toml


def cached(task_fn: Any, valid: Callable[[Any], bool], **kwargs: Any) -> Any:
    """Run a cached task; run it afresh when the cached result no longer exists in storage."""
    result = task_fn(**kwargs)
    if not valid(result):
        result = task_fn.with_options(refresh_cache=True)(**kwargs)
    return result


def train_with_retries(cfg: JobConfig) -> Any:
    """The train task with ``launch.retries`` retries, the delay doubling each time."""
    delays = [cfg.launch.retry_delay_seconds * 2**i for i in range(cfg.launch.retries)]
    return train.with_options(retries=cfg.launch.retries, retry_delay_seconds=delays or 0)


def train_and_publish(
    cfg: JobConfig,
    paths: RunPaths,
    tracking: TrackingContext | None,
    *,
    seed_url: str,
    eval_batches: int,
) -> dict[str, Any]:
    """Train the run's stored config, upload its files, export, evaluate and publish."""
    checkpoint = train_with_retries(cfg)(paths.config, seed_url, tracking)
    upload_run_files(paths.config)
    hf_url = convert_to_hf(checkpoint, paths.config, tracking=tracking)
    evaluation = evaluate(checkpoint, paths.config, max_batches=eval_batches, tracking=tracking)
    summary = publish(
        paths.run_root, checkpoint, hf_url, evaluation, tracking, cfg.tracking.registered_model
    )
    return {**summary, "tracking_uri": tracking.uri if tracking else ""}


def prepare_stage(cfg: JobConfig, paths: RunPaths, tokenizer_url: str) -> PreparedData | None:
    """The ``prepare_data`` stage when the config names ``data.sources`` (cached: a rerun with
    the same sources and tokenizer tokenizes nothing); records the dataset in the run root."""
    if not cfg.data.sources:
        return None
    prepared = cached(prepare_data, is_stored, **prepare_params(cfg, tokenizer_url))
    record_dataset(paths.run_root, prepared)
    return prepared


def run_tracked(
    cfg: JobConfig, paths: RunPaths, body: Callable[[TrackingContext | None], dict[str, Any]]
) -> dict[str, Any]:
    """Open the parent MLflow run (if tracking is on), run ``body``, close it with its status."""
    tracking = start_tracking(cfg, paths) if cfg.tracking.enable else None
    try:
        result = body(tracking)
    except BaseException:
        end_pipeline_run(tracking, "FAILED")
        raise
    end_pipeline_run(tracking, "FINISHED")
    return {**result, "mlflow_run_id": tracking.parent_run_id if tracking else ""}


@flow(name="pretrain_pipeline")
def pretrain_pipeline(
    module: str = "llama3",
    config: str = "llama3_debugmodel",
    config_file: str = "",
    overrides: list[str] | None = None,
    storage_root: str = "",
    tracking_uri: str = "",
    run_id: str = "",
    eval_batches: int = 20,
) -> dict[str, Any]:
    """Pre-train a model from a config to a published, evaluated Hugging Face export.

    ``module``/``config`` pick a registry recipe (give ``config_file`` alone with both empty),
    ``overrides`` are ``--section.field value`` tokens, ``storage_root``/``tracking_uri`` replace
    ``storage.root``/``tracking.uri``. ``run_id`` reuses a run root (resuming its training).
    Returns the run's summary: URLs, metrics, MLflow run and model version.
    """
    cfg = resolve_job(module, config, config_file, overrides, storage_root, tracking_uri)
    paths = RunPaths(absolute(cfg.storage.root), cfg.job.experiment, run_id or new_run_id())

    def body(tracking: TrackingContext | None) -> dict[str, Any]:
        """The stages inside the parent MLflow run."""
        prepare_storage(paths, cfg.storage.credentials_block)
        source = tokenizer_source(cfg.tokenizer.path)
        tokenizer_url = cached(
            download_tokenizer,
            storage.exists,
            source=source,
            dest=paths.path("tokenizer"),
            storage_root=paths.root,
            attempts=cfg.storage.retries,
            progress=cfg.storage.progress,
        )
        prepared = prepare_stage(cfg, paths, tokenizer_url)
        job = run_config(cfg, paths, tokenizer_url)
        if prepared is not None:
            job = train_on(job, prepared)
        summary = preflight(to_toml(job), paths.config)
        seed_url = cached(
            create_seed_checkpoint,
            is_complete,
            config_url=paths.config,
            identity=seed_identity(job, summary["model_args"]),
        )
        result = train_and_publish(
            job, paths, tracking, seed_url=seed_url, eval_batches=eval_batches
        ) | {"tokenizer": tokenizer_url, "seed": seed_url, "preflight": summary}
        return result | (prepared.summary() if prepared else {})

    return run_tracked(cfg, paths, body)
