"""Prefect glue every task shares: the retry condition (what it retries is decided by the
exception; what tasks call lives in ``titan_core.pipeline``)."""

from __future__ import annotations

from typing import Any

from titan_core.errors import TitanError


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect ``retry_condition_fn``: retry unless the failure is the user's input."""
    exc = state.result(raise_on_failure=False)
    if isinstance(exc, TitanError):
        return False
    return bool(getattr(exc, "retryable", True))
