"""Publishing a run without an orchestrator: the Hugging Face export gets a model card and becomes
a version of the registered model, and the run gets its summary.

The model card (``README.md``: recipe, data, steps, tokens, eval numbers, which precision they
belong to, how to load it) is written into the export, which becomes a new version of the
registered model (source: the export's storage URL; a description; the eval loss as a rounded
tag). The alias ``champion`` moves to it only when its ``tracking.champion_metric`` (default the
exact ``eval/loss`` of its run; higher or lower wins as ``titan_core.config.metrics`` says)
beats the current champion's. A fault drill (``debug.drill``) registers no version and moves
no alias: its summary says it was a drill. The parent MLflow run gets the final ``train/*`` and
``eval/*`` metrics at the final step and the run's config and summary (which names the step
guard's incidents) as artifacts. The ``publish`` task (``tasks/publish.py``) shows the summary and
the locations as Prefect artifacts.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field, replace

from titan_core import storage
from titan_core.config.metrics import direction, is_better
from titan_core.pipeline.run.common import redact
from titan_core.pipeline.run.paths import absolute
from titan_core.pipeline.run.report import format_metric, is_count, markdown_table
from titan_core.pipeline.run.tracking import TrackingContext, client, log_metrics
from titan_core.pipeline.run.transfer import refresh
from titan_core.pipeline.stages.evaluation import Evaluation
from titan_core.pipeline.stages.model_card import (
    export_facts,
    location_markdown,
    version_description,
    write_model_card,
)
from titan_core.pipeline.stages.training import (
    health_counts,
    health_lines,
    health_summary,
    stored_health_rows,
)

CHAMPION = "champion"
EVAL_LOSS_TAG = "eval_loss"  # rounded for people; the champion rule reads the run's eval/loss
GATE_METRIC = "eval/loss"  # the champion rule's metric unless tracking.champion_metric says
_TRAIN_KEYS = ("loss", "tps", "mfu_pct", "tflops", "grad_norm")


@dataclass(frozen=True)
class Publication:
    """A published run: where its outputs are, its final metrics, its model version."""

    run_id: str
    """The run's id (the run root's last path component)."""
    run_root: str
    """The run root (secrets redacted, as every URL here)."""
    checkpoint: str
    """The final checkpoint."""
    hf: str
    """The Hugging Face export."""
    eval_report: str
    """The evaluation's ``report.json``."""
    model_card: str
    """The export's ``README.md``."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Final ``train/*`` values and the ``eval/*`` metrics."""
    model_name: str = ""
    """The registered model; "" when untracked."""
    model_version: str = ""
    """The new version of it; "" when untracked."""
    champion: bool = False
    """Whether the ``champion`` alias moved to the new version."""
    champion_metric: str = GATE_METRIC
    """The metric the champion rule compared (``tracking.champion_metric``)."""
    previous_champion_value: float | None = None
    """The champion's ``champion_metric`` before this run (None: there was none, or its run
    did not log the metric)."""
    drill: bool = False
    """A fault drill (``debug.drill``): no model version registered, no alias moved."""
    health_summary: str = ""
    """The step guard's counts (``1 incident, 1 rollback``); "" when it saw nothing."""
    incidents: list[str] = field(default_factory=list)
    """The guard's ``health.jsonl`` rows, one line each (``health_lines``)."""


def final_train_metrics(run_root: str) -> dict[str, float]:
    """The last logged values of the headline training metrics (from ``metrics.jsonl``)."""
    path = storage.join(run_root, "metrics.jsonl")
    refresh(path)
    if not storage.exists(path):
        return {}
    last: dict[str, float] = {}
    for line in storage.read_text(path).splitlines():
        row = json.loads(line)
        last.update({f"train/{k}": row[k] for k in _TRAIN_KEYS if k in row})
    return last


def register_version(
    tracking: TrackingContext, name: str, source: str, tags: dict[str, str], description: str = ""
) -> str:
    """A new version of registered model ``name`` (created when missing); returns the version."""
    mlflow_client = client(tracking.uri)
    if not mlflow_client.search_registered_models(filter_string=f"name = '{name}'"):
        mlflow_client.create_registered_model(name)
    version = mlflow_client.create_model_version(
        name,
        source=source,
        run_id=tracking.parent_run_id,
        tags=tags,
        description=description or None,
    )
    return str(version.version)


