"""Compare MLflow runs of one experiment: a summary table, the config keys that differ, loss curves.

Keys that differ between runs by construction (``run_specific``: paths into a run's own folder,
where it is recorded) are named once under the differences, not listed as differences. The
markdown is drawn for the Prefect UI's narrow artifact pane (``compare_view``).

``compare_experiment`` is plain MLflow (no orchestrator); the ``compare_runs`` task
(``tasks/compare.py``) wraps it and publishes the result as Prefect table and markdown artifacts.
The markdown embeds the loss-curve PNG as a ``data:`` URI, so it renders in the Prefect UI and
MLflow's artifact viewer.
Only when asked (``log``) or nested under a given run (``parent_run_id``, e.g. a sweep's) is the
comparison logged as an MLflow run (tag ``titan.stage=compare``, never compared itself):
``loss_curves.png``, ``comparison.md`` and ``comparison.json``; a plain ``titan compare`` leaves
the experiment as it was.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import re
import statistics
import tempfile
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from titan_core import storage
from titan_core.errors import ConfigError
from titan_core.pipeline.compare_view import render_markdown, short_names
from titan_core.pipeline.run.common import public_url
from titan_core.pipeline.run.paths import is_run_id
from titan_core.pipeline.run.report import markdown_image, mlflow_image
from titan_core.pipeline.run.tracking import STAGE_TAG, check_tracking, resolve_tracking_uri

# Metric names on MLflow (the train stage run and the pipeline run alike; the eval stage).
LOSS_KEY, TPS_KEY, MFU_KEY = "train/loss", "train/tps", "train/mfu_pct"
EVAL_LOSS_KEY, PERPLEXITY_KEY = "eval/loss", "eval/perplexity"  # the evaluate stage's
# Runs logged before the train/ prefix called the train stage's metrics by their bare names.
_LEGACY = {LOSS_KEY: "loss", TPS_KEY: "tps", MFU_KEY: "mfu_pct"}
COMPARE_STAGE = "compare"  # runs tagged titan.stage=compare are this module's own output
PARENT_TAG = "mlflow.parentRunId"
SWEEP_STAGE = "sweep"  # a sweep's parent run: compared as its trials
TRIAL_TAG, SWEEP_ID_TAG = "titan.trial", "titan.sweep_id"  # on a sweep's trial runs
SWEEP_BEST_TAG = "titan.sweep_best"  # "true" on the best trial of its sweep
RECORD_SECTIONS = ("tracking", "storage")
"""Config sections that say where a run is recorded and how it moves its files, not what it
trains: a sweep's trials and a plain run differ there by construction (the sweep registers into
a model of its own and turns progress bars off)."""
PLOT_NAME = "loss_curves.png"
# An evaluator's number (``[evaluators]``: in the loop, then the evaluate stage); not its timing.
EVALUATOR_KEY = re.compile(r"eval/[^/]+/(?!seconds$)[^/]+")
EVALUATOR_METRIC_ORDER = ("loss", "perplexity", "acc", "acc_per_token", "acc_per_char")
EVALUATOR_METRIC_ORDER += ("bits_per_byte",)


@dataclass
class RunSummary:
    """One compared run: headline numbers, merged params and its loss curve."""

    run_id: str
    name: str
    status: str
    final_loss: float | None = None
    eval_loss: float | None = None
    eval_perplexity: float | None = None
    tokens_per_s: float | None = None
    mfu_pct: float | None = None
    steps: int | None = None
    params: dict[str, str] = field(default_factory=dict)
    loss_curve: list[tuple[int, float]] = field(default_factory=list)
    evals: dict[str, float] = field(default_factory=dict)
    """The evaluators' final numbers, ``eval/<name>/<metric>`` (their timings aside)."""

    def row(self) -> dict[str, Any]:
        """The table row (no params, no curve)."""
        return {
            "run": self.name,
            "run_id": self.run_id,
            "status": self.status,
            "steps": self.steps,
            "final_loss": self.final_loss,
            "eval_loss": self.eval_loss,
            "eval_perplexity": self.eval_perplexity,
            "tokens_per_s": self.tokens_per_s,
            "mfu_pct": self.mfu_pct,
            "evals": dict(self.evals),
        }


