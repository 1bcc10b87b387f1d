"""The evaluation report: ``<output>/eval/report.json`` for machines, ``report.md`` for people.

Both are written through the storage seam (any fsspec URL), each atomically.
"""

from __future__ import annotations

import contextlib
import datetime
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from titan_core import storage
from titan_core.config.job import JobConfig
from titan_core.errors import DataError, StorageError, storage_errors

if TYPE_CHECKING:
    from titan_core.evaluate.generate import Sample
    from titan_core.evaluate.loading import ResolvedCheckpoint

REPORT_VERSION = 1
EVAL_DIR = "eval"
_METRIC_KEYS = ("loss", "perplexity", "bits_per_byte", "num_tokens", "num_bytes", "num_batches")


@dataclass
class EvalMetrics:
    """Held-out metrics of one pass; sums are over all ranks."""

    loss: float
    perplexity: float
    bits_per_byte: float
    num_tokens: int
    num_bytes: int
    num_batches: int
    eval_seconds: float
    tokens_per_second: float

    def to_dict(self) -> dict[str, float | int]:
        """Plain-JSON form for the report."""
        return asdict(self)


def build_report(
    *,
    ckpt: ResolvedCheckpoint,
    cfg: JobConfig,
    model_args: Any,
    metrics: EvalMetrics,
    samples: Sequence[Sample],
    timing: dict[str, float],
    settings: dict[str, Any],
    lm_eval: dict[str, Any] | None = None,
    evaluators: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The report as plain JSON-able data (see docs/evaluation.md for the layout);
    ``evaluators``: the ``[evaluators]``' ``eval/<name>/<metric>``, as training logs them."""
    report: dict[str, Any] = {
        "report_version": REPORT_VERSION,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "checkpoint": ckpt.step_dir,
        "step": ckpt.step,
        "model": {
            "name": cfg.model.name,
            "flavor": cfg.model.flavor,
            "num_params": model_args.num_params(),
            "vocab_size": model_args.vocab_size,
            "n_layers": model_args.n_layers,
            "dim": model_args.dim,
        },
        "metrics": {k: getattr(metrics, k) for k in _METRIC_KEYS},
        "samples": [s.to_dict() for s in samples],
        "timing": timing,
        "config": {"job_description": cfg.job.description, **settings},
    }
    if evaluators:
        report["evaluators"] = dict(evaluators)
    if lm_eval is not None:
        report["lm_eval"] = lm_eval
    return report


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4f}" if abs(value) < 1e6 else f"{value:.4e}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _table(rows: Sequence[tuple[str, Any]], head: tuple[str, str]) -> list[str]:
    lines = [f"| {head[0]} | {head[1]} |", "| --- | ---: |"]
    return lines + [f"| {name} | {_fmt(value)} |" for name, value in rows]


def render_markdown(report: dict[str, Any]) -> str:
    """A readable summary: model, metrics, timing, samples and any lm-eval results."""
    m, c, model = report["metrics"], report["config"], report["model"]
    out = [
        f"# Evaluation of step {report['step']}",
        "",
        f"- checkpoint: `{report['checkpoint']}`",
        f"- model: {model['name']} `{model['flavor']}`, {model['num_params']:,} parameters",
        f"- data: `{c['dataset']}` split `{c['split']}`, seq_len {c['seq_len']}, "
        f"world size {c['world_size']} ({c['device']})",
        f"- created: {report['created']}",
        "",
        "## Held-out metrics",
        "",
        *_table(
            [
                ("loss (nats/token)", m["loss"]),
                ("perplexity", m["perplexity"]),
                ("bits per byte", m["bits_per_byte"]),
                ("scored tokens", m["num_tokens"]),
                ("text bytes", m["num_bytes"]),
                ("batches", m["num_batches"]),
            ],
            ("metric", "value"),
        ),
        "",
        "## Timing",
        "",
        *_table(list(report["timing"].items()), ("timing", "value")),
    ]
    if report.get("evaluators"):
        rows = [(name, value) for name, value in report["evaluators"].items()]
        out += ["", "## Evaluators", "", *_table(rows, ("metric", "value"))]
    if report["samples"]:
        out += ["", f"## Greedy samples (up to {c['max_new_tokens']} new tokens)"]
        for s in report["samples"]:
            out += ["", f"**{s['prompt']}** (stopped: {s['stop_reason']})", "", "```text"]
            out += [s["prompt"] + s["completion"], "```"]
    if "lm_eval" in report:
        rows = [
            (f"{task} / {name}", value)
            for task, metrics in report["lm_eval"]["results"].items()
            for name, value in metrics.items()
        ]
        out += ["", "## lm-evaluation-harness", "", *_table(rows, ("task / metric", "value"))]
    return "\n".join(out) + "\n"


def write_report(output: str, report: dict[str, Any]) -> tuple[str, str]:
    """Write ``<output>/eval/report.json`` and ``report.md``; returns their paths. A storage
    failure (a full disk) is one ``StorageError`` line naming the file, and neither is left."""
    json_path = storage.join(output, EVAL_DIR, "report.json")
    md_path = storage.join(output, EVAL_DIR, "report.md")
    with storage.folders_kept_on_success(storage.join(output, EVAL_DIR)):
        with storage_errors(json_path, DataError):
            storage.write_text(json_path, json.dumps(report, indent=2) + "\n")
        try:
            with storage_errors(md_path, DataError):
                storage.write_text(md_path, render_markdown(report))
        except (DataError, StorageError):  # the storage seam raises StorageError itself
            with contextlib.suppress(OSError):  # the pair, or neither
                fs, path = storage.filesystem(json_path)
                fs.rm_file(path)
            raise
    return json_path, md_path
