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


@pytest.fixture(scope="session")
def prepared_corpus(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> str:
    """The bundled corpus, prepared (``titan data prepare``); its URL."""
    from titan_core.data.assets import bundled_corpus_dir, default_tokenizer_path
    from titan_core.data.prepare import PrepareSpec, prepare

    spec = PrepareSpec(
        sources=(str(bundled_corpus_dir() / "train"),),
        tokenizer_path=str(default_tokenizer_path()),
        root=str(tmp_path_factory.mktemp("prepared")),
    )
    return prepare(spec, workers=1).url


# --- storage: a real S3 server (SeaweedFS `weed mini`) ------------------------------------------

# Imported here, not at the top, so that this section stays self-contained.
from collections.abc import Iterator  # noqa: E402

from titan_core.testing.s3 import S3Server, start_s3_server  # noqa: E402


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A running S3 endpoint with enforced credentials and a bucket (see titan_core/testing/s3.py).

    Yields an ``S3Server``: ``endpoint_url``, ``access_key``, ``secret_key``, ``bucket``,
    ``url(*parts)``, ``filesystem()`` and ``set_env(monkeypatch)`` for a test's AWS_* variables.
    """
    server = start_s3_server(tmp_path_factory.mktemp("s3"))
    try:
        yield server
    finally:
        server.stop()


# --- parallelism: one seed checkpoint and the single-process reference (tests/parallel_harness.py)


@pytest.fixture(scope="session")
def parity_seed(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> Path:
    """The seed checkpoint every parity run starts from (written with every degree at 1)."""
    from parallel_harness import make_seed_checkpoint

    return make_seed_checkpoint(tmp_path_factory.mktemp("parity_seed"))


@pytest.fixture(scope="session")
def parity_reference(tmp_path_factory: pytest.TempPathFactory, parity_seed: Path) -> dict:
    """10-step losses of one process (every degree 1) from the seed checkpoint."""
    from parallel_harness import run_layout

    return run_layout(tmp_path_factory.mktemp("parity_ref"), parity_seed, nproc=1, dp=1)


@pytest.fixture(scope="session")
def qwen3_parity_seed(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> Path:
    """The seed checkpoint of the tiny Qwen3 (``parallel_harness.QWEN3_MODEL``)."""
    from parallel_harness import QWEN3_MODEL, make_seed_checkpoint

    return make_seed_checkpoint(tmp_path_factory.mktemp("qwen3_parity_seed"), QWEN3_MODEL)


@pytest.fixture(scope="session")
def qwen3_parity_reference(
    tmp_path_factory: pytest.TempPathFactory, qwen3_parity_seed: Path
) -> dict:
    """10-step losses of the tiny Qwen3 on one process from its seed checkpoint."""
    from parallel_harness import QWEN3_MODEL, run_layout

    dump = tmp_path_factory.mktemp("qwen3_parity_ref")
    return run_layout(dump, qwen3_parity_seed, nproc=1, dp=1, model=QWEN3_MODEL)


# --- pipeline: one Prefect test harness (temporary API server + database) per session ----------


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A temporary Prefect API (SQLite) for every flow run of the session; yields PREFECT_HOME.

    Started once (~6-30 s); task results go under the yielded home, except the pipeline's cached
    stages', which live in the run's output root (``RunPaths.results``)."""
    from prefect.settings import (
        PREFECT_HOME,
        PREFECT_LOCAL_STORAGE_PATH,
        PREFECT_SERVER_ANALYTICS_ENABLED,
        temporary_settings,
    )
    from prefect.testing.utilities import prefect_test_harness

    home = tmp_path_factory.mktemp("prefect_home")
    settings = {
        PREFECT_HOME: str(home),
        PREFECT_LOCAL_STORAGE_PATH: str(home / "storage"),
        PREFECT_SERVER_ANALYTICS_ENABLED: False,
    }
    with temporary_settings(updates=settings), prefect_test_harness(server_startup_timeout=180):
        yield home


@pytest.fixture(autouse=True)
def _prefect_console_on_this_tests_stderr() -> None:
    """Prefect's console handlers keep the stream they were made with: under pytest, an earlier
    test's captured stderr, closed since, where a flow's log lines would fail (and, printed
    through the flow's ``log_prints``, recurse). Each test's own stderr instead."""
    import logging
    import sys

    if "prefect.logging.handlers" not in sys.modules:  # no flow has run in this process yet
        return
    from prefect.logging.handlers import PrefectConsoleHandler

    for owner in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(owner, "handlers", []):
            if isinstance(handler, PrefectConsoleHandler) and handler.stream is not sys.stderr:
                handler.stream = handler.console.file = sys.stderr  # setStream flushes the old


# --- storage faults: read-only and full file systems on demand (tests/storage_faults.py) --------

from storage_faults import disk, read_only, small_disk  # noqa: E402, F401