@dataclass(frozen=True)
class Comparison:
    """The result of a comparison, as returned by the task and the flow."""

    experiment: str
    """The compared runs' MLflow experiment."""
    tracking_uri: str
    """Where they were read from."""
    runs: list[dict[str, Any]]
    """One table row per run (``RunSummary.row``), in the order compared."""
    differing_params: dict[str, dict[str, str | None]]
    """The config keys whose values differ, the ``run_specific`` ones left out:
    {key: {run_id: value or None}}."""
    compare_run_id: str
    """The MLflow run the comparison was logged to; "" when it was not logged."""
    plot_uri: str
    """The logged PNG's artifact URL (the server's download route over HTTP); "" unlogged."""
    markdown: str
    """The comparison with the loss curves embedded (a ``data:`` URI)."""
    table_markdown: str = ""
    """The same without the image."""
    run_specific_keys: list[str] = field(default_factory=list)
    """The config keys that differ by construction (``run_specific``), not in differing_params."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data."""
        return asdict(self)


def compare_target(
    recipe: str, config_file: str, values: Mapping[str, Any], experiment: str = ""
) -> tuple[str, str]:
    """``(experiment, tracking URI)`` of the config ``resolve_job`` resolves from the layers:
    ``experiment`` or its job.experiment, and ``resolve_tracking_uri`` (the store a pipeline run
    of the same config records in); one-line ``ConfigError`` for a bad recipe, key or value."""
    from titan_core.resolve import resolve_job

    cfg = resolve_job(recipe, config_file, values)
    return experiment or cfg.job.experiment, resolve_tracking_uri(cfg)


def _steady(values: list[float]) -> float | None:
    """Median of a rate's logged values, leaving out the first (warm-up) when there are more."""
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) > 1:
        finite = finite[1:]
    return statistics.median(finite) if finite else None


