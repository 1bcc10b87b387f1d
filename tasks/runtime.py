"""Prefect runtime glue shared by tasks and flows: task runners, flow-run names and tags, one-line
console errors, secrets from blocks, the run logger, where cached results live.

Only what needs Prefect lives here (``tests/test_thin_tasks.py`` checks that every function does);
what it wraps is in ``titan_core.pipeline``, which never imports Prefect: stage code takes the
logger and the secret loader these functions provide as arguments.

Flow runs people can find: Prefect names flow runs at random (``sassy-otter``). A pipeline's flow
run starts named after its run id (``run_id_name``); once its config is resolved it renames
itself ``<experiment>/<run_id>`` and adds tags (``titan_core.pipeline.run.config.flow_run_tags``)
to filter by in the UI (``name_flow_run``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

from titan_core.pipeline.run.common import Logger, titan_logger
from titan_core.pipeline.run.paths import is_run_id, new_run_id

# ------------------------------------------------------------------ logs and secrets


def run_logger() -> Logger:
    """The Prefect run logger inside a task or flow, the ``titan`` logger elsewhere.

    In a run it is the run logger's child ``titan`` (``prefect.task_runs.titan``): its records
    reach the Prefect UI as the run logger's do, DEBUG included (the launch command) unless a
    logging config sets its level, and the pipeline console's logging config
    (``titan_core/pipeline/run/logging.yml``) tells them from what Prefect's engine says."""
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        logger = get_run_logger().getChild("titan")
    except MissingContextError:
        return titan_logger()
    named = logging.getLogger(logger.name)
    if named.level == logging.NOTSET:  # no logging config names it (Prefect's own config)
        named.setLevel(logging.DEBUG)
    return logger


def load_secret(block: str) -> Any:
    """The value of the Prefect Secret block ``block`` (``ValueError`` when there is none): the
    ``load_secret`` of ``titan_core.pipeline.run.transfer.configure_credentials``."""
    from prefect.blocks.system import Secret

    return Secret.load(block).get()


def quiet_user_errors() -> None:
    """Configure Prefect's logging (by importing it) and wrap its console handlers' formatters
    with ``OneLineUserErrors`` (``titan_core.pipeline.run.console``). Call after the Prefect
    settings are in the environment."""
    import prefect.main  # noqa: F401  (sets up Prefect's logging: a console handler on the root)
    from prefect.logging.handlers import PrefectConsoleHandler

    from titan_core.pipeline.run.console import OneLineUserErrors

    loggers = [logging.getLogger()] + [
        logger
        for logger in logging.Logger.manager.loggerDict.values()
        if isinstance(logger, logging.Logger)
    ]
    for logger in loggers:
        for handler in logger.handlers:
            if isinstance(handler, PrefectConsoleHandler) and not isinstance(
                handler.formatter, OneLineUserErrors
            ):
                handler.setFormatter(OneLineUserErrors(handler.formatter))


# ------------------------------------------------------------------ flow-run names and tags


def run_id_name() -> str:
    """Prefect ``flow_run_name``: the flow run starts named after its run id (the ``run_id``
    parameter, else a new id), so even its first log lines ("Beginning flow run ...") name
    something findable; ``current_run_id`` reads the id back in the flow."""
    from prefect.runtime import flow_run

    return str(flow_run.parameters.get("run_id") or "") or new_run_id()


def current_run_id(given: str = "") -> str:
    """The run id of this flow run: ``given``, else the one its name carries (``run_id_name``),
    else a new one (outside a flow run, or a name set by hand)."""
    if given:
        return given
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    name = ctx.flow_run.name if ctx is not None and ctx.flow_run is not None else ""
    return name if is_run_id(name or "") else new_run_id()


def name_flow_run(name: str, tags: list[str]) -> None:
    """Rename the current flow run to ``name`` and add ``tags`` to its own (a deployment's tags
    stay); does nothing outside a flow run."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return
    flow_run = ctx.flow_run
    merged = list(dict.fromkeys([*flow_run.tags, *tags]))
    with get_client(sync_client=True) as client:
        client.update_flow_run(flow_run.id, name=name, tags=merged)
    # The context's copy too, so that later reads in this run (logs, runtime) agree.
    flow_run.name, flow_run.tags = name, merged


# ------------------------------------------------------------------ the cache


def result_storage(url: str) -> Any:
    """Prefect result storage at ``url`` (a folder or an ``s3://`` URL): where the cached stages
    keep their results, i.e. the cache. Set on each cached task with the output root's folder
    (``RunPaths.results``), it is the same for every way a flow run starts, where Prefect's
    default (``PREFECT_LOCAL_STORAGE_PATH``) follows each process's ``PREFECT_HOME``.

    A folder is a ``Path``; a URL a ``RemoteFileSystem`` block, which Prefect wants saved: it is
    saved (``titan-results-<hash of the URL>``, no credentials in it) on the API this run uses."""
    import hashlib
    from pathlib import Path

    from prefect.filesystems import RemoteFileSystem

    from titan_core import storage

    if not storage.is_url(url):
        return Path(os.path.abspath(url.removeprefix("file://")))
    block = RemoteFileSystem(basepath=url)
    block.save(f"titan-results-{hashlib.sha256(url.encode()).hexdigest()[:16]}", overwrite=True)
    return block


# ------------------------------------------------------------------ task runners


@contextlib.contextmanager
def api_for_workers() -> Iterator[None]:
    """Point the workers of a task runner at this process's Prefect API.

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


def run_each(
    task: Any, calls: Sequence[dict[str, Any]], workers: int, dask_address: str
) -> list[Any]:
    """Run ``task`` once per parameter set in ``calls``, each a task run of its own (nested under
    the calling task in the UI) on ``task_runner(workers, dask_address, ...)``; their results in
    order (the first failure in that order is raised)."""
    with api_for_workers(), task_runner(workers, dask_address, len(calls)) as runner:
        futures = [runner.submit(task, parameters=parameters) for parameters in calls]
        return [future.result() for future in futures]
