"""Evaluation of checkpoints: held-out loss, perplexity, bits per byte, greedy samples, lm-eval.

``titan eval`` (``titan_core.cli.evaluate``) is the command; ``evaluate_checkpoint`` the API.
Multiple-choice tasks (ranked choice) live below, where the trainer can reach them too:
``titan_core.components.ranked_choice`` and ``titan_core.data.choice_tasks``.
"""

from titan_core.components.ranked_choice import (
    ChoiceMetrics,
    build_requests,
    choice_metrics,
    score_choice_task,
)
from titan_core.data.choice_tasks import read_choice_task, read_harness_task
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
    "ChoiceMetrics",
    "EvalMetrics",
    "LmEvalOptions",
    "ResolvedCheckpoint",
    "Sample",
    "build_model",
    "build_requests",
    "choice_metrics",
    "compute_metrics",
    "count_text_bytes",
    "evaluate_checkpoint",
    "generate_samples",
    "greedy_generate",
    "load_weights",
    "read_choice_task",
    "read_harness_task",
    "render_markdown",
    "resolve_checkpoint",
    "resolve_config",
    "run_lm_eval",
    "score_choice_task",
    "token_byte_lengths",
    "validation_loader",
    "write_report",
]
