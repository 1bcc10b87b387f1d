"""What a launcher runs (``LaunchSpec``), what it returns, and the backend interface."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from titan_core.config.job import Launch

LineCallback = Callable[[str], None]


@dataclass(frozen=True)
class LaunchSpec:
    """What to run: a Python module with arguments, on the processes ``launch`` describes."""

    args: list[str]
    """Arguments of the module (for titan_core.train: the config argv)."""
    launch: Launch = field(default_factory=Launch)
    """Processes, nodes, rendezvous and restarts."""
    module: str = "titan_core.train"
    """Python module every rank runs (``python -m``)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables added to (and overriding) this process's environment."""
    env_unset: tuple[str, ...] = ()
    """Variables of this process's environment that the job must not inherit."""
    cwd: str | None = None
    """Working directory of the job (default: this process's)."""
    log_dir: str | None = None
    """Folder for per-rank log files (default: a temporary folder of the backend)."""
    timeout_s: float | None = None
    """Kill the job and fail after this many seconds (None: no limit)."""


def train_spec(
    config_url: str, launch: Launch, *, initial_load_path: str = "", **kw: Any
) -> LaunchSpec:
    """The training job of a stored config (the pipeline's train stage): every rank runs
    ``titan_core.train --job.config_file config_url``, loading ``initial_load_path`` when the run
    has no checkpoint of its own. ``kw``: the other ``LaunchSpec`` fields (env, log_dir, ...)."""
    args = ["--job.config_file", config_url]
    if initial_load_path:
        args += ["--checkpoint.initial_load_path", initial_load_path]
    return LaunchSpec(args=args, launch=launch, **kw)


@dataclass(frozen=True)
class LaunchResult:
    """A finished, successful launch."""

    command: list[str]
    """The command line that was run."""
    returncode: int
    """Exit status of the launcher process (0)."""
    elapsed_s: float
    """Wall-clock seconds from start to exit."""
    num_lines: int
    """Lines of output streamed."""
    job_id: str = ""
    """The scheduler's id of the job (slurm), else empty."""


class Launcher(Protocol):
    """A backend: runs a ``LaunchSpec`` to completion, streaming output lines."""

    def check(self, launch: Launch) -> None:
        """``ConfigError`` (one line) for settings or a machine this backend cannot run."""

    def probe(self) -> None:
        """``ConfigError`` if this machine cannot start jobs here (e.g. no ``sbatch``)."""

    def render(self, spec: LaunchSpec) -> str:
        """The exact commands or batch script ``run`` would start (logs, ``--dry-run``)."""

    def run(self, spec: LaunchSpec, on_line: LineCallback) -> LaunchResult:
        """Run to completion; ``LaunchError`` on failure (the processes are gone either way)."""
