"""``evaluate``: held-out loss, perplexity, bits per byte and samples of a checkpoint."""

from __future__ import annotations

import os
import tempfile
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.common import redact, retry_transient, run_logger
from tasks.tracking import TrackingContext, client, log_metrics, stage_run
from titan_core import storage

EVAL_METRICS = ("loss", "perplexity", "bits_per_byte", "num_tokens")


def _log_report(tracking: TrackingContext | None, run_id: str, report_dir: str) -> None:
    """Attach the report files to the stage's MLflow run."""
    if tracking is None or not run_id:
        return
    with tempfile.TemporaryDirectory(prefix="titan-eval-") as tmp:
        for name in ("report.json", "report.md"):
            local = os.path.join(tmp, name)
            with open(local, "w") as f:
                f.write(redact(storage.read_text(storage.join(report_dir, name))))
        client(tracking.uri).log_artifacts(run_id, tmp, "eval")


@task(
    name="evaluate",
    cache_policy=NO_CACHE,
    retries=1,
    retry_delay_seconds=[5],
    retry_condition_fn=retry_transient,
)
def evaluate(
    checkpoint_url: str,
    config_url: str = "",
    output: str = "",
    max_batches: int = 0,
    tracking: TrackingContext | None = None,
) -> dict[str, Any]:
    """Evaluate ``checkpoint_url`` and write ``<output>/eval/report.{json,md}`` (default
    output: the checkpoint's run root). Returns ``{"report_url", "step", "metrics"}``."""
    from titan_core.evaluate import evaluate_checkpoint
    from titan_core.evaluate.report import EVAL_DIR

    config_argv = ["--job.config_file", config_url] if config_url else []
    with stage_run(tracking, "evaluate") as run_id:
        report = evaluate_checkpoint(
            checkpoint_url, config_argv=config_argv, output=output or None, max_batches=max_batches
        )
        metrics = {k: report["metrics"][k] for k in EVAL_METRICS}
        log_metrics(tracking, run_id, {f"eval/{k}": v for k, v in metrics.items()})
        report_dir = storage.join(output or _run_root(checkpoint_url), EVAL_DIR)
        _log_report(tracking, run_id, report_dir)
    run_logger().info(
        "Step %d: eval loss %.4f, perplexity %.3f, bits/byte %.4f (%s tokens)",
        report["step"],
        metrics["loss"],
        metrics["perplexity"],
        metrics["bits_per_byte"],
        f"{metrics['num_tokens']:,}",
    )
    return {
        "report_url": storage.join(report_dir, "report.json"),
        "step": report["step"],
        "checkpoint": report["checkpoint"],
        "metrics": metrics,
    }


def _run_root(checkpoint_url: str) -> str:
    """``<run>`` of ``<run>/checkpoint/step-N`` (the evaluator writes eval/ there)."""
    from titan_core.evaluate import resolve_checkpoint

    return resolve_checkpoint(checkpoint_url).run_root
