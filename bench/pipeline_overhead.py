"""Pipeline overhead: the demo pipeline's wall time against the sum of its stage times.

    .venv/bin/python bench/pipeline_overhead.py [--steps N] [--storage DIR] [overrides ...]

Prefect starts first (a warm-up flow brings up the temporary local server), then the demo
pipeline (``pretrain_pipeline`` on the debug model, as ``make demo`` runs it) is timed from the
call to its return. The stages' own durations come from Prefect's task runs of that same flow
run; overhead = wall - sum(stages), i.e. what orchestration, tracking set-up between stages and
result handling cost. Goal: overhead <= 10% of the wall time.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `flows` from a checkout

from _common import add_quick, final_line

GOAL = 0.10
QUICK = [
    "--model.flavor", "debugmodel_tiny", "--launch.nproc_per_node", "1", "--evaluate.batches", "1",
    "--validation.steps", "1",
]  # fmt: skip


def _stage_times(flow_run_id: object) -> list[tuple[str, float]]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    runs.sort(key=lambda r: r.start_time or r.expected_start_time)
    return [
        (r.name.rsplit("-", 1)[0], (r.end_time - r.start_time).total_seconds())
        for r in runs
        if r.start_time and r.end_time
    ]


def main() -> int:
    """Run the demo pipeline once and print its stage times and overhead."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=0, help="training steps (default: recipe)")
    parser.add_argument("--storage", default="", help="run root (default: a temporary folder)")
    add_quick(parser)
    ns, overrides = parser.parse_known_args()
    if ns.quick:  # the tiny model, 2 steps, 1 evaluation batch, one process
        ns.steps = 2
        overrides = [*QUICK, *overrides]
    storage = ns.storage or tempfile.mkdtemp(prefix="titan-bench-")
    if ns.quick and not ns.storage:
        # Registered before Prefect's own exit hooks, so it runs after its server has stopped.
        atexit.register(shutil.rmtree, storage, ignore_errors=True)
    os.environ.setdefault("PREFECT_HOME", os.path.join(storage, ".prefect"))
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from titan_core.cli.pipeline import prepare_prefect_env

    prepare_prefect_env()
    from prefect import flow

    from flows.pipeline import pretrain_pipeline
    from titan_core.cli.demo import DEMO_OVERRIDES, DEMO_RECIPE
    from titan_core.config.argv import cli_values

    @flow(name="warm-up")
    def warm_up() -> None:
        """Bring up Prefect's temporary server before the timed run."""

    start = time.perf_counter()
    warm_up()
    startup = time.perf_counter() - start
    steps = ["--training.steps", str(ns.steps)] if ns.steps else []
    start = time.perf_counter()
    argv = [*DEMO_OVERRIDES, *steps, "--storage.no_progress", *overrides]
    state = pretrain_pipeline(
        recipe=DEMO_RECIPE,
        overrides=cli_values(argv) | {"job.dump_folder": storage},
        return_state=True,
    )
    wall = time.perf_counter() - start
    if not state.is_completed():
        print(f"pipeline failed: {state.message}", file=sys.stderr)
        return 1
    stages = _stage_times(state.state_details.flow_run_id)
    total = sum(seconds for _, seconds in stages)
    print(f"\nPrefect start-up (excluded): {startup:.1f}s; storage: {storage}")
    print(f"{'stage':<24}{'seconds':>10}{'share':>9}")
    for name, seconds in stages:
        print(f"{name:<24}{seconds:>10.2f}{100 * seconds / wall:>8.1f}%")
    overhead = wall - total
    verdict = "meets" if overhead <= GOAL * wall else "MISSES"
    print(f"{'sum of stages':<24}{total:>10.2f}{100 * total / wall:>8.1f}%")
    print(f"{'pipeline wall time':<24}{wall:>10.2f}")
    print(f"overhead: {overhead:.2f}s ({verdict} the goal)")
    final_line("overhead / pipeline wall time", f"{overhead / wall:.1%}", f"<= {GOAL:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
