"""The parallelism-parity recipe: one seed checkpoint, one data order, many layouts.

The torchtitan reproducibility recipe made exact across data-parallel degrees: every layout loads
the same seed checkpoint (written with every degree at 1) and draws its global batch from the same
``dataloader.streams`` streams, so a single process and any parallel layout see the same
samples and their per-step losses agree to float rounding.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_core.errors import ConfigError

SEED_SUBDIR = os.path.join("checkpoint", "seed")


@dataclass(frozen=True)
class Layout:
    """One parallel configuration: its name, process count, overrides and data-parallel degree."""

    name: str
    nproc: int
    overrides: tuple[str, ...]
    dp: int


@dataclass(frozen=True)
class LayoutLosses:
    """The training losses of one layout's parity run."""

    name: str
    """The layout's name."""
    losses: dict[int, float]
    """Training loss at every step, 1 to ``training.steps``."""

    @property
    def final(self) -> float:
        """The last step's loss."""
        return self.losses[max(self.losses)]


def common_args(steps: int, seq_len: int, streams: int) -> list[str]:
    """Overrides every parity run shares: deterministic, fixed data streams, log every step."""
    return [
        "--training.steps",
        str(steps),
        "--training.seq_len",
        str(seq_len),
        "--dataloader.streams",
        str(streams),
        "--metrics.log_freq",
        "1",
        "--metrics.cpu_peak_tflops",
        "1",
        "--debug.deterministic",
        "--validation.no_enable",
        "--checkpoint.enable",
        "--checkpoint.load_only",
    ]


def plan_layouts(base: list[str], layouts: list[dict[str, Any]], global_batch: int) -> list[Layout]:
    """Validate every layout's config at its world size (before anything runs or is written)."""
    from titan_core.distributed.parallel_dims import ParallelDims
    from titan_core.resolve import parse_args

    if len(layouts) < 2:
        raise ConfigError(f"parity.layouts: expected at least 2 layouts, got {len(layouts)}")
    planned, names = [], set()
    for i, spec in enumerate(layouts):
        unknown = set(spec) - {"name", "nproc", "overrides"}
        if unknown or not isinstance(spec.get("nproc", 1), int) or spec.get("nproc", 1) < 1:
            raise ConfigError(
                f"parity.layouts[{i}]: expected {{name, nproc >= 1, overrides: [...]}}, got {spec}"
            )
        name, nproc = str(spec.get("name") or f"layout{i}"), int(spec.get("nproc", 1))
        if name in names:
            raise ConfigError(f"parity.layouts[{i}].name: {name!r} is used twice")
        names.add(name)
        overrides = tuple(str(a) for a in spec.get("overrides", []))
        cfg = parse_args([*base, *overrides])
        dims = ParallelDims.from_config(cfg.parallelism, nproc)
        dp = dims.dp_replicate * dims.dp_shard
        if global_batch % dp:
            raise ConfigError(
                f"parity.global_batch: {global_batch} is not divisible by the data-parallel "
                f"degree {dp} of layout {name!r}"
            )
        planned.append(Layout(name, nproc, overrides, dp))
    return planned


def _env() -> dict[str, str]:
    """The environment of parity runs."""
    # MKL's reproducible mode makes one process and several agree bit for bit on CPU.
    env = {**os.environ, "MKL_CBWR": "AUTO,STRICT", "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run(cmd: list[str], what: str, timeout: float) -> str:
    """Run ``cmd``; its output, or a RuntimeError with its tail."""
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed with exit code {proc.returncode}:\n{out[-4000:]}")
    return out


def write_parity_seed(base: list[str], output: str, seq_len: int, timeout: float = 600) -> str:
    """Write the shared seed checkpoint with one process; returns its directory."""
    dump = os.path.join(output, "seed")
    shutil.rmtree(dump, ignore_errors=True)  # a rerun writes a fresh seed
    args = [*base, "--job.dump_folder", dump, "--checkpoint.enable"]
    args += ["--checkpoint.create_seed_checkpoint", "--training.seq_len", str(seq_len)]
    _run([sys.executable, "-m", "titan_core.train", *args], "seed checkpoint", timeout)
    seed = os.path.join(dump, SEED_SUBDIR)
    if not os.path.exists(os.path.join(seed, ".metadata")):
        raise RuntimeError(f"seed checkpoint missing after the run: {seed}")
    return seed


def train_parity_layout(
    name: str,
    nproc: int,
    args: list[str],
    seed: str,
    output: str,
    steps: int,
    on_line: Callable[[str], None],
    timeout: float = 600,
) -> LayoutLosses:
    """Train one layout from the seed checkpoint under torchrun; returns its per-step losses."""
    from titan_core.config.job import Launch
    from titan_core.launch import LaunchSpec, get_launcher

    dump = Path(output) / name
    if dump.exists():
        shutil.rmtree(dump)  # a rerun starts from the seed, never from an old step
    shutil.copytree(seed, dump / SEED_SUBDIR)
    launch = Launch(nproc_per_node=nproc, log_ranks="0")
    spec = LaunchSpec(
        args=[*args, "--job.dump_folder", str(dump)],
        launch=launch,
        env={k: v for k, v in _env().items() if k in ("MKL_CBWR", "PYTHONUNBUFFERED")},
        timeout_s=timeout,
    )
    get_launcher(launch).run(spec, on_line=on_line)
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    losses = {int(r["step"]): float(r["loss"]) for r in rows if "loss" in r}
    if sorted(losses) != list(range(1, steps + 1)):
        raise RuntimeError(f"layout {name!r} logged steps {sorted(losses)}, expected 1..{steps}")
    return LayoutLosses(name, losses)


def parity_rows(
    layouts: list[Layout], losses: list[LayoutLosses], rtol: float
) -> list[dict[str, Any]]:
    """One row per layout: its worst relative loss difference to the first layout, pass/fail."""
    ref = losses[0].losses
    rows = []
    for layout, run in zip(layouts, losses):
        got = run.losses
        worst_step = max(ref, key=lambda s: abs(got[s] - ref[s]) / abs(ref[s]))
        worst = abs(got[worst_step] - ref[worst_step]) / abs(ref[worst_step])
        rows.append(
            {
                "layout": layout.name,
                "nproc": layout.nproc,
                "dp": layout.dp,
                "overrides": " ".join(layout.overrides) or "(none)",
                "final_loss": run.final,
                "max_rel_diff": worst,
                "worst_step": worst_step,
                "ok": worst <= rtol,
            }
        )
    return rows
