"""``pretrain_pipeline``: config → tokenizer → [prepare_data] → preflight → seed → train → export
→ eval → publish.

Every stage is a task in ``tasks/`` passing URLs; this module only composes them. Stages that
need a service come in the order of need, so a bad tracking URI, storage URL or tokenizer source
fails at its own stage, before anything is trained.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from prefect import flow

from tasks.convert import convert_to_hf
from tasks.data import prepare_data
from tasks.evaluate import evaluate
from tasks.preflight import preflight
from tasks.publish import publish
from tasks.runs import prepare_storage, start_tracking
from tasks.runtime import current_run_id, name_flow_run, result_storage, run_id_name
from tasks.seed import create_seed_checkpoint
from tasks.tokenizer import download_tokenizer
from tasks.train import train, upload_run_files
from titan_core import storage
from titan_core.config.form import NO_VALUES, ConfigParameter, ValuesParameter, flow_values
from titan_core.config.job import JobConfig
from titan_core.pipeline.run.common import public_url
from titan_core.pipeline.run.config import DEFAULT_RECIPE, flow_run_tags, run_config
from titan_core.pipeline.run.paths import RunPaths, absolute
from titan_core.pipeline.run.tracking import TrackingContext, end_pipeline_run
from titan_core.pipeline.stages.data import (
    PreparedData,
    is_stored,
    prepare_params,
    record_dataset,
    train_on,
)
from titan_core.pipeline.stages.preflight import Preflight
from titan_core.pipeline.stages.seed import is_complete, seed_identity
from titan_core.pipeline.stages.tokenizer import tokenizer_source
from titan_core.resolve import resolve_job


def cached(task_fn: Any, valid: Callable[[Any], bool], paths: RunPaths, /, **kwargs: Any) -> Any:
    """Run a cached task, its results in the output root (``paths.results``: one cache for the
    CLI, workers and schedules); run it afresh when the cached result no longer exists."""
    task_fn = task_fn.with_options(result_storage=result_storage(paths.results))
    result = task_fn(**kwargs)
    if not valid(result):
        result = task_fn.with_options(refresh_cache=True)(**kwargs)
    return result


def train_with_retries(cfg: JobConfig) -> Any:
    """The train task with ``launch.retries`` retries, the delay doubling each time."""
    delays = [cfg.launch.retry_delay_seconds * 2**i for i in range(cfg.launch.retries)]
    return train.with_options(retries=cfg.launch.retries, retry_delay_seconds=delays or 0)


def train_and_publish(
    checked: Preflight,
    paths: RunPaths,
    tracking: TrackingContext | None,
    *,
    seed_url: str,
) -> dict[str, Any]:
    """Train the config preflight checked and stored, upload its files, export, evaluate and
    publish; returns the publication's fields (``Publication``), the tracking URI and the
    train run's health counts (``HealthCounts``) as plain data. Every stage gets the resolved
    config itself (``checked.config``); only the ranks read the stored ``config.toml``."""
    cfg = checked.config
    trained = train_with_retries(cfg)(cfg, paths.config, seed_url, tracking)
    checkpoint = trained.checkpoint
    upload_run_files(cfg)
    hf_url = convert_to_hf(checkpoint, cfg, tracking=tracking)  # its [convert] section
    evaluation = evaluate(checkpoint, cfg, tracking=tracking)  # its [evaluate] section
    published = publish(
        paths.run_root,
        checkpoint,
        hf_url,
        evaluation,
        tracking,
        cfg.tracking.registered_model,
        drill=cfg.debug.drill,  # a drill is summarised, never registered
        champion_metric=cfg.tracking.champion_metric,
    )
    uri = public_url(tracking.uri) if tracking else ""  # shown to people: no credentials
    health = dataclasses.asdict(trained.health)
    return dataclasses.asdict(published) | {"tracking_uri": uri, "health": health}


def prepare_stage(cfg: JobConfig, paths: RunPaths, tokenizer_url: str) -> PreparedData | None:
    """The ``prepare_data`` stage when the config names ``data.sources`` (cached: a rerun with
    the same sources and tokenizer tokenizes nothing); records the dataset in the run root."""
    if not cfg.data.sources:
        return None
    prepared = cached(prepare_data, is_stored, paths, **prepare_params(cfg, tokenizer_url))
    record_dataset(paths.run_root, prepared)
    return prepared


def run_tracked(
    cfg: JobConfig,
    paths: RunPaths,
    body: Callable[[TrackingContext | None], dict[str, Any]],
    parent_run_id: str = "",
) -> dict[str, Any]:
    """Open the pipeline's MLflow run (if tracking is on; nested under ``parent_run_id`` when
    given), run ``body``, close it with its status."""
    tracking = start_tracking(cfg, paths, parent_run_id) if cfg.tracking.enable else None
    try:
        result = body(tracking)
    except BaseException:
        end_pipeline_run(tracking, "FAILED")
        raise
    end_pipeline_run(tracking, "FINISHED")
    if tracking is None:  # tracking.enable off
        return {**result, "mlflow_run_id": "", "mlflow_experiment_id": ""}
    ids = {"mlflow_run_id": tracking.parent_run_id, "mlflow_experiment_id": tracking.experiment_id}
    return {**result, **ids}


# validate_parameters=False: the parameters are checked by flow_values/resolve_job, whose errors
# are one line naming the key (a deployment's server has checked them against the schema too).
@flow(name="pretrain_pipeline", flow_run_name=run_id_name, validate_parameters=False)
def pretrain_pipeline(
    recipe: str = DEFAULT_RECIPE,
    config: ConfigParameter = NO_VALUES,
    overrides: ValuesParameter = NO_VALUES,
    config_file: str = "",
    run_id: str = "",
    parent_run_id: str = "",
) -> dict[str, Any]:
    """Pre-train a model from a config to a published, evaluated Hugging Face export.

    Layers, later ones winning: the recipe, the TOML file, the fields set in ``config``, then
    ``overrides``. Returns the run's summary: URLs, metrics, MLflow run and model version.

    Args:
        recipe: Registry recipe to start from (e.g. llama3_debugmodel, or family/recipe such as
            qwen3/qwen3_debugmodel); empty starts from the defaults (with config_file).
        config: Settings of the job, section by section; a field left empty keeps the recipe's
            (or the config file's) value.
        overrides: Dotted config keys to values, applied last, e.g. {"training.steps": 20}.
        config_file: TOML job config (path or URL) applied onto the recipe.
        run_id: Reuse this run root (resumes its training); empty starts a new run.
        parent_run_id: MLflow run to nest this pipeline's run under (e.g. a sweep's run).
    """
    cfg = resolve_job(recipe, config_file, flow_values(config, overrides))
    paths = RunPaths(absolute(cfg.job.dump_folder), cfg.job.experiment, current_run_id(run_id))
    name_flow_run(f"{cfg.job.experiment}/{paths.run_id}", flow_run_tags(cfg, recipe))

    def body(tracking: TrackingContext | None) -> dict[str, Any]:
        """The stages inside the parent MLflow run."""
        prepare_storage(paths, cfg.storage.credentials_block)
        source = tokenizer_source(cfg.tokenizer.path)
        tokenizer_url = cached(
            download_tokenizer,
            storage.exists,
            paths,
            source=source,
            dest=paths.path("tokenizer"),
            root=paths.root,
            attempts=cfg.storage.retries,
            progress=cfg.storage.progress,
        )
        prepared = prepare_stage(cfg, paths, tokenizer_url)
        job = run_config(cfg, paths, tokenizer_url)
        if prepared is not None:
            job = train_on(job, prepared)
        checked = preflight(job, paths.config)
        seed_url = cached(
            create_seed_checkpoint,
            is_complete,
            paths,
            job=checked.config,
            identity=seed_identity(checked.config, checked.model_args, paths.root),
        )
        result = train_and_publish(checked, paths, tracking, seed_url=seed_url) | {
            "tokenizer": tokenizer_url,
            "seed": seed_url,
            "preflight": checked.summary(),
        }
        return result | (prepared.summary() if prepared else {})

    return run_tracked(cfg, paths, body, parent_run_id)
