"""``create_seed_checkpoint``: the initial weights every run of a model config starts from
(``titan_core.pipeline.stages.seed`` does the work; written once per identity, then cached)."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.tasks import exponential_backoff

from tasks.common import retry_transient
from tasks.runtime import run_logger
from titan_core.config.job import JobConfig
from titan_core.pipeline.run.common import redact
from titan_core.pipeline.stages.seed import seed_cache_key, write_seed_checkpoint


def _cache_key(context: Any, params: dict[str, Any]) -> str:
    """Prefect ``cache_key_fn``: by the seed's identity, not by the run."""
    return seed_cache_key(params["identity"])


@task(
    name="create_seed_checkpoint",
    cache_key_fn=_cache_key,
    persist_result=True,
    retries=1,
    retry_delay_seconds=exponential_backoff(backoff_factor=2),
    retry_condition_fn=retry_transient,
)
def create_seed_checkpoint(job: JobConfig, identity: dict[str, Any]) -> str:
    """Write ``<run>/checkpoint/seed`` for the run's config; returns its URL.

    Cached by ``identity`` (see ``seed_identity``), not by the run: a later run gets this URL.
    """
    seed_url = write_seed_checkpoint(job)
    run_logger().info("Seed checkpoint at %s", redact(seed_url))
    return seed_url
