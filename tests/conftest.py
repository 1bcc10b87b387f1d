"""Shared pytest fixtures, one section per component."""

from pathlib import Path

import pytest

# --- data: bundled offline corpus and tokenizer -------------------------------------------------


@pytest.fixture(scope="session")
def assets() -> Path:
    """The bundled corpus + tokenizer at the default location, built once (seconds) if missing."""
    from titan_core.data.assets import ensure_assets

    return ensure_assets()
