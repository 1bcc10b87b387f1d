"""MLflow tracking of pipeline runs: one experiment per ``job.experiment``, a parent run per
pipeline run and a nested run per stage.

The params of the parent run and of its train stage run are the run's stored ``config.toml``
(auto values resolved by preflight, secrets masked), logged once that config is final; tags carry
the git commit, the Prefect flow-run id, the run root, the world size and the device.
Everything goes through an explicit ``MlflowClient`` (no global active run), so tasks on any
thread or process can log to the runs they are handed. MLflow is imported lazily: importing it
takes seconds.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_core import storage
from titan_core.config.job import JobConfig
from titan_core.errors import TitanError
from titan_core.pipeline.run.common import mask_params, public_url, redact
from titan_core.pipeline.run.params import config_params
from titan_core.pipeline.run.paths import RunPaths, absolute

PARENT_STAGE = "pipeline"
STAGE_TAG = "titan.stage"
DRILL_TAG = "titan.drill"  # "true" on the parent run of a fault drill (debug.drill)
NOTE_TAG = "mlflow.note.content"  # what MLflow's UI shows as a run's description (markdown)
_PARAM_BATCH = 100  # MLflow's limit of params per log_batch call
_HEALTH_TIMEOUT_S = 5.0


class TrackingError(TitanError):
    """The tracking server cannot be reached or refused a request: one line naming the URI."""


@dataclass(frozen=True)
class TrackingContext:
    """Where a pipeline run is tracked: the tracking URI, experiment and parent run."""

    uri: str
    experiment: str
    experiment_id: str
    parent_run_id: str


def resolve_tracking_uri(cfg: JobConfig) -> str:
    """``tracking.uri``, else ``MLFLOW_TRACKING_URI``, else a SQLite file in the (local) output
    root ``job.dump_folder`` (./outputs for URL roots). ``cfg`` is the user's config (its
    dump_folder the root), not a run's (there it is the run's own folder)."""
    if cfg.tracking.uri:
        return cfg.tracking.uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    root = "./outputs" if storage.is_url(cfg.job.dump_folder) else cfg.job.dump_folder
    return "sqlite:///" + os.path.join(absolute(root), "mlflow.db")


def check_tracking(uri: str) -> None:
    """``TrackingError`` unless the tracking backend at ``uri`` answers (or can be created)."""
    if uri.startswith(("http://", "https://")):
        import requests

        try:
            response = requests.get(uri.rstrip("/") + "/health", timeout=_HEALTH_TIMEOUT_S)
        except requests.RequestException as e:
            reason = type(e).__name__
            raise TrackingError(
                f"tracking.uri: no MLflow server answers at {public_url(uri)} ({reason})"
            ) from None
        if response.status_code != 200:
            raise TrackingError(
                f"tracking.uri: {public_url(uri)} answered HTTP {response.status_code} to /health; "
                "is it an MLflow tracking server?"
            )
    elif uri.startswith("sqlite:///"):
        folder = os.path.dirname(uri.removeprefix("sqlite:///")) or "."
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise TrackingError(f"tracking.uri: cannot create {folder}: {e.strerror}") from None


def client(uri: str) -> Any:
    """An ``MlflowClient`` for ``uri``."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def artifact_location(cfg: JobConfig, uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: ``tracking.artifact_location``, else the
    output root's ``mlflow-artifacts/`` (None on a tracking server: the server decides); ``cfg``
    is the user's config, as for ``resolve_tracking_uri``."""
    if cfg.tracking.artifact_location:
        return cfg.tracking.artifact_location
    if uri.startswith(("http://", "https://")):
        return None  # the server's --artifacts-destination decides
    return storage.join(absolute(cfg.job.dump_folder), "mlflow-artifacts", cfg.job.experiment)


# MLflow 3's UI opens an experiment on its GenAI views (traces) unless the experiment says it is
# about training models; the tag is what its "experiment type" selector writes.
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}


# The light `mlflow ui`: one web worker and no job runner (2 processes, ~0.5 GB, against 15 and
# ~3.2 GB by default, measured with MLflow 3.17). docs/tracking.md says why.
MLFLOW_UI = (
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow ui --backend-store-uri {uri} --workers 1"
)
LOCAL_UI = "http://127.0.0.1:5000"  # where that command serves
# MLflow 3's UI opens on its GenAI views; these open the training view.
EXPERIMENT_PAGE = "{base}/#/experiments/{id}?workflowType=machine_learning"
RUN_PAGE = "{base}/#/experiments/{id}/runs/{run}?workflowType=machine_learning"


