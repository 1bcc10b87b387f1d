"""``preflight``: everything that can reject a run, checked before any process is launched
(``titan_core.pipeline.stages.preflight`` does the work)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.runtime import run_logger
from titan_core.config.job import JobConfig
from titan_core.pipeline.run.common import redact
from titan_core.pipeline.stages.preflight import Preflight, run_preflight


@task(name="preflight", cache_policy=NO_CACHE)
def preflight(job: JobConfig, config_url: str) -> Preflight:
    """Validate the run's config at its world size (a fake-backend dry run, the memory budget),
    then store it at ``config_url`` with its auto values resolved: the config the ranks load,
    which the later stages take from ``Preflight.config``."""
    summary = run_preflight(job, config_url, run_logger())
    run_logger().info(
        "Preflight passed: %s parameters, world size %d, estimated peak %.3f GiB per rank",
        f"{summary.num_params:,}",
        summary.world_size,
        summary.peak_memory_gib,
    )
    run_logger().debug("The ranks' config is %s", redact(config_url))
    return summary
