"""The pipeline's evaluate stage without an orchestrator: a checkpoint's held-out metrics and its
``[evaluators]``' (``eval/<name>/<metric>``, as training logs them in the loop), its report
files in the run root and on the stage's MLflow run."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from titan_core import storage
from titan_core.config.job import JobConfig
from titan_core.pipeline.run.common import redact
from titan_core.pipeline.run.tracking import (
    TrackingContext,
    client,
    log_metrics,
    log_stage_config,
    stage_run,
)

EVAL_METRICS = ("loss", "perplexity", "bits_per_byte", "num_tokens")


@dataclass(frozen=True)
class Evaluation:
    """What the evaluate stage measured, and where its report is."""

    report_url: str
    """``<output>/eval/report.json`` (``report.md`` beside it)."""
    step: int
    """The evaluated checkpoint's training step."""
    checkpoint: str
    """The evaluated checkpoint (its step directory)."""
    metrics: dict[str, float]
    """``EVAL_METRICS``: held-out loss, perplexity, bits per byte, tokens evaluated; then each
    evaluator's ``<name>/<metric>`` (logged as ``eval/<name>/<metric>``)."""


def report_markdown(evaluation: Evaluation) -> str:
    """The evaluation's ``report.md`` (metrics and the greedy samples), for the evaluate task's
    Prefect artifact; secrets redacted."""
    folder = evaluation.report_url.rsplit("/", 1)[0]
    return redact(storage.read_text(storage.join(folder, "report.md")))


def log_report(tracking: TrackingContext | None, run_id: str, report_dir: str) -> None:
    """Attach the report files to the stage's MLflow run (secrets redacted)."""
    if tracking is None or not run_id:
        return
    with tempfile.TemporaryDirectory(prefix="titan-eval-") as tmp:
        for name in ("report.json", "report.md"):
            text = redact(storage.read_text(storage.join(report_dir, name)))
            storage.write_text(os.path.join(tmp, name), text)
        client(tracking.uri).log_artifacts(run_id, tmp, "eval")


def checkpoint_run_root(checkpoint_url: str) -> str:
    """``<run>`` of ``<run>/checkpoint/step-N`` (the evaluator writes eval/ there)."""
    from titan_core.evaluate import resolve_checkpoint

    return resolve_checkpoint(checkpoint_url).run_root


def evaluate_stage(
    checkpoint_url: str,
    job: JobConfig | None = None,
    output: str = "",
    tracking: TrackingContext | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Evaluation:
    """Evaluate ``checkpoint_url`` as the job config's ``[evaluate]`` section says (``job``, else
    the checkpoint run's ``config.toml``; ``overrides``, dotted keys, apply on top) and write
    ``<output>/eval/report.{json,md}`` (default output: the checkpoint's run root); with
    ``tracking``, as an ``evaluate`` stage run with the ``eval/*`` metrics and the report."""
    from titan_core.evaluate import evaluate_checkpoint
    from titan_core.evaluate.report import EVAL_DIR

    with stage_run(tracking, "evaluate") as run_id:
        log_stage_config(tracking, run_id, checkpoint_run_root(checkpoint_url))
        report = evaluate_checkpoint(
            checkpoint_url, config=job, values=overrides, output=output or None
        )
        metrics = {k: report["metrics"][k] for k in EVAL_METRICS}
        metrics |= {k.removeprefix("eval/"): v for k, v in report.get("evaluators", {}).items()}
        log_metrics(tracking, run_id, {f"eval/{k}": v for k, v in metrics.items()})
        report_dir = storage.join(output or checkpoint_run_root(checkpoint_url), EVAL_DIR)
        log_report(tracking, run_id, report_dir)
    return Evaluation(
        report_url=storage.join(report_dir, "report.json"),
        step=int(report["step"]),
        checkpoint=report["checkpoint"],
        metrics=metrics,
    )
