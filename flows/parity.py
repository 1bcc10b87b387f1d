"""The ``parallelism_parity`` flow: the torchtitan reproducibility recipe, automated.

One seed checkpoint, several parallel layouts (overrides + process count) trained N steps each
from it on identical samples; every layout's per-step loss must match the first layout's within
``rtol``. The comparison is published as a Prefect table artifact either way; the flow fails
when any layout is out of tolerance.
"""

from __future__ import annotations

import tempfile
from typing import Any

from prefect import flow
from prefect.artifacts import create_table_artifact

from tasks.parity import train_layout, write_seed_checkpoint
from titan_core.pipeline.parity import common_args, parity_rows, plan_layouts

# The tiny debug Llama of the parity tests: 4 layers split across up to 2 pipeline stages x 2.
DEFAULT_BASE = ["--module", "llama3", "--config", "llama3_debugmodel_tiny", "--model.n_layers", "4"]
DEFAULT_LAYOUTS: list[dict[str, Any]] = [
    {"name": "single", "nproc": 1, "overrides": []},
    {"name": "fsdp2", "nproc": 2, "overrides": ["--parallelism.data_parallel_shard_degree", "2"]},
]


class ParityError(AssertionError):
    """A layout's losses left the tolerance of the reference layout."""


@flow(name="parallelism-parity", log_prints=True)
def parallelism_parity(
    layouts: list[dict[str, Any]] | None = None,
    base: list[str] | None = None,
    steps: int = 10,
    global_batch: int = 4,
    seq_len: int = 32,
    rtol: float = 1e-5,
    output: str = "",
) -> list[dict[str, Any]]:
    """Train every layout from one seed checkpoint; assert per-step loss parity with the first.

    ``layouts``: ``[{"name", "nproc", "overrides": [--section.key, value, ...]}]``, the first
    being the reference (default: one process vs FSDP on 2). ``base``: config arguments shared
    by all (default: the tiny debug Llama). Returns the table rows.
    """
    base = list(DEFAULT_BASE if base is None else base)
    shared = [*base, *common_args(steps, seq_len, global_batch)]
    planned = plan_layouts(shared, layouts or DEFAULT_LAYOUTS, global_batch)
    output = output or tempfile.mkdtemp(prefix="titan-parity-")
    seed = write_seed_checkpoint(base, output, seq_len)
    losses = []
    for layout in planned:
        batch = ["--training.local_batch_size", str(global_batch // layout.dp)]
        args = [*shared, *batch, *layout.overrides]
        losses.append(train_layout(layout.name, layout.nproc, args, seed, output, steps))
    rows = parity_rows(planned, losses, rtol)
    create_table_artifact(
        key="parallelism-parity",
        table=rows,
        description=f"{steps}-step loss parity against {planned[0].name!r} (rtol {rtol:g})",
    )
    for row in rows:
        print(
            f"{row['layout']:>12}  nproc {row['nproc']}  dp {row['dp']}  "
            f"final loss {row['final_loss']:.6f}  max rel diff {row['max_rel_diff']:.2e}  "
            f"{'ok' if row['ok'] else 'FAIL'}"
        )
    failed = [r["layout"] for r in rows if not r["ok"]]
    if failed:
        raise ParityError(f"loss parity broken (rtol {rtol:g}) for layouts: {', '.join(failed)}")
    return rows
