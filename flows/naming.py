"""Flow runs people can find: named after what they run, tagged with what they belong to.

Prefect names flow runs at random (``sassy-otter``). A pipeline's flow run starts named after its
run id (``run_id_name``); once its config is resolved it renames itself ``<experiment>/<run_id>``
and adds tags (``experiment:<name>``, ``recipe:<name>``, ``model:<family>/<flavor>``) to filter
by in the UI.
"""

from __future__ import annotations

import re

from titan_core.config.job import JobConfig
from titan_core.pipeline.storage import new_run_id

# new_run_id's form (a sweep's trials add -t<N>), as carried by a flow run's first name.
_RUN_ID_RE = re.compile(r"\d{8}-\d{6}-[0-9a-f]{6}(-t\d+)?")


def run_id_name() -> str:
    """Prefect ``flow_run_name``: the flow run starts named after its run id (the ``run_id``
    parameter, else a new id), so even its first log lines ("Beginning flow run ...") name
    something findable; ``current_run_id`` reads the id back in the flow."""
    from prefect.runtime import flow_run

    return str(flow_run.parameters.get("run_id") or "") or new_run_id()


def current_run_id(given: str = "") -> str:
    """The run id of this flow run: ``given``, else the one its name carries (``run_id_name``),
    else a new one (outside a flow run, or a name set by hand)."""
    if given:
        return given
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    name = ctx.flow_run.name if ctx is not None and ctx.flow_run is not None else ""
    return name if _RUN_ID_RE.fullmatch(name or "") else new_run_id()


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
