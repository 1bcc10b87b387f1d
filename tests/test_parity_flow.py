"""The ``parallelism_parity`` flow: one seed, several layouts, loss parity asserted and tabled."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flows.parity import ParityError, parallelism_parity
from titan_core.errors import ConfigError

pytestmark = pytest.mark.multiprocess


def _table(flow_run_id: Any) -> list[dict[str, Any]]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterId,
    )

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["parallelism-parity"])),
        )
    assert len(artifacts) == 1 and artifacts[0].type == "table"
    return json.loads(artifacts[0].data)


def test_parity_flow_passes_fsdp_and_flags_a_changed_config(
    prefect_harness: Path, assets: Path, tmp_path: Path
) -> None:
    layouts = [
        {"name": "single", "nproc": 1, "overrides": []},
        {
            "name": "fsdp2",
            "nproc": 2,
            "overrides": ["--parallelism.data_parallel_shard_degree", "2"],
        },
        # Not a parallel layout at all: a different learning rate must break parity.
        {"name": "other-lr", "nproc": 1, "overrides": ["--optimizer.lr", "1e-2"]},
    ]
    state = parallelism_parity(layouts=layouts, steps=3, output=str(tmp_path), return_state=True)
    assert state.is_failed()
    with pytest.raises(ParityError, match=r"layouts: other-lr$"):
        state.result()
    rows = {row["layout"]: row for row in _table(state.state_details.flow_run_id)}
    assert [rows[n]["ok"] for n in ("single", "fsdp2", "other-lr")] == [True, True, False]
    assert rows["fsdp2"]["dp"] == 2 and rows["fsdp2"]["max_rel_diff"] <= 1e-5
    assert rows["other-lr"]["max_rel_diff"] > 1e-3
    # Every layout started from the one seed checkpoint.
    assert (tmp_path / "seed" / "checkpoint" / "seed" / ".metadata").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fsdp2", "other-lr", "seed", "single"]


def test_parity_flow_rejects_bad_layouts_before_running(
    prefect_harness: Path, tmp_path: Path
) -> None:
    out = tmp_path / "never"
    bad = [{"name": "single", "nproc": 1}, {"name": "dp3", "nproc": 3}]
    state = parallelism_parity(layouts=bad, output=str(out), return_state=True)
    with pytest.raises(ConfigError, match=r"^parity\.global_batch: 4 is not divisible .* 3"):
        state.result()
    with pytest.raises(ConfigError, match=r"^parity\.layouts\[1\]"):
        parallelism_parity(layouts=[{"name": "a"}, {"nproc": 0}], output=str(out))
    assert not out.exists()
