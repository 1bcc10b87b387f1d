"""An MLflow ``MetricsSink``: per-step metrics into an existing MLflow run, live.

Names on MLflow are ``train/<name>`` (``mlflow_name``), so the train stage run and the pipeline's
parent run chart the same keys; metrics.jsonl and the console keep the trainer's names.

The pipeline creates the run and hands it to rank 0 through the environment
(``TITAN_MLFLOW_RUN_ID`` and ``TITAN_MLFLOW_TRACKING_URI``); ``mlflow_sink_from_env`` builds the
sink when they are set. MLflow is imported lazily, on a background thread that also does the
logging, so neither its import time nor a slow tracking server ever stalls a training step.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any

from titan_core.logging import logger

RUN_ID_ENV = "TITAN_MLFLOW_RUN_ID"
TRACKING_URI_ENV = "TITAN_MLFLOW_TRACKING_URI"
TRAIN_PREFIX = "train/"
_CLOSE = object()
_CLOSE_TIMEOUT_S = 120.0
_ATTEMPTS = 3


def mlflow_name(name: str) -> str:
    """The metric's name on MLflow: ``train/<name>`` for the trainer's own (``loss``, ``tps``,
    ``mfu_pct``, ``grad_norm``, ``lr`` ...); namespaced ones (``memory/*``, ``moe/*``,
    ``validation/*``) keep theirs. The pipeline's parent run uses the same names."""
    return name if "/" in name else f"{TRAIN_PREFIX}{name}"


class MlflowSink:
    """Logs each step's metrics to ``run_id`` on ``tracking_uri`` from a background thread."""

    def __init__(self, run_id: str, tracking_uri: str) -> None:
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self.num_logged = 0
        self.num_failed = 0
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="mlflow-sink", daemon=True)
        self._thread.start()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Queue the step's metrics (returns at once)."""
        self._queue.put((step, int(time.time() * 1000), dict(metrics)))

    def log_params(self, params: dict[str, str]) -> None:
        """Queue params of the run (e.g. the peak MFU divides by); returns at once. A retried
        attempt that logs a different value keeps the first (MLflow params never change)."""
        self._queue.put(dict(params))

    def close(self) -> None:
        """Send everything still queued, then stop the thread."""
        self._queue.put(_CLOSE)
        self._thread.join(timeout=_CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("MLflow sink: gave up waiting for %s to accept metrics", self.run_id)

    def _work(self) -> None:
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.tracking_uri)
        while (item := self._queue.get()) is not _CLOSE:
            if isinstance(item, dict):
                self._send_params(client, item)
                continue
            step, timestamp, metrics = item
            batch = [Metric(mlflow_name(k), float(v), timestamp, step) for k, v in metrics.items()]
            self._send(client, batch, step)

    def _send_params(self, client: Any, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        try:
            known = client.get_run(self.run_id).data.params
            new = [Param(k, v) for k, v in params.items() if k not in known]
            if new:
                client.log_batch(self.run_id, params=new)
        except Exception as e:  # a tracking hiccup must never end a training run
            logger.warning("MLflow sink: params not logged: %s", _first_line(e))

    def _send(self, client: Any, batch: list[Any], step: int) -> None:
        for attempt in range(_ATTEMPTS):
            try:
                client.log_batch(self.run_id, metrics=batch)
                self.num_logged += 1
                return
            except Exception as e:  # a tracking hiccup must never end a training run
                if attempt == _ATTEMPTS - 1:
                    self.num_failed += 1
                    logger.warning("MLflow sink: step %d not logged: %s", step, _first_line(e))
                else:
                    time.sleep(0.5 * 2**attempt)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def mlflow_env(tracking_uri: str, run_id: str) -> dict[str, str]:
    """The environment that makes rank 0 stream its metrics into MLflow run ``run_id`` (read by
    ``mlflow_sink_from_env``); empty when either is missing."""
    if not tracking_uri or not run_id:
        return {}
    return {RUN_ID_ENV: run_id, TRACKING_URI_ENV: tracking_uri}


def mlflow_sink_from_env() -> MlflowSink | None:
    """The sink for the run named in the environment, or None when no run is set."""
    run_id = os.environ.get(RUN_ID_ENV, "")
    if not run_id:
        return None
    uri = os.environ.get(TRACKING_URI_ENV) or os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri:
        logger.warning("%s is set without %s: no metrics to MLflow", RUN_ID_ENV, TRACKING_URI_ENV)
        return None
    logger.info("Streaming metrics to MLflow run %s", run_id)
    return MlflowSink(run_id, uri)
