"""Prefect task runners for stages that fan out into tasks of their own (``prepare_data``'s shard
tasks): a local process pool or a Dask cluster, reporting to this process's Prefect API."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def api_for_workers() -> Iterator[None]:
    """Point the shard workers at this process's Prefect API.

    Without ``PREFECT_API_URL`` Prefect runs a temporary server in this process; a spawned worker
    would start a server of its own (seconds each, on the same database) instead of reporting
    to ours.
    """
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if PREFECT_API_URL.value():
        yield
        return
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        url = str(client.api_url)
    with temporary_settings(updates={PREFECT_API_URL: url}):
        yield


def task_runner(workers: int, dask_address: str, num_units: int) -> Any:
    """Dask's task runner for a scheduler address, else a local process pool (``workers``, 0 =
    every core, never more than there are units)."""
    if dask_address:
        from prefect_dask import DaskTaskRunner

        return DaskTaskRunner(address=dask_address)
    from prefect.task_runners import ProcessPoolTaskRunner

    return ProcessPoolTaskRunner(max_workers=min(workers or os.cpu_count() or 1, num_units))
