"""Pieces of the reports people read in the MLflow and Prefect UIs."""

from __future__ import annotations

import base64
from pathlib import Path


def png_data_uri(path: str | Path) -> str:
    """The PNG at ``path`` as a ``data:`` URI: a markdown image that renders in the MLflow
    artifact viewer and the Prefect UI alike, where a file path or ``file://`` link shows nothing.
    """
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")


def markdown_image(alt: str, path: str | Path) -> str:
    """A markdown image embedding the PNG at ``path``."""
    return f"![{alt}]({png_data_uri(path)})"
