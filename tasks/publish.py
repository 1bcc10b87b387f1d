"""``publish``: register the Hugging Face export in MLflow and summarise the run in Prefect.

The export gets a model card (``README.md``: recipe, data, steps, tokens, eval numbers, which
precision they belong to, how to load it) and becomes a new version of the registered model
(source: the export's storage URL; a description; the eval loss as a rounded tag). The alias
``champion`` moves to it only when its eval loss (the exact ``eval/loss`` of its run) beats the
current champion's. The parent MLflow run gets the final ``train/*`` and ``eval/*`` metrics at the
final step and the run's config and summary as artifacts; Prefect gets a markdown summary, a
metrics table, and how to open the run root and the export (``run-root``, ``hf-export``).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.common import redact, retry_transient, run_logger
from tasks.storage import absolute, refresh
from tasks.tracking import TrackingContext, client, log_metrics
from titan_core import storage
from titan_core.pipeline.model_card import (
    export_facts,
    location_markdown,
    version_description,
    write_model_card,
)

CHAMPION = "champion"
EVAL_LOSS_TAG = "eval_loss"  # rounded for people; the champion rule reads the run's eval/loss
_TRAIN_KEYS = ("loss", "tps", "mfu_pct", "tflops", "grad_norm")


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


def champion_loss(tracking: TrackingContext, name: str) -> float | None:
    """The current champion's eval loss, or None without a champion: the exact ``eval/loss`` of
    the run it was registered from (the version's tag is rounded), else that tag."""
    mlflow_client = client(tracking.uri)
    try:
        version = mlflow_client.get_model_version_by_alias(name, CHAMPION)
    except Exception:  # no such alias (MLflow raises a RestException)
        return None
    if version.run_id:
        try:
            exact = mlflow_client.get_run(version.run_id).data.metrics.get("eval/loss")
        except Exception:  # the run was deleted: the tag still says it
            exact = None
        if exact is not None:
            return float(exact)
    value = version.tags.get(EVAL_LOSS_TAG)
    return float(value) if value is not None else None


def promote_if_better(
    tracking: TrackingContext, name: str, version: str, eval_loss: float
) -> tuple[bool, float | None]:
    """Move ``champion`` to ``version`` if its eval loss is lower; returns (moved, old loss)."""
    previous = champion_loss(tracking, name)
    better = not math.isnan(eval_loss) and (previous is None or eval_loss < previous)
    if better:
        client(tracking.uri).set_registered_model_alias(name, CHAMPION, version)
    return better, previous


def _summary_markdown(summary: dict[str, Any], metrics: dict[str, float]) -> str:
    lines = [
        f"# Run `{summary['run_id']}`",
        "",
        f"- run root: `{summary['run_root']}`",
        f"- final checkpoint: `{summary['checkpoint']}`",
        f"- Hugging Face export: `{summary['hf']}`",
        f"- model version: {summary.get('model_name', '-')} v{summary.get('model_version', '-')}"
        + (" (champion)" if summary.get("champion") else ""),
        "",
        "| metric | value |",
        "| --- | ---: |",
    ]
    lines += [f"| {k} | {v:.4f} |" for k, v in sorted(metrics.items())]
    return "\n".join(lines) + "\n"


def _prefect_artifacts(summary: dict[str, Any], metrics: dict[str, float], md: str) -> None:
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    create_markdown_artifact(md, key="run-summary", description="Pipeline run summary")
    create_table_artifact(
        [{"metric": k, "value": round(v, 6)} for k, v in sorted(metrics.items())],
        key="run-metrics",
        description="Final training and evaluation metrics",
    )
    where = {
        "run-root": ("Run root", summary["run_root"], "Checkpoints, config.toml, metrics, logs."),
        "hf-export": ("Hugging Face export", summary["hf"], "Weights, tokenizer, model card."),
    }
    for key, (title, url, what) in where.items():
        url = url if storage.is_url(url) else absolute(url)
        # A file:// or s3:// link opens nothing in a browser: say where it is and how to open it.
        create_markdown_artifact(
            location_markdown(title, url, what), key=key, description=f"{title}: {url}"
        )


def _mlflow_artifacts(tracking: TrackingContext, summary: dict[str, Any], md: str) -> None:
    with tempfile.TemporaryDirectory(prefix="titan-publish-") as tmp:
        files = {"summary.md": md, "summary.json": json.dumps(summary, indent=2)}
        config = storage.join(summary["run_root"], "config.toml")
        if storage.exists(config):
            files["config.toml"] = storage.read_text(config)
        for name, text in files.items():
            with open(os.path.join(tmp, name), "w") as f:
                f.write(redact(text))
        client(tracking.uri).log_artifacts(tracking.parent_run_id, tmp, "run")


@task(name="publish", cache_policy=NO_CACHE, retries=2, retry_condition_fn=retry_transient)
def publish(
    run_root: str,
    checkpoint_url: str,
    hf_url: str,
    evaluation: dict[str, Any],
    tracking: TrackingContext | None = None,
    registered_model: str = "",
) -> dict[str, Any]:
    """Register ``hf_url`` as a model version, move ``champion`` if it improved, summarise.

    Returns the summary (URLs, model name/version, whether it became the champion, metrics).
    """
    run_id = run_root.rstrip("/").rsplit("/", 1)[-1]
    metrics = {**final_train_metrics(run_root)}
    metrics |= {f"eval/{k}": float(v) for k, v in evaluation["metrics"].items()}
    name = (registered_model or tracking.experiment) if tracking is not None else ""
    from prefect.runtime import flow_run  # the recipe is the flow's parameter (retrain: none)

    recipe = str((flow_run.parameters or {}).get("recipe") or "")
    facts = export_facts(run_root, checkpoint_url, hf_url, evaluation, recipe, name)
    card = write_model_card(hf_url, facts)  # before registering: a server copies the folder
    summary: dict[str, Any] = {
        "run_id": run_id,
        "run_root": redact(run_root),
        "checkpoint": redact(checkpoint_url),
        "hf": redact(hf_url),
        "eval_report": redact(evaluation["report_url"]),
        "model_card": redact(card),
        "metrics": metrics,
    }
    if tracking is not None:
        eval_loss = float(evaluation["metrics"]["loss"])
        # Logged before the version: the champion rule reads the run's exact eval/loss.
        log_metrics(tracking, tracking.parent_run_id, metrics, step=int(evaluation["step"]))
        version = register_version(
            tracking,
            name,
            registrable_source(tracking, hf_url),
            {
                EVAL_LOSS_TAG: f"{eval_loss:.4g}",
                "run_root": redact(run_root),
                "step": str(evaluation["step"]),
            },
            description=redact(version_description(facts)),
        )
        moved, previous = promote_if_better(tracking, name, version, eval_loss)
        summary |= {"model_name": name, "model_version": version, "champion": moved}
        summary["previous_champion_loss"] = previous
    md = _summary_markdown(summary, metrics)
    if tracking is not None:
        _mlflow_artifacts(tracking, summary, md)
    _prefect_artifacts(summary, metrics, md)
    run_logger().info(
        "Published %s: %s",
        redact(hf_url),
        f"model {summary['model_name']} v{summary['model_version']}"
        + (" (new champion)" if summary["champion"] else " (champion unchanged)")
        if tracking is not None
        else "untracked",
    )
    return summary
