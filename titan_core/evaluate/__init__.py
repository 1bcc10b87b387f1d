"""Evaluation of checkpoints: held-out loss, perplexity, bits per byte, greedy samples, lm-eval.

``titan eval`` (``titan_core.cli.evaluate``) is the command; ``evaluate_checkpoint`` the API.
"""

from titan_core.evaluate.evaluator import (
    EvalMetrics,
    compute_metrics,
    count_text_bytes,
    evaluate_checkpoint,
    token_byte_lengths,
    validation_loader,
)
from titan_core.evaluate.generate import DEFAULT_PROMPTS, Sample, generate_samples, greedy_generate
from titan_core.evaluate.harness import LmEvalOptions, run_lm_eval
from titan_core.evaluate.loading import (
    ResolvedCheckpoint,
    build_model,
    load_weights,
    resolve_checkpoint,
    resolve_config,
)
from titan_core.evaluate.report import render_markdown, write_report

__all__ = [
    "DEFAULT_PROMPTS",
    "EvalMetrics",
    "LmEvalOptions",
    "ResolvedCheckpoint",
    "Sample",
    "build_model",
    "compute_metrics",
    "count_text_bytes",
    "evaluate_checkpoint",
    "generate_samples",
    "greedy_generate",
    "load_weights",
    "render_markdown",
    "resolve_checkpoint",
    "resolve_config",
    "run_lm_eval",
    "token_byte_lengths",
    "validation_loader",
    "write_report",
]
