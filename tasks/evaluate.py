"""``evaluate``: held-out loss, perplexity, bits per byte, the ``[evaluators]`` and samples of a
checkpoint (``titan_core.pipeline.stages.evaluation`` does the work)."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.common import retry_transient
from tasks.runtime import run_logger
from titan_core.config.job import JobConfig
from titan_core.pipeline.run.tracking import TrackingContext
from titan_core.pipeline.stages.evaluation import Evaluation, evaluate_stage, report_markdown


@task(
    name="evaluate",
    cache_policy=NO_CACHE,
    retries=1,
    retry_delay_seconds=[5],
    retry_condition_fn=retry_transient,
)
def evaluate(
    checkpoint_url: str,
    job: JobConfig | None = None,
    output: str = "",
    tracking: TrackingContext | None = None,
    overrides: dict[str, Any] | None = None,
) -> Evaluation:
    """Evaluate ``checkpoint_url`` as ``job``'s ``[evaluate]`` section says (default: the
    checkpoint run's ``config.toml``; ``overrides``: dotted keys set on it) and write
    ``<output>/eval/report.{json,md}`` (default output: the checkpoint's run root); returns the
    metrics and the report's URL."""
    from prefect.artifacts import create_markdown_artifact

    result = evaluate_stage(checkpoint_url, job, output, tracking, overrides)
    create_markdown_artifact(  # the greedy samples, readable in the UI without opening files
        report_markdown(result), key="evaluation-report", description="Evaluation report"
    )
    metrics = result.metrics
    scores = [  # the evaluators' (``<name>/<metric>``), their timings left to the report
        f"{k} {v:.4f}" for k, v in metrics.items() if "/" in k and not k.endswith("/seconds")
    ]
    run_logger().info(
        "Step %d: eval loss %.4f, perplexity %.3f, bits/byte %.4f (%s tokens)%s",
        result.step,
        metrics["loss"],
        metrics["perplexity"],
        metrics["bits_per_byte"],
        f"{metrics['num_tokens']:,}",
        f"; {', '.join(scores)}" if scores else "",
    )
    return result
