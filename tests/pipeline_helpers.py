"""Helpers for the pipeline tests: tiny configs, Prefect run inspection, a restartable S3 server."""

from __future__ import annotations

import time
import uuid
from typing import Any


def tiny_overrides(*, steps: int, nproc: int, interval: int = 2) -> list[str]:
    """Overrides for a fast pipeline run of ``steps`` steps on ``nproc`` processes."""
    return [
        "--training.steps",
        str(steps),
        "--training.local_batch_size",
        "2",
        "--training.seq_len",
        "32",
        "--checkpoint.interval",
        str(interval),
        "--checkpoint.keep_latest_k",
        "0",
        "--metrics.log_freq",
        "1",
        "--metrics.cpu_peak_tflops",
        "1",
        "--validation.no_enable",
        "--launch.nproc_per_node",
        str(nproc),
        "--launch.retry_delay_seconds",
        "0",
        "--storage.no_progress",
    ]


def tiny_values(*, steps: int, nproc: int, interval: int = 2) -> dict[str, Any]:
    """``tiny_overrides`` as the flows take them: dotted config keys to typed values."""
    from titan_core.config.argv import cli_values

    return cli_values(tiny_overrides(steps=steps, nproc=nproc, interval=interval))


def run_flow(flow_fn: Any, **kwargs: Any) -> tuple[Any, Any]:
    """Run a flow; returns (its final state, its flow-run id)."""
    state = flow_fn(**kwargs, return_state=True)
    return state, state.state_details.flow_run_id


def task_runs(flow_run_id: Any, timeout: float = 30.0) -> dict[str, list[Any]]:
    """The task runs of a finished flow run, by task name (in start order).

    Task-run states reach the API as events, recorded a moment after the flow run returns: poll
    until none is still pending or running (a finished flow leaves no task run unfinished).
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
            )
            settled = all(run.state is not None and run.state.is_final() for run in runs)
            if settled or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    by_name: dict[str, list[Any]] = {}
    for run in sorted(runs, key=lambda r: r.expected_start_time or r.created):
        by_name.setdefault(run.name.rsplit("-", 1)[0], []).append(run)
    return by_name


def flow_logs(flow_run_id: Any) -> list[str]:
    """Every log message of a flow run (its tasks' included), after the enqueued ones are sent
    (logs reach the API in batches, some after the flow run has returned)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    messages: list[str] = []
    with get_client(sync_client=True) as client:
        while True:
            page = client.read_logs(
                LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                limit=200,
                offset=len(messages),
            )
            messages += [log.message for log in page]
            if len(page) < 200:
                return messages


def flow_run(flow_run_id: Any) -> Any:
    """The flow run record (state, parameters)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id)


def unique_prefix(name: str) -> str:
    """A fresh key prefix, so tests sharing the session's bucket never collide."""
    return f"{name}-{uuid.uuid4().hex[:8]}"
