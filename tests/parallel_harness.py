"""Loss-parity runs for parallelism tests: one seed checkpoint, one data order, many layouts.

The torchtitan reproducibility recipe, made exact across DP degrees: every run loads the same
seed checkpoint (written with all degrees at 1) and draws its global batch from the same
``dataloader.streams`` streams, so a single process and any parallel layout see the same
samples. ``run_layout`` returns the per-step losses (logged from metrics.jsonl) of one layout.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helpers import free_port, reproducible_env  # noqa: F401  (free_port: re-export)

from titan_core.pipeline.parity import common_args as parity_args

# Tiny Llama: dim 64, 4 heads / 2 kv heads, 4 layers (enough for 2 ranks x 2 virtual stages).
MODEL = ["--module", "llama3", "--config", "llama3_debugmodel_tiny", "--model.n_layers", "4"]
# Tiny Qwen3: QK-norm, 4 heads of 32 channels (n_heads * head_dim != dim), the same depth.
QWEN3_MODEL = ["--module", "qwen3", "--config", "qwen3_debugmodel_tiny", "--model.n_layers", "4"]
# Tiny Qwen3-MoE: 8 experts top-2 (expert hidden 32) in every layer, the same depth.
QWEN3_MOE_MODEL = [
    "--module",
    "qwen3_moe",
    "--config",
    "qwen3_moe_debugmodel_tiny",
    "--model.n_layers",
    "4",
]
GLOBAL_BATCH = 4  # sequences per step, across all data-parallel ranks
STREAMS = 4  # fixed data streams: DP degrees 1, 2 and 4 see identical samples
SEQ_LEN = 32


def common_args(dump: Path, steps: int, model: Sequence[str] = MODEL) -> list[str]:
    """Config shared by every parity run (fp32, deterministic, no saves, no validation): the
    ``parallelism_parity`` flow's own overrides, on ``model`` (the tiny Llama unless given)."""
    return [*model, "--job.dump_folder", str(dump), *parity_args(steps, SEQ_LEN, STREAMS)]


