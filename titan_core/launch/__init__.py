"""Launching training jobs: one small interface, pluggable backends (config ``launch.backend``).

    launcher = get_launcher(cfg.launch)
    result = launcher.run(LaunchSpec(args=[...], launch=cfg.launch), on_line=print)

A backend turns a ``LaunchSpec`` into processes (``local``: one ``torchrun`` on this host;
``local_multinode``: several agents on loopback; ``slurm``: an sbatch job running ``srun
torchrun`` on every node), streams their output line by line to ``on_line`` while they run,
and either returns a ``LaunchResult`` or raises a ``LaunchError`` that says in one line what
went wrong and whether a relaunch could help (``retryable``). New backends register with
``register_backend``; they build on ``torchrun`` (the torchrun command line and the job's
environment) and ``supervise`` (running and stopping agent processes).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

from titan_core import storage
from titan_core.config.job import JobConfig, Launch
from titan_core.errors import ConfigError
from titan_core.launch.failures import USER_ERROR_EXIT, LaunchError, describe_failure
from titan_core.launch.spec import Launcher, LaunchResult, LaunchSpec, LineCallback, train_spec

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
    launcher = _BACKENDS[launch.backend]()
    launcher.check(launch)
    return launcher


def job_launcher(cfg: JobConfig) -> Launcher:
    """The launcher of a whole job: its replica groups under ``fault_tolerance.enable``
    (``replica_groups``), else its ``launch.backend``'s."""
    from titan_core.build import local_side_folder
    from titan_core.distributed.flight_recorder import trace_folder
    from titan_core.launch.replica_groups import launcher_for

    launcher = launcher_for(cfg) or get_launcher(cfg.launch)
    return _TracesOfRejectedInput(launcher, trace_folder(local_side_folder(cfg.job.dump_folder)))


class _TracesOfRejectedInput:
    """A job's launcher that tidies up after a job whose ranks rejected their input (exit code
    2: a full disk under one rank's writer, say): torchrun then stops the other ranks with
    SIGTERM, and each writes its flight-recorder trace on the way out. Those traces show no
    hang, only that they were stopped, so the ones this launch wrote are removed (and their
    folder, if this launch made it)."""

    def __init__(self, inner: Launcher, traces: str) -> None:
        self.inner, self.traces = inner, traces

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def run(self, spec: LaunchSpec, on_line: LineCallback) -> LaunchResult:
        """The inner launcher's ``run``; the traces of a rejected input removed."""
        made, start = storage.missing_folders(self.traces), time.time()
        try:
            return self.inner.run(spec, on_line)
        except LaunchError as e:
            if e.exit_code == USER_ERROR_EXIT:
                with contextlib.suppress(OSError):
                    for entry in os.scandir(self.traces):
                        if entry.is_file() and entry.stat().st_mtime >= start - 1:
                            os.remove(entry.path)
                storage.remove_empty_folders(made)  # the folders the traces made, if empty now
            raise


def _register_builtin() -> None:
    from titan_core.launch.local import LocalLauncher, LocalMultinodeLauncher
    from titan_core.launch.slurm import SlurmLauncher

    register_backend("local", LocalLauncher)
    register_backend("local_multinode", LocalMultinodeLauncher)
    register_backend("slurm", SlurmLauncher)


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
    "train_spec",
]