def is_server(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def mlflow_ui(uri: str, result: Mapping[str, Any]) -> str:
    """How to see a pipeline run's experiment in MLflow: the page on a tracking server, or the
    command that serves a local store and the page to open (``result``: the flow's result,
    with ``mlflow_experiment_id``)."""
    experiment = result.get("mlflow_experiment_id", "")
    if is_server(uri):
        return EXPERIMENT_PAGE.format(base=uri.rstrip("/"), id=experiment) if experiment else uri
    command = MLFLOW_UI.format(uri=uri)
    if experiment:
        command += f"  (then open {EXPERIMENT_PAGE.format(base=LOCAL_UI, id=experiment)})"
    return command


def run_page_markdown(tracking: TrackingContext) -> str:
    """Where the pipeline's MLflow run is, for the flow run's Prefect artifact: a link on a
    tracking server; with a local store, the command that serves it and the link it opens."""
    uri = public_url(tracking.uri)
    ids = {"id": tracking.experiment_id, "run": tracking.parent_run_id}
    head = f"# MLflow run\n\nRun `{tracking.parent_run_id}` of experiment `{tracking.experiment}`"
    if is_server(uri):
        page = RUN_PAGE.format(base=uri.rstrip("/"), **ids)
        return f"{head} on {uri}: [open it]({page}).\n"
    page = RUN_PAGE.format(base=LOCAL_UI, **ids)
    return (
        f"{head}, in the local store `{uri}`. Serve it with\n\n"
        f"```bash\n{MLFLOW_UI.format(uri=uri)}\n```\n\nthen open [the run]({page}).\n"
    )


def ensure_experiment(mlflow_client: Any, name: str, artifact_location: str | None) -> str:
    """The id of experiment ``name``, created (with ``artifact_location``, tagged as a model
    training experiment: ``EXPERIMENT_KIND``) when missing."""
    found = mlflow_client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return mlflow_client.create_experiment(
            name, artifact_location=artifact_location, tags=EXPERIMENT_KIND
        )
    except Exception:  # created concurrently by another run
        found = mlflow_client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def git_commit() -> str:
    """The commit of the project's checkout, read from ``.git`` (no git binary); or unknown."""
    git = Path(__file__).resolve().parents[3] / ".git"  # titan_core/pipeline/run/
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head.removeprefix("ref: ")
        if (git / ref).exists():
            return (git / ref).read_text().strip()
        for line in (git / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0]
    except OSError:
        pass
    return "unknown"


def device_name() -> str:
    """``cuda:<name>`` when a GPU is visible, else ``cpu``."""
    import torch

    return f"cuda:{torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "cpu"


def run_tags(
    cfg: JobConfig, paths: RunPaths, flow_run_id: str, parent_run_id: str = ""
) -> dict[str, str]:
    """Tags of a pipeline's parent run; ``parent_run_id`` nests it under another run (a sweep)."""
    commit = git_commit()
    nesting = {"mlflow.parentRunId": parent_run_id} if parent_run_id else {}
    drill = {DRILL_TAG: "true"} if cfg.debug.drill else {}
    return {
        **nesting,
        **drill,
        STAGE_TAG: PARENT_STAGE,
        # What MLflow's "Source" column shows: the pipeline and the recipe or config it ran.
        "mlflow.source.name": f"titan pipeline: {cfg.job.description or cfg.model.name}",
        "mlflow.source.type": "JOB",
        "mlflow.source.git.commit": commit,
        "git_commit": commit,
        "prefect.flow_run_id": flow_run_id,
        "storage_root": redact(paths.run_root),
        "world_size": str(cfg.launch.nnodes * cfg.launch.nproc_per_node),
        "device": device_name(),
        "titan.run_id": paths.run_id,
        "model": f"{cfg.model.name}/{cfg.model.flavor}",
    }


def log_params(mlflow_client: Any, run_id: str, params: JobConfig | dict[str, Any]) -> None:
    """A config (flattened) or flat params as the run's params, secrets masked."""
    from mlflow.entities import Param

    from titan_core.config.schema import flatten

    flat = flatten(params) if isinstance(params, JobConfig) else params
    batch = [Param(k, str(v)) for k, v in mask_params(flat).items()]
    for i in range(0, len(batch), _PARAM_BATCH):
        mlflow_client.log_batch(run_id, params=batch[i : i + _PARAM_BATCH])


def log_config(ctx: TrackingContext | None, run_id: str, config_url: str) -> None:
    """The run's stored config (``config_params``) as the params of ``run_id``. Params cannot
    change once logged, so this runs once the config is final (after preflight and the seed);
    logging the same values again (a retried stage) is allowed."""
    if ctx is None or not run_id:
        return
    params = config_params(config_url)
    log_params(client(ctx.uri), run_id, params | used_tracking(ctx, params))


def used_tracking(ctx: TrackingContext, params: dict[str, Any]) -> dict[str, str]:
    """The tracking settings a run used where its config ``params`` leave them empty (the store
    it was resolved to, without credentials; the registered model, which defaults to the
    experiment), so that its params say where it went."""
    used = {}
    if not params.get("tracking.uri"):
        used["tracking.uri"] = public_url(ctx.uri)
    if not params.get("tracking.registered_model"):
        used["tracking.registered_model"] = ctx.experiment
    return used


def start_pipeline_run(
    cfg: JobConfig, paths: RunPaths, flow_run_id: str, parent_run_id: str = ""
) -> TrackingContext:
    """Create (or reopen) the experiment and the parent run of this pipeline run, nested under
    ``parent_run_id`` when given (tag ``mlflow.parentRunId``)."""
    uri = resolve_tracking_uri(cfg)
    check_tracking(uri)
    try:
        mlflow_client = client(uri)
        experiment_id = ensure_experiment(
            mlflow_client, cfg.job.experiment, artifact_location(cfg, uri)
        )
        run = mlflow_client.create_run(
            experiment_id,
            tags=run_tags(cfg, paths, flow_run_id, parent_run_id),
            run_name=paths.run_id,
        )
    except TitanError:
        raise
    except Exception as e:
        raise TrackingError(f"tracking.uri: {public_url(uri)}: {redact(_first_line(e))}") from None
    return TrackingContext(uri, cfg.job.experiment, experiment_id, run.info.run_id)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def find_stage_run(ctx: TrackingContext, stage: str) -> str | None:
    """The nested run of ``stage`` under the parent run, if one exists (e.g. on a retry)."""
    runs = client(ctx.uri).search_runs(
        [ctx.experiment_id],
        filter_string=(
            f"tags.mlflow.parentRunId = '{ctx.parent_run_id}' and tags.`{STAGE_TAG}` = '{stage}'"
        ),
        max_results=1,
    )
    return runs[0].info.run_id if runs else None


def log_stage_config(ctx: TrackingContext | None, run_id: str, run_root: str) -> None:
    """A convert or evaluate stage run's params: the stored config of the run it works on
    (``<run_root>/config.toml``), as its train run has them; nothing when there is none."""
    config_url = storage.join(run_root, "config.toml")
    if ctx is not None and run_id and storage.exists(config_url):
        log_config(ctx, run_id, config_url)


def copy_curves(ctx: TrackingContext | None, run_id: str, keys: tuple[str, ...]) -> None:
    """Every step of ``keys`` from stage run ``run_id`` onto the parent run, so that its charts
    are curves, not the single final point."""
    if ctx is None or not run_id:
        return
    mlflow_client = client(ctx.uri)
    history = [m for key in keys for m in mlflow_client.get_metric_history(run_id, key)]
    for i in range(0, len(history), 1000):  # MLflow's batch limit
        mlflow_client.log_batch(ctx.parent_run_id, metrics=history[i : i + 1000])


@contextlib.contextmanager
def stage_run(ctx: TrackingContext | None, stage: str, *, reuse: bool = False) -> Iterator[str]:
    """A nested run for ``stage`` under the parent run; yields its id ("" when untracked).

    ``reuse`` continues the stage's existing run (a retried task logs into the same run).
    The run ends FINISHED, or FAILED when the block raises.
    """
    if ctx is None:
        yield ""
        return
    mlflow_client = client(ctx.uri)
    run_id = find_stage_run(ctx, stage) if reuse else None
    if run_id is None:
        tags = {"mlflow.parentRunId": ctx.parent_run_id, STAGE_TAG: stage}
        run_id = mlflow_client.create_run(ctx.experiment_id, tags=tags, run_name=stage).info.run_id
    else:
        mlflow_client.update_run(run_id, status="RUNNING")
    try:
        yield run_id
    except BaseException:
        mlflow_client.set_terminated(run_id, status="FAILED")
        raise
    mlflow_client.set_terminated(run_id, status="FINISHED")


def log_metrics(
    ctx: TrackingContext | None, run_id: str, metrics: dict[str, float], step: int = 0
) -> None:
    """Log ``metrics`` (numbers only) to ``run_id`` at ``step``."""
    if ctx is None or not run_id:
        return
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    batch = [
        Metric(k, float(v), now, step)
        for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    ]
    client(ctx.uri).log_batch(run_id, metrics=batch)


def end_pipeline_run(ctx: TrackingContext | None, status: str) -> None:
    """Close the parent run as FINISHED, FAILED or KILLED."""
    if ctx is not None:
        client(ctx.uri).set_terminated(ctx.parent_run_id, status=status)
