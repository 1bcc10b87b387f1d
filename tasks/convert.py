"""``convert_to_hf``: the final DCP checkpoint as a Hugging Face folder in the run root
(``titan_core.pipeline.stages.export`` does the work)."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.common import retry_transient
from tasks.runtime import run_logger
from titan_core.config.job import JobConfig
from titan_core.pipeline.run.common import redact
from titan_core.pipeline.run.tracking import TrackingContext
from titan_core.pipeline.stages.export import export_checkpoint


@task(
    name="convert_to_hf",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=[2, 8],
    retry_condition_fn=retry_transient,
)
def convert_to_hf(
    checkpoint_url: str,
    job: JobConfig,
    output: str = "",
    tracking: TrackingContext | None = None,
    overrides: dict[str, Any] | None = None,
) -> str:
    """Export ``checkpoint_url`` (safetensors, config, tokenizer) to ``output`` (default
    ``<run>/hf``) as ``job``'s ``[convert]`` section says (``overrides``: dotted keys set on it);
    returns the folder's URL. An existing complete export is kept."""
    export = export_checkpoint(checkpoint_url, job, output, tracking, overrides)
    if export.kept:
        run_logger().info("Hugging Face export already complete at %s", redact(export.url))
    else:
        run_logger().info(
            "Exported %s to %s (%d shards)",
            checkpoint_url.rstrip("/").rsplit("/", 1)[-1],  # step-N: its run is the export's
            redact(export.url),
            export.num_shards,
        )
    return export.url
