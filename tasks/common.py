"""Prefect glue every task shares: the retry condition. The rest lives in
``titan_core.pipeline.common`` (re-exported here for the tasks' imports)."""

from __future__ import annotations

from typing import Any

from titan_core.errors import TitanError
from titan_core.pipeline.common import (  # noqa: F401  (re-exports)
    load_config,
    mask_params,
    redact,
    register_secret,
    run_logger,
)


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect ``retry_condition_fn``: retry unless the failure is the user's input."""
    exc = state.result(raise_on_failure=False)
    if isinstance(exc, TitanError):
        return False
    return bool(getattr(exc, "retryable", True))
