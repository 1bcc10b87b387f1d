"""``retrain``: continue a model line from its newest checkpoint, evaluate, promote if better.

A model line is ``<job.dump_folder>/<experiment>/``: every run of the experiment. The newest
complete checkpoint among them (by commit time) seeds a new run that trains ``steps`` more
steps with the previous run's config (plus any overrides, e.g. new data), is exported and
evaluated, and becomes a new model version; the ``champion`` alias moves to it only when its
``tracking.champion_metric`` (default the eval loss; e.g. ``eval/<task>/acc`` of an evaluator)
beats the champion's.

With ``data.sources`` the run prepares them first (``prepare_data``: only files that arrived since
are tokenized) and trains on the prepared dataset; when it grew since the checkpoint's run, the
new run starts a fresh pass over all of it instead of the old pass's data position.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.pipeline import prepare_stage, run_tracked, train_and_publish
from tasks.preflight import preflight
from tasks.runs import find_latest_checkpoint, prepare_storage
from tasks.runtime import current_run_id, load_secret, name_flow_run, run_id_name
from titan_core.config.form import NO_VALUES, ConfigParameter, ValuesParameter, flow_values
from titan_core.pipeline.run.config import DEFAULT_RECIPE, flow_run_tags, run_config
from titan_core.pipeline.run.paths import RunPaths, absolute
from titan_core.pipeline.run.tracking import TrackingContext
from titan_core.pipeline.run.transfer import configure_credentials
from titan_core.pipeline.stages.data import dataset_grew, train_on
from titan_core.pipeline.stages.model_line import continued_config, reresolve_autos
from titan_core.resolve import resolve_job


# Parameters are checked by flow_values/resolve_job (one-line errors), as in pretrain_pipeline.
@flow(name="retrain", flow_run_name=run_id_name, validate_parameters=False)
def retrain(
    steps: int = 100,
    recipe: str = DEFAULT_RECIPE,
    experiment: str = "",
    config: ConfigParameter = NO_VALUES,
    overrides: ValuesParameter = NO_VALUES,
    config_file: str = "",
    parent_run_id: str = "",
) -> dict[str, Any]:
    """Train ``steps`` more steps from the newest checkpoint of ``experiment``'s model line.

    The line is found as ``pretrain_pipeline`` with the same ``recipe``, ``config`` and
    ``overrides`` wrote it: ``<job.dump_folder>/<job.experiment>/``. The previous run's
    ``config.toml`` is the base config of the new run (``config_file`` replaces it); the fields
    set in ``config``, then ``overrides``, apply on top. Returns the new run's summary
    (``champion`` says whether the alias moved to its model version).

    Args:
        steps: Steps to train past the newest checkpoint.
        recipe: Registry recipe the line was started with (e.g. llama3_debugmodel): its output
            root (and so its default MLflow store) and experiment locate the line; its other
            settings are not used (those are the previous run's); the default is
            pretrain_pipeline's, so both default to the same line; empty: the defaults' root,
            ./outputs.
        experiment: Model line to continue (`<job.dump_folder>/<experiment>/`); empty uses
            job.experiment of the config.
        config: Settings changed for the new run, section by section (job.dump_folder, the
            output root, and tracking.uri also say where the model line lives, over the
            recipe's); empty fields keep the previous run's values.
        overrides: Dotted config keys to values, applied last, e.g. {"data.sources": [...]}.
        config_file: TOML job config replacing the previous run's config.toml as the base (the
            output root still comes from the recipe, config or overrides).
        parent_run_id: MLflow run to nest this run under.
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        from titan_core.errors import ConfigError

        raise ConfigError(f"retrain: steps: expected an int >= 1, got {steps!r}")
    values = flow_values(config, overrides)
    # The line's root comes from the recipe and the user's values, as pretrain_pipeline's did,
    # never from a saved config.toml: there job.dump_folder is that run's own folder.
    base = resolve_job(recipe, "", values)
    root = absolute(base.job.dump_folder)
    line = experiment or base.job.experiment
    configure_credentials(base.storage.credentials_block, load_secret)
    latest = find_latest_checkpoint(root, line)
    previous = resolve_job("", latest.config_url)
    cfg = resolve_job(
        "",
        config_file or latest.config_url,
        {**values, "job.dump_folder": root, "job.experiment": line},
    )
    cfg = reresolve_autos(cfg, values)
    paths = RunPaths(root, line, current_run_id())
    name_flow_run(f"{line}/{paths.run_id}", [*flow_run_tags(cfg, recipe), "retrain"])

    def body(tracking: TrackingContext | None) -> dict[str, Any]:
        """The stages inside the parent MLflow run."""
        prepare_storage(paths, cfg.storage.credentials_block)
        prepared = prepare_stage(cfg, paths, cfg.tokenizer.path)
        job = run_config(cfg, paths, cfg.tokenizer.path)
        if prepared is not None:
            job = train_on(job, prepared)
        grew = prepared is not None and dataset_grew(latest.run_root, prepared)
        job = continued_config(job, latest, previous, steps, new_data=grew)
        checked = preflight(job, paths.config)
        result = train_and_publish(checked, paths, tracking, seed_url="")
        extra = (prepared.summary() | {"dataset_grew": grew}) if prepared else {}
        return result | {"continued_from": latest.step_dir, **extra}

    return run_tracked(cfg, paths, body, parent_run_id)