def _metric_owners(client: Any, run: Any) -> list[Any]:
    """The run followed by its nested (stage) runs: metrics may live on either."""
    children = client.search_runs(
        [run.info.experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{run.info.run_id}'"
    )
    return [run, *sorted(children, key=lambda r: r.info.start_time or 0)]


def _longest_history(client: Any, owners: list[Any], key: str) -> list[tuple[int, float]]:
    """``key``'s per-step values from the owner that logged most of them (the train stage run
    has every step; the pipeline run only the final value), step-ordered; legacy name too."""
    best: list[tuple[int, float]] = []
    for name in (key, _LEGACY.get(key)):
        for owner in owners:
            if name and name in owner.data.metrics:
                history = client.get_metric_history(owner.info.run_id, name)
                curve = sorted({m.step: m.value for m in history}.items())
                best = curve if len(curve) > len(best) else best
        if best:
            return best
    return best


def display_name(run: Any) -> str:
    """A run's name in the table: a sweep's trial as ``sweep-<id>/<trial>`` (``(best)`` on the
    sweep's choice), other runs by their name."""
    tags = run.data.tags
    if TRIAL_TAG in tags:
        best = " (best)" if tags.get(SWEEP_BEST_TAG) == "true" else ""
        return f"sweep-{tags.get(SWEEP_ID_TAG, '?')}/{tags[TRIAL_TAG]}{best}"
    return run.info.run_name or run.info.run_id


def summarize_run(client: Any, run: Any) -> RunSummary:
    """Collect one run's final loss, eval loss and perplexity, throughput, MFU, params and loss
    curve."""
    summary = RunSummary(run_id=run.info.run_id, name=display_name(run), status=run.info.status)
    owners = _metric_owners(client, run)
    for owner in reversed(owners):  # the parent's params win over a stage's
        summary.params.update(owner.data.params)
    if curve := _longest_history(client, owners, LOSS_KEY):
        summary.loss_curve = curve
        summary.final_loss, summary.steps = curve[-1][1], curve[-1][0]
    for attr, key in (("tokens_per_s", TPS_KEY), ("mfu_pct", MFU_KEY)):
        if rates := _longest_history(client, owners, key):
            setattr(summary, attr, _steady([v for _, v in rates]))
    for attr, key in (("eval_loss", EVAL_LOSS_KEY), ("eval_perplexity", PERPLEXITY_KEY)):
        found = [owner.data.metrics[key] for owner in owners if key in owner.data.metrics]
        setattr(summary, attr, found[0] if found else None)
    for owner in reversed(owners):  # the run's own (published) values win over a stage's
        summary.evals.update(
            (k, v) for k, v in owner.data.metrics.items() if EVALUATOR_KEY.fullmatch(k)
        )
    summary.evals = dict(sorted(summary.evals.items(), key=lambda kv: evaluator_order(kv[0])))
    return summary


def evaluator_order(key: str) -> tuple[str, int, str]:
    """Sort key of ``eval/<name>/<metric>``: by evaluator, then its metrics as docs list them."""
    _, name, metric = key.split("/")
    known = EVALUATOR_METRIC_ORDER
    return name, known.index(metric) if metric in known else len(known), metric


def differing_params(runs: list[RunSummary]) -> dict[str, dict[str, str | None]]:
    """Config keys whose value is not the same in every run that logged its config:
    {key: {run_id: value or None}}. A run that ended before logging it (refused by preflight)
    has no params: it is shown without values, and makes no key differ."""
    logged = [r for r in runs if r.params]
    keys = sorted(set().union(*(r.params for r in logged)))
    out = {}
    for key in keys:
        if len({r.params.get(key) for r in logged}) > 1:
            out[key] = {r.run_id: r.params.get(key) for r in runs}
    return out


def _without_run_ids(value: str | None) -> str | None:
    """``value`` with each pipeline run id in it (``new_run_id``'s form, a trial's ``…-t<N>``;
    e.g. the ``<run_id>`` of a path ``<root>/<experiment>/<run_id>/…``) written ``<run>``."""
    if value is None:
        return None
    parts = re.split(r"([/\\\s,;:=@'\"]+)", value)
    return "".join("<run>" if is_run_id(part) else part for part in parts)


def run_specific(key: str, values: Mapping[str, str | None]) -> bool:
    """Whether config ``key`` differs between runs by construction rather than by what they
    train: a key of a ``RECORD_SECTIONS`` section, or one whose ``values`` (of the runs that
    logged their config) are all the same once the run ids in them are masked (paths into each
    run's own folder: ``job.dump_folder``, ``tokenizer.path``, a seed checkpoint's
    ``checkpoint.initial_load_path``)."""
    if key.split(".", 1)[0] in RECORD_SECTIONS:
        return True
    return len({_without_run_ids(v) for v in values.values()}) == 1


def split_run_specific(
    diff: dict[str, dict[str, str | None]], runs: list[RunSummary]
) -> tuple[dict[str, dict[str, str | None]], list[str]]:
    """``diff`` (``differing_params`` of ``runs``) without its ``run_specific`` keys, and those
    keys; a run that logged no config has no say."""
    logged = {r.run_id for r in runs if r.params}
    left_out = [
        key
        for key, values in diff.items()
        if run_specific(key, {run: v for run, v in values.items() if run in logged})
    ]
    return {k: v for k, v in diff.items() if k not in left_out}, left_out


def _sqlite_file(uri: str) -> str | None:
    """The database file of a local SQLite store URI (absolute), None for other stores."""
    if not uri.startswith("sqlite:///"):
        return None
    return os.path.abspath(uri.removeprefix("sqlite:///"))


def _experiments(uri: str) -> list[str]:
    """The experiments a store holds that a pipeline made (MLflow's empty ``Default`` left out);
    none when it cannot be read."""
    from mlflow import MlflowClient

    try:
        found = MlflowClient(tracking_uri=uri).search_experiments()
    except Exception:  # another tool's file, an older schema: only a hint is lost
        return []
    return sorted(e.name for e in found if e.name != "Default")


def no_experiment(experiment: str, uri: str, names: list[str] | None = None) -> ConfigError:
    """The one-line error for a store without ``experiment``: names the store looked in and what
    would read the runs that exist: the store's other experiments (``names``), or for a local
    SQLite store that is missing, the ``mlflow.db`` files under ``./outputs`` (per-recipe roots)
    with their experiments, as the command that compares them."""
    message = f"job.experiment: no MLflow experiment named {experiment!r} in {public_url(uri)}"
    if names:
        hint = " / ".join(f"titan compare --experiment {n}" for n in names[:3])
        return ConfigError(f"{message}; it has {', '.join(map(repr, names))} ({hint})")
    looked = _sqlite_file(uri)
    if looked is None:
        return ConfigError(message)
    found = sorted(glob.glob(os.path.join("outputs", "mlflow.db")))
    found += sorted(glob.glob(os.path.join("outputs", "*", "mlflow.db")))
    others = [path for path in found if os.path.abspath(path) != looked]
    if others:
        shown = []
        for path in others:
            names = _experiments(f"sqlite:///{os.path.abspath(path)}")
            command = f"titan compare --tracking.uri sqlite:///{path}"
            also = f", also {', '.join(names[1:])}" if len(names) > 1 else ""
            shown.append(f"{path} ({command} --experiment {names[0]}{also})" if names else path)
        message += f"; other stores: {', '.join(shown)}"
    return ConfigError(message)


def open_experiment(experiment: str, uri: str) -> tuple[Any, str]:
    """An ``MlflowClient`` of the store at ``uri`` and the id of ``experiment`` in it; one line
    when the store does not answer or has no such experiment (a missing SQLite file is not
    created: comparing only reads)."""
    from mlflow import MlflowClient

    looked = _sqlite_file(uri)
    if looked is not None and not os.path.isfile(looked):
        raise no_experiment(experiment, uri)
    check_tracking(uri)
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise no_experiment(experiment, uri, _experiments(uri))
    return client, exp.experiment_id


def select_runs(
    client: Any, experiment_id: str, experiment: str, run_ids: list[str], max_runs: int
) -> list[Any]:
    """The chosen runs (ids or names, in that order), else the newest top-level runs; a sweep
    stands for its trials."""
    runs = client.search_runs([experiment_id], order_by=["attributes.start_time DESC"])
    runs = [r for r in runs if r.data.tags.get(STAGE_TAG) != COMPARE_STAGE]
    top = [r for r in runs if PARENT_TAG not in r.data.tags]
    if run_ids:
        # Any run by id; by name only top-level runs (stage runs are all called train, ...).
        names = {r.info.run_name: r for r in reversed(top) if r.info.run_name}
        by_key = {r.info.run_id: r for r in runs} | names
        missing = [k for k in run_ids if k not in by_key]
        if missing:
            raise ConfigError(
                f"compare.runs: no run {', '.join(missing)} in experiment {experiment!r} "
                "(expected run ids or run names)"
            )
        return [t for k in run_ids for t in _as_trials(by_key[k], runs)]
    if not top:
        raise ConfigError(f"job.experiment: experiment {experiment!r} has no runs")
    # Oldest first reads naturally in tables and legends.
    return [t for run in reversed(top[:max_runs]) for t in _as_trials(run, runs)]


def _as_trials(run: Any, runs: list[Any]) -> list[Any]:
    """A sweep's run as its trials' runs (its own numbers are theirs), in trial order (then
    the order they started); any other run as itself."""
    if run.data.tags.get(STAGE_TAG) != SWEEP_STAGE:
        return [run]

    def order(trial: Any) -> tuple[float, int]:
        index = re.match(r"trial-(\d+)\b", trial.data.tags.get(TRIAL_TAG, ""))
        return (int(index.group(1)) if index else math.inf, trial.info.start_time or 0)

    trials = [r for r in runs if r.data.tags.get(PARENT_TAG) == run.info.run_id]
    return sorted(trials, key=order) or [run]


def plot_loss_curves(runs: list[RunSummary], path: str, title: str) -> str:
    """Write a PNG of every run's loss curve (matplotlib, Agg backend); returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    try:
        for run in runs:
            if run.loss_curve:
                steps, losses = zip(*run.loss_curve)
                ax.plot(steps, losses, marker=".", label=f"{run.name} ({run.run_id[:8]})")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if any(r.loss_curve for r in runs):
            ax.legend(fontsize="small")
        fig.tight_layout()
        with storage.output_path(path) as tmp:
            fig.savefig(tmp, format="png")
    finally:
        plt.close(fig)
    return path


def artifact_url(tracking_uri: str, run: Any, name: str) -> str:
    """A URL for a run's artifact: the server's download route over HTTP, else its URI."""
    if tracking_uri.startswith(("http://", "https://")):
        query = urllib.parse.urlencode({"path": name, "run_uuid": run.info.run_id})
        return f"{public_url(tracking_uri).rstrip('/')}/get-artifact?{query}"
    return f"{run.info.artifact_uri.rstrip('/')}/{name}"


def _log_comparison(
    client: Any,
    experiment_id: str,
    result: Comparison,
    runs: list[RunSummary],
    png: str,
    parent_run_id: str,
) -> tuple[str, str]:
    """Log the comparison as a ``compare-<time>`` run (nested under ``parent_run_id`` when
    given): PNG, markdown, JSON. Returns (its run id, the PNG's artifact URL)."""
    tags = {STAGE_TAG: COMPARE_STAGE, "titan.compared_runs": ",".join(r.run_id for r in runs)}
    if parent_run_id:
        tags[PARENT_TAG] = parent_run_id
    record = client.create_run(
        experiment_id, run_name=f"compare-{time.strftime('%Y%m%d-%H%M%S')}", tags=tags
    )
    try:
        plot_uri = artifact_url(result.tracking_uri, record, PLOT_NAME)
        logged = dataclasses.replace(result, compare_run_id=record.info.run_id, plot_uri=plot_uri)
        folder = os.path.dirname(png)
        image = mlflow_image("loss curves", record.info.run_id, PLOT_NAME, result.tracking_uri)
        markdown = render_markdown(
            result.experiment, result.runs, result.differing_params, image, result.run_specific_keys
        )
        storage.write_text(os.path.join(folder, "comparison.md"), markdown)  # as MLflow shows it
        document = {k: v for k, v in logged.to_dict().items() if k != "markdown"}
        storage.write_text(os.path.join(folder, "comparison.json"), json.dumps(document, indent=2))
        for name in (PLOT_NAME, "comparison.md", "comparison.json"):
            client.log_artifact(record.info.run_id, os.path.join(folder, name))
        client.set_terminated(record.info.run_id, "FINISHED")
    except BaseException:
        client.set_terminated(record.info.run_id, "FAILED")
        raise
    return record.info.run_id, plot_uri


def compare_experiment(
    experiment: str,
    run_ids: list[str] | None,
    tracking_uri: str,
    max_runs: int = 10,
    *,
    log: bool = False,
    parent_run_id: str = "",
) -> Comparison:
    """Compare runs of ``experiment`` in the store at ``tracking_uri`` (``compare_target`` says
    which); the markdown embeds the loss-curve PNG.

    ``log`` records the comparison as an MLflow run of the experiment; ``parent_run_id`` does
    too, nested under that run.
    """
    if max_runs < 1:
        raise ConfigError(f"compare.max_runs: expected an int >= 1, got {max_runs}")
    client, experiment_id = open_experiment(experiment, tracking_uri)
    chosen = select_runs(client, experiment_id, experiment, list(run_ids or []), max_runs)
    runs = [summarize_run(client, r) for r in chosen]
    diff, left_out = split_run_specific(differing_params(runs), runs)
    rows = [r.row() for r in runs]
    group, names = short_names([r.name for r in runs])  # the legend as the tables name them
    curves = [dataclasses.replace(r, name=name) for r, name in zip(runs, names, strict=True)]
    title = f"{experiment}: training loss" + (f" ({group})" if group else "")
    with tempfile.TemporaryDirectory(prefix="titan-compare-") as tmp:
        png = plot_loss_curves(curves, os.path.join(tmp, PLOT_NAME), title)
        result = Comparison(
            experiment=experiment,
            tracking_uri=public_url(tracking_uri),  # shown and stored: no credentials
            runs=rows,
            differing_params=diff,
            compare_run_id="",
            plot_uri="",
            markdown=render_markdown(
                experiment, rows, diff, markdown_image("loss curves", png), left_out
            ),
            table_markdown=render_markdown(experiment, rows, diff, "", left_out),
            run_specific_keys=left_out,
        )
        if log or parent_run_id:
            run_id, plot_uri = _log_comparison(
                client, experiment_id, result, runs, png, parent_run_id
            )
            result = dataclasses.replace(result, compare_run_id=run_id, plot_uri=plot_uri)
    return result
