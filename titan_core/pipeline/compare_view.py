"""How a comparison of runs reads: what its numbers are called, short run names, cells, and
markdown tables drawn for a narrow pane.

The Prefect UI shows a markdown artifact in a narrow pane (725 px in a 1280 px window). The
comparison's markdown has one row per number or config key and one column per run, headed by
the runs' short names (a sweep's trials without the ``sweep-<id>/`` they share); config values
longer than ``VALUE_WIDTH`` are cut in the middle; when the columns would be wider than
``MARKDOWN_WIDTH`` characters, the runs are split over several tables. ``titan compare`` draws
its terminal tables (``rich``) from the same names and cells.
"""

from __future__ import annotations

from typing import Any

from titan_core.pipeline.run.report import markdown_table

# What each number of a run is called (the rates are medians, not the last value other views
# show): the markdown's rows, the terminal's columns.
COLUMNS = {
    "run": "run", "run_id": "run id", "status": "status", "steps": "steps",
    "final_loss": "final train loss", "eval_loss": "eval loss",
    "eval_perplexity": "eval perplexity", "tokens_per_s": "tokens/s (median)",
    "mfu_pct": "MFU % (median)",
}  # fmt: skip
STATISTICS_NOTE = (
    "Final train loss: the last logged step's. Eval loss and perplexity: the evaluate stage's "
    "`eval/loss` and `eval/perplexity` on held-out data (a sweep ranks its trials by "
    "`eval/loss` unless told otherwise). Tokens/s and MFU: the median over the logged steps, "
    "the first (warm-up) left out. A sweep is shown as its trials; (best) marks its choice."
)
EVALUATORS_NOTE = (
    "`eval/<name>/<metric>`: the run's `[evaluators]` on its final checkpoint (accuracies: "
    "higher is better; loss, perplexity, bits per byte: lower)."
)
MARKDOWN_WIDTH = 80
"""Characters one markdown table may span: the Prefect UI's artifact pane is 725 px wide in a
1280 px window (875 px in a 1440 px one), a bold heading character about 8 px."""
VALUE_WIDTH = 28  # a config value longer than this is cut in the middle (comparison.json: all)


def fmt(value: Any) -> str:
    """A table cell: "—" for nothing, floats to 4 decimals (large ones with thousands commas)."""
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 100 else f"{value:,.1f}"
    return str(value)


def collapse(text: str, width: int = VALUE_WIDTH) -> str:
    """``text`` cut to ``width`` characters in the middle (``…``): a path keeps both ends."""
    if len(text) <= width:
        return text
    head = (width - 1) // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head) :]


def short_names(names: list[str]) -> tuple[str, list[str]]:
    """Column headings for runs: ``names`` without the ``<group>/`` they all start with (a
    sweep's trials: ``sweep-<id>/``), and that group ("" when they share none)."""
    groups = {name.split("/", 1)[0] for name in names}
    if len(groups) != 1 or not all("/" in name for name in names):
        return "", names
    group = groups.pop()
    return group, [name[len(group) + 1 :] for name in names]


def _width(head: str, cells: list[str]) -> int:
    """Characters a markdown column needs in a browser: its heading's longest word (headings
    wrap at spaces), its longest cell, and the cell's padding."""
    return max([len(word) for word in head.split() or [""]] + [len(c) for c in cells]) + 3


def fitted_tables(
    corner: str, heads: list[str], rows: list[tuple[str, list[str]]], *, right: bool = False
) -> list[str]:
    """Markdown lines of ``rows`` (a label, then a cell per run) under ``heads`` (a heading per
    run): the runs split over as many tables as keep each within ``MARKDOWN_WIDTH``."""
    first = max(len(text) for text in [corner, *(label for label, _ in rows)]) + 3
    groups: list[list[int]] = [[]]
    used = first
    for i, head in enumerate(heads):
        width = _width(head, [cells[i] for _, cells in rows])
        if groups[-1] and used + width > MARKDOWN_WIDTH:
            groups.append([])
            used = first
        groups[-1].append(i)
        used += width
    lines: list[str] = []
    for group in groups:
        lines += [""] if lines else []
        lines += markdown_table(
            [corner, *(heads[i] for i in group)],
            [[label, *(cells[i] for i in group)] for label, cells in rows],
            right=set(range(1, len(group) + 1)) if right else (),
        )
    return lines


def evaluator_keys(runs: list[dict[str, Any]]) -> list[str]:
    """The ``eval/<name>/<metric>`` numbers any of ``runs`` has, in the first run's order
    (``compare.evaluator_order``), then the others'."""
    return list(dict.fromkeys(key for run in runs for key in run.get("evals", {})))


def _value_cell(value: str | None) -> str:
    return fmt(None if value is None else collapse(value)).replace("|", "\\|")


def render_markdown(
    experiment: str,
    runs: list[dict[str, Any]],
    diff: dict[str, dict[str, str | None]],
    plot: str,
    left_out: list[str] | None = None,
) -> str:
    """The comparison for people, drawn for a narrow pane: the runs' numbers (``runs``: a
    ``COLUMNS`` row each) and the config keys that differ, a row each and a column per run;
    ``left_out``, the keys that differ by construction, named below them; the loss curves
    (``plot``: a markdown image, ``titan_core.pipeline.run.report.markdown_image``, or "")."""
    group, heads = short_names([run["run"] for run in runs])
    lines = [f"# Comparison of {len(runs)} runs in `{experiment}`", ""]
    if group:
        lines += [f"The trials of `{group}`.", ""]
    cells = [run | {"run_id": f"`{run['run_id'][:8]}`"} for run in runs]
    numbers = [(COLUMNS[key], [fmt(row[key]) for row in cells]) for key in list(COLUMNS)[1:]]
    evals = evaluator_keys(runs)
    numbers += [(f"`{key}`", [fmt(row.get("evals", {}).get(key)) for row in runs]) for key in evals]
    lines += fitted_tables(COLUMNS["run"], heads, numbers, right=True)
    lines += ["", STATISTICS_NOTE] + ([EVALUATORS_NOTE] if evals else [])
    lines += ["", "## Config keys that differ", ""]
    if diff:
        keys = [
            (f"`{key}`", [_value_cell(values[r["run_id"]]) for r in runs])
            for key, values in diff.items()
        ]
        lines += fitted_tables("key", heads, keys)
    else:
        lines.append("None: every run has the same config.")
    if left_out:
        named = ", ".join(f"`{key}`" for key in left_out)
        lines += [
            "",
            f"Also different, by construction (a run's own folder, where it is recorded): {named}.",
        ]
    if plot:
        lines += ["", "## Loss curves", "", plot]
    return "\n".join(lines) + "\n"
