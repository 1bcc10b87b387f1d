"""The ``compare`` flow: MLflow runs of one experiment side by side (``titan compare`` runs it).

The experiment and the MLflow store come from the config, resolved as ``pretrain_pipeline``
resolves it (recipe < config file < ``config`` < ``overrides``): ``job.experiment``, and
``tracking.uri``, else ``MLFLOW_TRACKING_URI``, else ``<job.dump_folder>/mlflow.db``
(``titan_core.pipeline.run.tracking.resolve_tracking_uri``). So ``compare`` with the recipe and
settings a pipeline ran with finds its runs with nothing else to say.

The comparison (final train loss, eval loss and perplexity, tokens/s, MFU, the config keys that
differ, the loss curves embedded) is shown as table and markdown artifacts of the flow run; the
markdown fits the Prefect UI's artifact pane (``titan_core.pipeline.compare_view``). It is
logged to MLflow only when asked: ``log`` records a ``compare-*`` run in the experiment,
``parent_run_id`` nests that run under another (e.g. a sweep's), so comparing does not clutter
the experiment by default.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefect import flow

from tasks.compare import compare_runs
from tasks.runtime import name_flow_run
from titan_core.config.form import NO_VALUES, ConfigParameter, ValuesParameter, flow_values
from titan_core.pipeline.compare import Comparison, compare_target
from titan_core.pipeline.run.config import DEFAULT_RECIPE


# Parameters are checked by flow_values/resolve_job (one-line errors), as in pretrain_pipeline.
@flow(name="compare", log_prints=True, validate_parameters=False)
def compare(
    recipe: str = DEFAULT_RECIPE,
    experiment: str = "",
    config: ConfigParameter = NO_VALUES,
    overrides: ValuesParameter = NO_VALUES,
    config_file: str = "",
    runs: Sequence[str] = (),
    max_runs: int = 10,
    log: bool = False,
    parent_run_id: str = "",
) -> Comparison:
    """Compare runs of an experiment (chosen ids/names, else the newest ``max_runs``).

    Args:
        recipe: Registry recipe the runs were trained from (e.g. llama3_debugmodel): its output
            root and experiment say where they are tracked; the default is pretrain_pipeline's,
            so both default to the same store; empty starts from the defaults.
        experiment: MLflow experiment to compare; empty uses job.experiment of the config.
        config: Settings the runs were trained with, section by section; job.experiment,
            tracking.uri and job.dump_folder (whose mlflow.db is the default store) are read.
        overrides: Dotted config keys to values, applied last, e.g. {"tracking.uri": "..."}.
        config_file: TOML job config applied onto the recipe.
        runs: Run ids or run names to compare, in this order; empty: the newest top-level runs.
        max_runs: How many of the newest runs when no runs are named.
        log: Also record the comparison as an MLflow run of the experiment (tag
            titan.stage=compare).
        parent_run_id: Record it nested under this MLflow run instead (implies log).
    """
    values = flow_values(config, overrides)
    name, uri = compare_target(recipe, config_file, values, experiment)
    name_flow_run(f"compare/{name}", [f"experiment:{name}", "compare"])  # found in the UI
    return compare_runs(name, runs, uri, max_runs, log, parent_run_id)