def registrable_source(tracking: TrackingContext, hf_url: str) -> str:
    """The model-version source for the export at ``hf_url``.

    A URL (``s3://…``) or a local path with a local tracking store registers as it is. A tracking
    server only accepts sources inside the run's artifact store, and a local folder would not be
    reachable from other machines anyway: the export is uploaded as the parent run's ``hf``
    artifacts and registered from there.
    """
    if storage.is_url(hf_url):
        return hf_url
    if not tracking.uri.startswith(("http://", "https://")):
        return absolute(hf_url)
    mlflow_client = client(tracking.uri)
    mlflow_client.log_artifacts(tracking.parent_run_id, absolute(hf_url), "hf")
    artifact_uri = mlflow_client.get_run(tracking.parent_run_id).info.artifact_uri
    return artifact_uri.rstrip("/") + "/hf"


def champion_value(tracking: TrackingContext, name: str, metric: str = GATE_METRIC) -> float | None:
    """The current champion's ``metric``: the exact value its run logged (the eval loss tag is
    rounded, and read only when the run is gone); None without a champion, or when its run
    never logged ``metric`` (registered before the metric was gated on: nothing to beat)."""
    mlflow_client = client(tracking.uri)
    try:
        version = mlflow_client.get_model_version_by_alias(name, CHAMPION)
    except Exception:  # no such alias (MLflow raises a RestException)
        return None
    if version.run_id:
        try:
            exact = mlflow_client.get_run(version.run_id).data.metrics.get(metric)
        except Exception:  # the run was deleted: the tag still says its eval loss
            exact = None
        if exact is not None:
            return float(exact)
    value = version.tags.get(EVAL_LOSS_TAG) if metric == GATE_METRIC else None
    return float(value) if value is not None else None


def promote_if_better(
    tracking: TrackingContext, name: str, version: str, value: float, metric: str = GATE_METRIC
) -> tuple[bool, float | None]:
    """Move ``champion`` to ``version`` if its ``metric`` (``value``) beats the champion's
    (``is_better``: strictly, in the metric's direction); returns (moved, the old value)."""
    previous = champion_value(tracking, name, metric)
    better = is_better(metric, value, previous)
    if better:
        client(tracking.uri).set_registered_model_alias(name, CHAMPION, version)
    return better, previous


def settle_champion(tracking: TrackingContext, name: str, metric: str = GATE_METRIC) -> str:
    """Point ``champion`` where the champion rule, applied to ``name``'s versions one after
    another in the order they were registered, leaves it; returns that version ("" when none
    logged ``metric``). Runs that publish at once (a sweep's trials) each apply the rule to the
    champion they read, so the last to write wins even when it is worse; replaying the rule
    afterwards gives the alias the one place a sequence of publishes would have."""
    mlflow_client = client(tracking.uri)
    versions = sorted(
        mlflow_client.search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version)
    )
    champion, best = "", None
    for version in versions:
        try:
            value = mlflow_client.get_run(version.run_id).data.metrics.get(metric)
        except Exception:  # the run was deleted: nothing to compare
            value = None
        if value is not None and is_better(metric, float(value), best):
            champion, best = str(version.version), float(value)
    if champion:
        mlflow_client.set_registered_model_alias(name, CHAMPION, champion)
    return champion


DRILL_NOTE = "none: a drill (debug.drill) registers no model version and moves no alias"


def summary_markdown(pub: Publication) -> str:
    """The run's summary for people: where its outputs are, its model version (a drill says it
    is one), its metrics and the step guard's incidents."""
    version = f"{pub.model_name or '-'} v{pub.model_version or '-'}"
    lines = [
        f"# Run `{pub.run_id}`" + (" (drill)" if pub.drill else ""),
        "",
        f"- run root: `{pub.run_root}`",
        f"- final checkpoint: `{pub.checkpoint}`",
        f"- Hugging Face export: `{pub.hf}`",
        f"- model version: {DRILL_NOTE if pub.drill else version}"
        + (" (champion)" if pub.champion else ""),
        f"- champion rule: the {direction(pub.champion_metric)} `{pub.champion_metric}` wins",
        *([f"- training health: {pub.health_summary}"] if pub.health_summary else []),
        "",
    ]
    rows = [(k, format_metric(k, v)) for k, v in sorted(pub.metrics.items())]
    lines += markdown_table(["metric", "value"], rows, right={1})
    if pub.incidents:
        lines += ["", f"## Training health: {pub.health_summary}", ""]
        lines += [f"- {line}" for line in pub.incidents]
    return "\n".join(lines) + "\n"


def metric_rows(pub: Publication) -> list[dict[str, str | float]]:
    """The final metrics as table rows (``metric``, ``value``; counts as whole numbers)."""
    return [
        {"metric": k, "value": int(v) if is_count(k) and float(v).is_integer() else round(v, 6)}
        for k, v in sorted(pub.metrics.items())
    ]


