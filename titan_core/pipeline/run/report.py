"""Pieces of the reports people read in MLflow and Prefect: markdown tables and images."""

from __future__ import annotations

import base64
import urllib.parse
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path


def markdown_table(
    head: Sequence[str] | int,
    rows: Iterable[Sequence[str]],
    *,
    right: Collection[int] = (),
) -> list[str]:
    """The lines of a markdown table: ``head`` (column names, or a column count for a table
    without them, such as key/value facts), a rule (columns in ``right`` right-aligned) and one
    line per row of already formatted cells. Every pipeline report draws its tables here."""
    width = head if isinstance(head, int) else len(head)
    top = "|" + " |" * width if isinstance(head, int) else _row(head)
    rule = "|" + "".join(" ---: |" if i in right else " --- |" for i in range(width))
    return [top, rule, *(_row(cells) for cells in rows)]


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def png_data_uri(path: str | Path) -> str:
    """The PNG at ``path`` as a ``data:`` URI: a markdown image that renders in the MLflow
    artifact viewer and the Prefect UI alike, where a file path or ``file://`` link shows nothing.
    """
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")


def markdown_image(alt: str, path: str | Path) -> str:
    """A markdown image embedding the PNG at ``path`` (for Prefect's markdown artifacts)."""
    return f"![{alt}]({png_data_uri(path)})"


def mlflow_image(alt: str, run_id: str, artifact_path: str, tracking_uri: str) -> str:
    """Markdown showing run ``run_id``'s PNG artifact ``artifact_path`` inside a markdown artifact
    of the same run, as the MLflow UI renders it. Its viewer shows images from absolute http(s)
    URLs only (``data:`` and relative links are dropped; checked on MLflow 3.17): with a tracking
    server, the image links to the server's ``get-artifact`` route; with a local store (sqlite,
    a folder) there is no address to link, and the line names the artifact instead."""
    if not tracking_uri.startswith(("http://", "https://")):
        return f"*{alt}: `{artifact_path}`, an artifact of this run.*"
    from titan_core.pipeline.run.common import public_url

    query = urllib.parse.urlencode({"path": artifact_path, "run_uuid": run_id})
    return f"![{alt}]({public_url(tracking_uri).rstrip('/')}/get-artifact?{query})"


def counted(num: int, noun: str) -> str:
    """``num`` and ``noun``, plural unless ``num`` is 1: "1 incident", "2 rollbacks"."""
    return f"{num:,} {noun}" if num == 1 else f"{num:,} {noun}s"


def is_count(name: str) -> bool:
    """Whether metric ``name`` is a count (``num_*``, e.g. ``eval/num_tokens``): a whole number,
    though MLflow and the pipeline's metrics hold it as a float."""
    return name.rsplit("/", 1)[-1].startswith("num_")


def format_metric(name: str, value: float) -> str:
    """A metric for people: a count (``is_count``) as a whole number with thousands separators,
    anything else to four decimals."""
    if is_count(name) and float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:.4f}"
