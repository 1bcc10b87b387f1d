"""Launching training jobs: one small interface, pluggable backends (config ``launch.backend``).

    launcher = get_launcher(cfg.launch)
    result = launcher.run(LaunchSpec(args=[...], launch=cfg.launch), on_line=print)

A backend turns a ``LaunchSpec`` into processes (``local``: one ``torchrun`` on this host),
streams their output line by line to ``on_line`` while they run, and either returns a
``LaunchResult`` or raises a ``LaunchError`` that says in one line what went wrong and whether
a relaunch could help (``retryable``). New backends register with ``register_backend``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from titan_core.config.job import Launch
from titan_core.errors import ConfigError
from titan_core.launch.failures import LaunchError, describe_failure

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


class Launcher(Protocol):
    """A backend: runs a ``LaunchSpec`` to completion, streaming output lines."""

    def command(self, spec: LaunchSpec) -> list[str]:
        """The command line that ``run`` would start (for logs and dry runs)."""

    def run(self, spec: LaunchSpec, on_line: LineCallback) -> LaunchResult:
        """Run to completion; ``LaunchError`` on failure (the processes are gone either way)."""


_BACKENDS: dict[str, Callable[[], Launcher]] = {}


def register_backend(name: str, factory: Callable[[], Launcher]) -> None:
    """Make ``launch.backend = name`` create launchers with ``factory``."""
    _BACKENDS[name] = factory


def get_launcher(launch: Launch) -> Launcher:
    """The launcher for ``launch.backend``; ``ConfigError`` for an unknown one."""
    if launch.backend not in _BACKENDS:
        raise ConfigError(
            f"launch.backend: expected one of {sorted(_BACKENDS)}, got {launch.backend!r}"
        )
    return _BACKENDS[launch.backend]()


def _register_builtin() -> None:
    from titan_core.launch.local import LocalLauncher

    register_backend("local", LocalLauncher)


_register_builtin()

__all__ = [
    "LaunchError",
    "LaunchResult",
    "LaunchSpec",
    "Launcher",
    "LineCallback",
    "describe_failure",
    "get_launcher",
    "register_backend",
]