def locations(pub: Publication) -> dict[str, tuple[str, str]]:
    """How to open the run root and the export: {artifact key: (markdown, description)}. A
    ``file://`` or ``s3://`` link opens nothing in a browser, so each says where and how."""
    where = {
        "run-root": ("Run root", pub.run_root, "Checkpoints, config.toml, metrics, logs."),
        "hf-export": ("Hugging Face export", pub.hf, "Weights, tokenizer, model card."),
    }
    out = {}
    for key, (title, url, what) in where.items():
        url = url if storage.is_url(url) else absolute(url)
        out[key] = (location_markdown(title, url, what), f"{title}: {url}")
    return out


NOTE_TAG = "mlflow.note.content"  # what MLflow's UI shows as a run's description


def log_run_files(tracking: TrackingContext, pub: Publication) -> None:
    """The summary (markdown, JSON), the run's config and the model card as the parent run's
    ``run/`` artifacts; the summary as its description."""
    with tempfile.TemporaryDirectory(prefix="titan-publish-") as tmp:
        files = {
            "summary.md": summary_markdown(pub),
            "summary.json": json.dumps(asdict(pub), indent=2),
        }
        config = storage.join(pub.run_root, "config.toml")
        if storage.exists(config):
            files["config.toml"] = storage.read_text(config)
        if pub.model_card and storage.exists(pub.model_card):  # the export's README.md
            files["model_card.md"] = storage.read_text(pub.model_card)
        for name, text in files.items():
            storage.write_text(os.path.join(tmp, name), redact(text))
        mlflow_client = client(tracking.uri)
        mlflow_client.log_artifacts(tracking.parent_run_id, tmp, "run")
    # The run's description in MLflow's UI (markdown): what it trained, where it is, how it did.
    mlflow_client.set_tag(tracking.parent_run_id, NOTE_TAG, redact(summary_markdown(pub)))


def publish_run(
    run_root: str,
    checkpoint_url: str,
    hf_url: str,
    evaluation: Evaluation,
    tracking: TrackingContext | None = None,
    registered_model: str = "",
    recipe: str = "",
    drill: bool = False,
    champion_metric: str = GATE_METRIC,
) -> Publication:
    """Write the export's model card; with ``tracking``, log the final metrics to the parent run,
    register the export as a version of ``registered_model`` (default: the experiment), move
    ``champion`` if its ``champion_metric`` beats the champion's and attach the summary.
    ``recipe`` is named in the card. A ``drill`` (``debug.drill``) is summarised, never
    registered."""
    rows = stored_health_rows(run_root)
    metrics = {**final_train_metrics(run_root)}
    metrics |= {f"eval/{k}": float(v) for k, v in evaluation.metrics.items()}
    name = (registered_model or tracking.experiment) if tracking is not None else ""
    facts = export_facts(run_root, checkpoint_url, hf_url, evaluation, recipe, name)
    card = write_model_card(hf_url, facts)  # before registering: a server copies the folder
    pub = Publication(
        run_id=run_root.rstrip("/").rsplit("/", 1)[-1],
        run_root=redact(run_root),
        checkpoint=redact(checkpoint_url),
        hf=redact(hf_url),
        eval_report=redact(evaluation.report_url),
        model_card=redact(card),
        metrics=metrics,
        drill=drill,
        health_summary=health_summary(health_counts(rows)) if rows else "",
        incidents=health_lines(rows),
        champion_metric=champion_metric,
    )
    if tracking is None:
        return pub
    eval_loss = float(evaluation.metrics["loss"])
    if champion_metric not in metrics:  # the config check makes this an internal error
        raise ValueError(f"tracking.champion_metric {champion_metric!r}: the run did not log it")
    # Logged before the version: the champion rule reads the champion's run's exact metrics.
    log_metrics(tracking, tracking.parent_run_id, metrics, step=evaluation.step)
    if drill:  # a rehearsal, not a model: summarised in its run, never in the registry
        log_run_files(tracking, pub)
        return pub
    version = register_version(
        tracking,
        name,
        registrable_source(tracking, hf_url),
        {
            EVAL_LOSS_TAG: f"{eval_loss:.4g}",
            "run_root": redact(run_root),
            "step": str(evaluation.step),
        },
        description=redact(version_description(facts)),
    )
    moved, previous = promote_if_better(
        tracking, name, version, metrics[champion_metric], champion_metric
    )
    pub = replace(pub, model_name=name, model_version=version, champion=moved)
    pub = replace(pub, previous_champion_value=previous)
    log_run_files(tracking, pub)
    return pub
