"""Every benchmark in ``bench/`` runs end to end in its quick mode and ends in one format.

The quick mode (tiny sizes, one round) only proves that a benchmark still runs: its figures mean
nothing and nothing here times anything. What is checked is what a reader of a full run relies on:
exit 0, a table, and a last line ``<what>: <figure> (goal <op> <target>)`` with the measured
figure first and the goal after it.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHES = sorted(p for p in (ROOT / "bench").glob("*.py") if not p.name.startswith("_"))
# The figure may carry thousands separators and a unit; the goal names its comparison.
FINAL = re.compile(
    r"^(?P<what>[^:]+): (?P<figure>-?[\d,]*\.?\d+)(?P<unit>%|x|s)? "
    r"\(goal (?P<op>>=|<=) [^()]+\)$"
)


def test_every_benchmark_is_covered() -> None:
    """A new bench/*.py is picked up by the glob below; at least the known five are there."""
    names = {p.stem for p in BENCHES}
    assert {"convert", "data", "engine_cpu", "pipeline_overhead", "scaling_cpu"} <= names


@pytest.mark.parametrize("bench", BENCHES, ids=[p.stem for p in BENCHES])
def test_benchmark_quick_mode_runs_and_ends_with_its_figure_then_its_goal(
    bench: Path, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    if bench.stem == "pipeline_overhead":  # the session's Prefect server, not a second one
        request.getfixturevalue("prefect_harness")
        from prefect.settings import PREFECT_API_URL

        env["PREFECT_API_URL"] = str(PREFECT_API_URL.value())
    proc = subprocess.run(
        [sys.executable, str(bench), "--quick"],
        cwd=tmp_path,  # a script outside the test suite: tests/ is not on its path
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (
        f"{bench.name} --quick: rc {proc.returncode}\n{proc.stderr[-4000:]}"
    )
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) >= 4, f"{bench.name} printed no table:\n{proc.stdout}"
    match = FINAL.match(lines[-1])
    assert match, f"{bench.name}: last line is not `<what>: <figure> (goal ...)`: {lines[-1]!r}"
    assert math.isfinite(float(match["figure"].replace(",", "")))
    assert "goal" not in match["what"], lines[-1]
    # Its temporary folders are gone (torch's compile cache and torchrun's agent folder may stay,
    # as they do in /tmp after any torch run).
    torch_own = ("torchinductor_", "torchelastic_")
    left = [p.name for p in tmp_path.iterdir() if not p.name.startswith(torch_own)]
    assert left == [], f"{bench.name} left files behind: {left}"


def test_final_line_refuses_a_goal_in_the_figure() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from _common import final_line
    finally:
        sys.path.remove(str(ROOT / "bench"))
    with pytest.raises(ValueError):
        final_line("ratio", "0.9 (goal >= 0.8)", ">= 0.8")


def test_gpu_profile_summary_splits_kernel_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/gpu.py --profile: host steps only (not their GPU-timeline copies), kernel time split
    by kind, overlapping kernels counted once in the idle share."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import importlib

    gpu = importlib.import_module("gpu")
    step = {"name": "ProfilerStep#7", "ts": 0, "dur": 1000}
    kernels = [
        ("nvjet_sm90_tst_256x128", 0, 400),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 300, 200),  # overlaps the gemm
        ("triton_per_fused_rms_norm_0", 600, 100),
        ("void at::native::multi_tensor_apply_kernel<FusedAdam>", 800, 100),
    ]
    events = [{**step, "cat": "user_annotation"}, {**step, "cat": "gpu_user_annotation"}]
    events += [{"cat": "kernel", "name": n, "ts": t, "dur": d} for n, t, d in kernels]
    lines = gpu.summarize_trace({"traceEvents": events})
    assert lines[0].startswith("profile of 1 steps (under the profiler): 1.0 ms/step")
    # busy 0-500, 600-700 and 800-900 of the 1000 us step
    assert "kernels 0.8 ms/step, GPU idle 30.0% of the step" in lines[0]
    shares = {line.split()[0]: line.split()[-3] for line in lines[2:6]}
    assert shares == {
        "matmul": "50.0%", "attention": "25.0%", "fused": "12.5%", "optimizer": "12.5%"
    }  # fmt: skip
