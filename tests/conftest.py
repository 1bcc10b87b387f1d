"""Shared pytest fixtures, one section per component."""

import os
from pathlib import Path

# Bitwise comparisons between in-process runs and subprocesses need MKL's reproducible mode,
# which MKL reads once, at its first call in this process (see distributed/utils.py).
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
os.environ.setdefault("PYTHONUNBUFFERED", "1")

import pytest

# --- data: bundled offline corpus and tokenizer -------------------------------------------------


@pytest.fixture(scope="session")
def assets() -> Path:
    """The bundled corpus + tokenizer at the default location, built once (seconds) if missing."""
    from titan_core.data.assets import ensure_assets

    return ensure_assets()
