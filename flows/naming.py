"""Flow runs people can find: named after what they run, tagged with what they belong to.

Prefect names flow runs at random (``sassy-otter``); a pipeline knows its run id only once its
config is resolved, so it renames its own flow run then (``<experiment>/<run_id>``) and adds tags
(``experiment:<name>``, ``recipe:<name>``, ``model:<family>/<flavor>``) to filter by in the UI.
"""

from __future__ import annotations

from titan_core.config.job import JobConfig


def run_tags(cfg: JobConfig, recipe: str = "") -> list[str]:
    """The tags of a flow run of ``cfg``: experiment, recipe (when there is one) and model."""
    tags = [f"experiment:{cfg.job.experiment}"]
    if recipe:
        tags.append(f"recipe:{recipe}")
    return [*tags, f"model:{cfg.model.name}/{cfg.model.flavor}"]


def name_flow_run(name: str, tags: list[str]) -> None:
    """Rename the current flow run to ``name`` and add ``tags`` to its own (a deployment's tags
    stay); does nothing outside a flow run."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return
    flow_run = ctx.flow_run
    merged = list(dict.fromkeys([*flow_run.tags, *tags]))
    with get_client(sync_client=True) as client:
        client.update_flow_run(flow_run.id, name=name, tags=merged)
    # The context's copy too, so that later reads in this run (logs, runtime) agree.
    flow_run.name, flow_run.tags = name, merged
