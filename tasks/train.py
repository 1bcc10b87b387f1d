"""``train``: launch torchrun through ``titan_core.launch`` and stream its log into Prefect.

Rank 0 streams step metrics into the stage's MLflow run (the run id and tracking URI travel in
the environment); that run and the pipeline's parent run get the stored config as params. A
retry of the task relaunches the job, which resumes from the newest complete checkpoint
(a step directory counts only with its commit marker), never from scratch.
``upload_run_files`` then copies what the ranks wrote to a local side folder (metrics.jsonl,
per-rank logs, traces, memory snapshots) into the run root when that is a URL.
"""

from __future__ import annotations

import os
import shutil

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.common import retry_transient
from tasks.runtime import run_logger
from titan_core import storage
from titan_core.checkpoint.manager import complete_steps
from titan_core.config.job import JobConfig
from titan_core.pipeline.run.common import redact, relay_line
from titan_core.pipeline.run.params import record_seed
from titan_core.pipeline.run.tracking import TrackingContext, log_config, stage_run
from titan_core.pipeline.run.transfer import refresh, upload_folder
from titan_core.pipeline.stages.training import (
    Trained,
    discard_late_stop,
    health_counts,
    health_rows,
    record_train_run,
    report_health,
    tag_stopped,
    trained_to,
)
from titan_core.stop_request import stopped_early

# Fault-injection hooks (see titan_core/checkpoint/manager.py) model a transient failure: they
# apply to the first attempt only, so that a retry can show the recovery.
FAULT_PREFIX = "TITAN_FAULT_"


@task(name="train", cache_policy=NO_CACHE, retry_condition_fn=retry_transient)
def train(
    job: JobConfig, config_url: str, seed_url: str = "", tracking: TrackingContext | None = None
) -> Trained:
    """Train ``job``, stored at ``config_url`` for the ranks, with torchrun; returns the final
    checkpoint's URL and the run's health counts. ``seed_url`` is loaded when the run has no
    checkpoint of its own yet.
    """
    from titan_core.build import local_side_folder
    from titan_core.components.mlflow_sink import mlflow_env
    from titan_core.launch import job_launcher, train_spec

    cfg = job
    logger = run_logger()
    from prefect.runtime import task_run

    attempt = max(int(task_run.run_count or 1), 1)  # 2 on the first retry
    folder = storage.resolve(cfg.job.dump_folder, cfg.checkpoint.folder)
    refresh(folder)
    done = complete_steps(folder)
    start = f"step-{done[-1]}, the newest complete checkpoint" if done else "the seed checkpoint"
    logger.info("Attempt %d: training to step %d from %s", attempt, cfg.training.steps, start)
    faults = tuple(k for k in os.environ if k.startswith(FAULT_PREFIX)) if attempt > 1 else ()
    side = local_side_folder(cfg.job.dump_folder)
    if seed_url:
        record_seed(config_url, seed_url)
    if tracking is not None:  # the config is final now: the pipeline run's params are it
        log_config(tracking, tracking.parent_run_id, config_url)
    with stage_run(tracking, "train", reuse=True) as mlflow_run_id:
        log_config(tracking, mlflow_run_id, config_url)
        spec = train_spec(
            config_url,
            cfg.launch,
            initial_load_path=seed_url,
            env=mlflow_env(tracking.uri if tracking else "", mlflow_run_id),
            env_unset=faults,
            log_dir=os.path.join(side, "logs", f"attempt-{attempt}"),
        )
        launcher = job_launcher(cfg)
        # Hundreds of characters: on the console with `titan pipeline run -v` (and in the UI).
        logger.debug("Launching (%s): %s", cfg.launch.backend, redact(launcher.render(spec)))
        try:
            result = launcher.run(spec, on_line=lambda line: relay_line(logger, line))
            record_train_run(tracking, mlflow_run_id, side, config_url)
        finally:  # the guard's incidents are shown whether it stopped the job or not
            if table := report_health(tracking, mlflow_run_id, side):
                from prefect.artifacts import create_markdown_artifact

                create_markdown_artifact(
                    table, key="training-health", description="Step guard incidents and slow ranks"
                )
    discard_late_stop(cfg.job.dump_folder, logger)  # the train run has ended: no more requests
    refresh(folder)  # the ranks wrote the checkpoints: drop this process's cached listings
    record = stopped_early(cfg.job.dump_folder)
    step, stop = trained_to(complete_steps(folder), cfg.training.steps, record, redact(folder))
    if stop is not None:
        logger.info("Training stopped early at step %d (stop requested: %s)", step, stop.reason)
        tag_stopped(tracking, mlflow_run_id, stop)
    final = storage.join(folder, f"step-{step}")
    logger.info("Training finished in %.1fs; final checkpoint %s", result.elapsed_s, redact(final))
    return Trained(final, health_counts(health_rows(side)))


@task(
    name="upload_run_files",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=[1, 4],
    retry_condition_fn=retry_transient,
)
def upload_run_files(cfg: JobConfig) -> list[str]:
    """Upload the ranks' local side folder (metrics, logs, traces) into a URL run root."""
    from titan_core.build import local_side_folder

    if not storage.is_url(cfg.job.dump_folder):
        return []  # the ranks wrote straight into the run root
    side = local_side_folder(cfg.job.dump_folder)
    logger = run_logger()
    urls = upload_folder(
        side,
        cfg.job.dump_folder,
        attempts=cfg.storage.retries,
        progress=cfg.storage.progress,
        logger=logger,
    )
    logger.info("Uploaded %d run files to %s", len(urls), redact(cfg.job.dump_folder))
    shutil.rmtree(side, ignore_errors=True)
    return urls
