"""Run-level tasks: open the run's storage and tracking, find a model line's newest checkpoint.

Each is the first stage that needs its service, so a wrong URL, bad credentials or a tracking
server that does not answer fail here, with one line, before anything is trained.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.common import retry_transient
from tasks.runtime import load_secret, run_logger
from titan_core import storage
from titan_core.config.job import JobConfig
from titan_core.errors import CheckpointError
from titan_core.pipeline.run.common import redact
from titan_core.pipeline.run.paths import RunPaths
from titan_core.pipeline.run.tracking import TrackingContext, start_pipeline_run
from titan_core.pipeline.run.transfer import check_storage, configure_credentials
from titan_core.pipeline.stages.model_line import CheckpointInfo, latest_checkpoint


@task(name="prepare_storage", cache_policy=NO_CACHE, retries=1, retry_condition_fn=retry_transient)
def prepare_storage(paths: RunPaths, credentials_block: str = "") -> str:
    """Load credentials, check the run root can be written and read; returns the run root."""
    configure_credentials(credentials_block, load_secret)
    check_storage(paths.run_root)
    run_logger().debug("Run root %s is writable", redact(paths.run_root))  # the summary names it
    return paths.run_root


@task(name="start_tracking", cache_policy=NO_CACHE)
def start_tracking(cfg: JobConfig, paths: RunPaths, parent_run_id: str = "") -> TrackingContext:
    """Create the MLflow experiment (if new) and this pipeline run's parent run, nested under
    ``parent_run_id`` (e.g. a sweep's run) when given."""
    from prefect.runtime import flow_run

    ctx = start_pipeline_run(cfg, paths, str(flow_run.id or ""), parent_run_id)
    run_logger().debug(  # the closing lines say how to open it
        "MLflow: experiment %r, parent run %s at %s",
        ctx.experiment,
        ctx.parent_run_id,
        redact(ctx.uri),
    )
    return ctx


@task(
    name="find_latest_checkpoint",
    cache_policy=NO_CACHE,
    retries=2,
    retry_condition_fn=retry_transient,
)
def find_latest_checkpoint(root: str, experiment: str) -> CheckpointInfo:
    """``latest_checkpoint`` as a task; ``CheckpointError`` when the model line has none."""
    latest = latest_checkpoint(root, experiment)
    if latest is None:
        raise CheckpointError(
            f"retrain: no complete checkpoint under {redact(storage.join(root, experiment))}; "
            "run the pretrain pipeline for this experiment first"
        )
    run_logger().info("Newest checkpoint of %s: %s", experiment, redact(latest.step_dir))
    return latest