def make_seed_checkpoint(dump: Path, model: Sequence[str] = MODEL) -> Path:
    """Write the seed checkpoint of ``model`` (one process, every degree 1); returns its
    directory."""
    args = [*model, "--job.dump_folder", str(dump), "--checkpoint.enable"]
    args += ["--checkpoint.create_seed_checkpoint", "--training.seq_len", str(SEQ_LEN)]
    proc = subprocess.run(
        [sys.executable, "-m", "titan_core.train", *args],
        env=reproducible_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seed = dump / "checkpoint" / "seed"
    assert (seed / ".metadata").exists()
    return seed


@dataclass
class LayoutRun:
    """What one layout's run logged: per-step training and validation losses, and its output."""

    losses: dict[int, float]
    validation: dict[int, float]
    output: str


def train_layout(
    dump: Path,
    seed: Path,
    *,
    nproc: int,
    dp: int,
    extra: tuple[str, ...] | list[str] = (),
    steps: int = 10,
    nnodes: int = 1,
    timeout: int = 600,
    start: int = 1,
    backend: str = "",
    launch: dict[str, Any] | None = None,
    on_line: Callable[[str], None] | None = None,
    model: Sequence[str] = MODEL,
) -> LayoutRun:
    """Train ``steps`` steps from ``seed`` on ``nproc`` processes (one process: no launcher;
    else through ``titan_core.launch``: ``local`` torchrun, or ``nnodes`` agents with
    ``local_multinode`` or ``slurm``) with ``dp`` data-parallel ranks and the ``extra``
    overrides. Steps ``start``..``steps`` must be logged (a run resuming from a step checkpoint
    under ``dump`` logs only the steps after it). ``launch``: more ``Launch`` settings;
    ``model``: the model arguments (those the seed checkpoint was written with).

    A launch whose rank died of a native heap crash (``NativeCrash``) is run once more from a
    clean folder, with a warning that pytest's summary shows; a second crash fails the test."""
    shutil.copytree(seed, dump / "checkpoint" / "seed")
    args = [
        *common_args(dump, steps, model),
        "--training.local_batch_size",
        str(GLOBAL_BATCH // dp),
    ]
    args += list(extra)
    if nproc == 1 and not backend:
        proc = subprocess.run(
            [sys.executable, "-m", "titan_core.train", *args],
            env=reproducible_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-8000:]
    else:
        run = functools.partial(
            launch_job,
            args,
            dump,
            backend=backend or ("local_multinode" if nnodes > 1 else "local"),
            nnodes=nnodes,
            nproc_per_node=nproc // nnodes,
            timeout=timeout,
            on_line=on_line,
            **(launch or {}),
        )
        try:
            out = run()
        except NativeCrash as crash:
            if start != 1:  # resumed from a step checkpoint under `dump`: not rerunnable
                raise
            warnings.warn(f"layout rerun after a native crash:\n{crash.report}", stacklevel=2)
            shutil.rmtree(dump)
            shutil.copytree(seed, dump / "checkpoint" / "seed")
            out = run()
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    losses = {int(r["step"]): r["loss"] for r in rows if "loss" in r}
    validation = {int(r["step"]): r["validation/loss"] for r in rows if "validation/loss" in r}
    assert sorted(losses) == list(range(start, steps + 1)), out[-8000:]
    return LayoutRun(losses, validation, out)


# A rank that died inside native code, in glibc's or the interpreter's words. Seen once: a heap
# corruption ("malloc(): unaligned tcache chunk detected") in a rank of test_cp's FSDP x CP 2x2
# layout during a full CI run; 130 runs of that layout alone (two at a time, with Python's
# fault handler on) never crashed. Not the code under test failing: rerun once, loudly.
_NATIVE_CRASH_RE = re.compile(
    r"malloc\(\)|free\(\)|double free|corrupted (size|double-linked)|Fatal Python error"
)
_CRASH_EXITS = {-signal.SIGABRT, -signal.SIGSEGV, -signal.SIGBUS}


class NativeCrash(AssertionError):
    """``launch_job``'s failure when a rank died of a native crash (``_NATIVE_CRASH_RE``);
    ``report``: that rank's lines from the crash message on (its threads' Python stacks)."""

    def __init__(self, message: str, lines: list[str], first: int) -> None:
        super().__init__(message)
        tag = re.match(r"\[rank\d+\]:", lines[first])
        mine = [line for line in lines[first:] if tag is None or line.startswith(tag.group())]
        self.report = "\n".join(mine[:80])


def launch_job(
    args: list[str],
    dump: Path,
    *,
    backend: str,
    timeout: float = 600,
    on_line: Callable[[str], None] | None = None,
    **launch: Any,
) -> str:
    """Run ``titan_core.train`` with ``args`` through a launcher backend; returns its output
    (every rank's lines, each also handed to ``on_line``). Fails the test with the output's
    tail if the job fails."""
    from titan_core.config.job import Launch
    from titan_core.launch import LaunchError, LaunchSpec, get_launcher

    settings = Launch(backend=backend, log_ranks="all", **launch)
    spec = LaunchSpec(
        args=args,
        launch=settings,
        env={"MKL_CBWR": "AUTO,STRICT"},
        log_dir=str(dump / "launch-logs"),
        timeout_s=timeout,
    )
    lines: list[str] = []

    def collect(line: str) -> None:
        lines.append(line)
        if on_line is not None:
            on_line(line)

    try:
        get_launcher(settings).run(spec, collect)
    except LaunchError as e:
        message = f"{e}\n" + "\n".join(lines)[-8000:]
        crash = next((i for i, line in enumerate(lines) if _NATIVE_CRASH_RE.search(line)), None)
        if e.exitcode in _CRASH_EXITS and crash is not None:
            raise NativeCrash(message, lines, crash) from None
        raise AssertionError(message) from None
    # torchrun tags the lines; the engine's logger must not tag them again ([rank0]:[rank0]).
    # (torch's own warnings carry their own tag: only the engine's lines are checked.)
    doubled = [line for line in lines if re.match(r"\[rank\d+\]:\[rank\d+\] \[titan\]", line)]
    assert not doubled, doubled[:3]
    return "\n".join(lines)


def run_layout(dump: Path, seed: Path, **kwargs: Any) -> dict[int, float]:
    """``train_layout``'s per-step training losses."""
    return train_layout(dump, seed, **kwargs).losses


def assert_parity(
    got: dict[int, float], ref: dict[int, float], rel: float = 1e-5, what: str = ""
) -> None:
    """Every step's loss within ``rel`` relative of the reference."""
    steps = sorted(got)
    assert steps, f"{what}: no losses"
    for step in steps:
        a, b = got[step], ref[step]
        assert abs(a - b) <= rel * abs(b), f"{what} step {step}: {a!r} vs reference {b!r}"
