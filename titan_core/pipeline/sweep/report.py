"""The comparison of a sweep's trials, as people read it in MLflow, Prefect and the console:
one row per trial, the best one, charts of the metric against each swept key.

No orchestrator and no MLflow here: the rows are filled from MLflow by
``titan_core.pipeline.sweep.tracking``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from titan_core import storage
from titan_core.config.metrics import best_of, direction
from titan_core.pipeline.run.report import markdown_table
from titan_core.pipeline.sweep.plan import format_value, short_keys


@dataclass(frozen=True)
class TrialRow:
    """One trial in the comparison: how it ended and what it reached."""

    index: int
    name: str
    run_id: str
    status: str  # "completed", "stopped" (early, by the sweep) or "failed"
    values: tuple[tuple[str, Any], ...]
    final_loss: float | None = None
    metric: float | None = None
    steps: int | None = None
    mlflow_run_id: str = ""
    model_version: str = ""
    error: str = ""
    stopped_at: int | None = None  # the step a trial stopped early trained to

    @property
    def outcome(self) -> str:
        """The status as people read it: ``stopped at step 40`` for a trial stopped early."""
        return f"stopped at step {self.stopped_at}" if self.status == "stopped" else self.status

    def as_dict(self, metric_name: str) -> dict[str, Any]:
        """A flat, JSON-able row: the swept keys as columns, the metric under its own name."""
        return {
            "trial": self.index,
            "name": self.name,
            "status": self.status,
            **{k: v for k, v in self.values},
            "final_train_loss": self.final_loss,
            metric_name: self.metric,
            "steps": self.steps,
            "stopped_at": self.stopped_at,
            "run_id": self.run_id,
            "mlflow_run_id": self.mlflow_run_id,
            "model_version": self.model_version,
            "error": self.error,
        }


@dataclass(frozen=True)
class SweepResult:
    """What a sweep returns: its trials as compared, the best one and where it was logged."""

    sweep_id: str
    experiment: str
    metric: str
    keys: tuple[str, ...]
    trials: tuple[TrialRow, ...]
    best: TrialRow | None
    mlflow_run_id: str = ""
    tracking_uri: str = ""
    model_name: str = ""
    alias: str = ""
    markdown: str = field(default="", repr=False)

    @property
    def failed(self) -> tuple[TrialRow, ...]:
        """The trials that failed."""
        return tuple(t for t in self.trials if t.status == "failed")

    @property
    def stopped(self) -> tuple[TrialRow, ...]:
        """The trials stopped early (they trained fewer steps, then exported and evaluated)."""
        return tuple(t for t in self.trials if t.status == "stopped")


def best_trial(rows: Sequence[TrialRow], metric: str = "eval/loss") -> TrialRow | None:
    """The completed trial with the best finite ``metric`` (the lowest, or the highest for an
    accuracy: ``titan_core.config.metrics``; the first one on a tie); a trial stopped early
    only when no trial completed with one; else None."""
    for status in ("completed", "stopped"):
        scored = [r for r in rows if r.status == status and r.metric is not None]
        scored = [r for r in scored if math.isfinite(r.metric or math.nan)]
        if scored:
            best = best_of(metric, [r.metric or 0.0 for r in scored])
            return next(r for r in scored if r.metric == best)
    return None


def counts(rows: Sequence[TrialRow]) -> str:
    """``3 of 4 trials completed``, plus ``, 1 stopped early`` when some were."""
    done = sum(r.status == "completed" for r in rows)
    stopped = sum(r.status == "stopped" for r in rows)
    return f"{done} of {len(rows)} trials completed" + (
        f", {stopped} stopped early" if stopped else ""
    )


def plot_metric_by_key(rows: Sequence[TrialRow], key: str, metric: str, path: str) -> str:
    """A PNG of ``metric`` against the swept ``key`` (log x for positive values spanning 10x,
    categories for non-numbers); failed trials are left out. Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    points = [(dict(r.values)[key], r.metric) for r in rows if r.metric is not None]
    fig, ax = plt.subplots(figsize=(5, 3.5), dpi=100)
    try:
        xs = [x for x, _ in points]
        numeric = all(isinstance(x, int | float) and not isinstance(x, bool) for x in xs)
        if not numeric:
            names = sorted({format_value(x) for x in xs})
            xs = [names.index(format_value(x)) for x in xs]
            ax.set_xticks(range(len(names)), names)
        else:
            if xs and min(xs) > 0 and max(xs) >= 10 * min(xs):
                ax.set_xscale("log")
            ticks = sorted(set(xs))
            if len(ticks) <= 10:  # the swept values themselves, not matplotlib's round numbers
                ax.set_xticks(ticks, [format_value(x) for x in ticks])
                ax.minorticks_off()
        ax.scatter(xs, [y for _, y in points], s=36)
        ax.set_xlabel(key)
        ax.set_ylabel(metric)
        ax.set_title(f"{metric} by {key}")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        with storage.output_path(path) as tmp:
            fig.savefig(tmp, format="png")
    finally:
        plt.close(fig)
    return path


def _cell(value: Any) -> str:
    """A table cell: floats to 4 decimals, missing values as a dash."""
    if value is None or value == "":
        return "—"
    return f"{value:.4f}" if isinstance(value, float) else str(value).replace("|", "/")


def render_markdown(
    sweep_id: str,
    rows: Sequence[TrialRow],
    keys: Sequence[str],
    metric: str,
    best: TrialRow | None,
    images: Sequence[str] = (),
) -> str:
    """The comparison for people: one row per trial (swept keys, losses, status, error), the best
    trial, then the given markdown images (loss curves, one chart per key)."""
    lines = [f"# Sweep `{sweep_id}`: {counts(rows)}", ""]
    head = ["trial", "status", *keys, "final train loss", metric, "steps", "model version"]
    table = []
    for r in rows:
        mark = " ★" if best is not None and r.index == best.index else ""
        values = dict(r.values)
        cells = [f"{r.name}{mark}", r.outcome, *(format_value(values[k]) for k in keys)]
        cells += [_cell(r.final_loss), _cell(r.metric), _cell(r.steps), _cell(r.model_version)]
        table.append(cells)
    lines += [*markdown_table(head, table), ""]
    if best is not None:
        way = "highest" if direction(metric) == "higher" else "lowest"
        lines.append(f"Best by {way} `{metric}`: **{best.name}** ({best.metric:.4f}).")
    else:
        lines.append(f"No completed trial logged `{metric}`.")
    failed = [r for r in rows if r.status == "failed"]
    if failed:
        lines += ["", "## Failed trials", ""]
        lines += [f"- {r.name}: {r.error or 'failed'}" for r in failed]
    for image in images:
        lines += ["", image]
    return "\n".join(lines) + "\n"


def format_table(result: SweepResult) -> str:
    """A short plain-text table of the trials, for the console and the flow's logs."""
    head = ["trial", *short_keys(result.keys).values(), "final_loss", result.metric, "status"]
    body = []
    for row in result.trials:
        values = dict(row.values)
        cells = [f"trial-{row.index}", *(format_value(values[k]) for k in result.keys)]
        cells += [f"{v:.4f}" if v is not None else "-" for v in (row.final_loss, row.metric)]
        best = result.best is not None and row.index == result.best.index
        cells.append(
            row.outcome + (" (best)" if best else "") + (f": {row.error}" if row.error else "")
        )
        body.append(cells)
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head) - 1)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in [head, *body]
    ]
    return "\n".join([f"sweep {result.sweep_id}: {counts(result.trials)}", *lines])
