"""Backends on this host: ``local`` (one torchrun agent) and ``local_multinode`` (``nnodes``
torchrun agents on loopback joined by a c10d rendezvous, as separate nodes would be).

Output of every agent is streamed line by line; a failure of any agent ends the others and
becomes one ``LaunchError`` (``titan_core.launch.supervise``).
"""

from __future__ import annotations

import os
import socket
import sys
import uuid

from titan_core.config.job import Launch
from titan_core.errors import ConfigError
from titan_core.launch.spec import LaunchResult, LaunchSpec, LineCallback
from titan_core.launch.supervise import run_agents
from titan_core.launch.torchrun import rank_filter, shell_lines, torchrun_args


class LocalLauncher:
    """``local``: ``python -m torch.distributed.run`` with the spec's processes on this host."""

    def check(self, launch: Launch) -> None:
        """``ConfigError`` for settings this backend cannot run."""
        if launch.nnodes != 1:
            raise ConfigError(
                f"launch.nnodes: the local backend runs one node, expected 1, got {launch.nnodes} "
                "(launch.backend = local_multinode or slurm run several)"
            )

    def probe(self) -> None:
        """Nothing to check: torchrun comes with torch."""

    def command(self, spec: LaunchSpec) -> list[str]:
        """The torchrun command line for ``spec``."""
        self.check(spec.launch)
        opts = torchrun_args(
            spec.launch,
            nnodes=1,
            endpoint=spec.launch.rdzv_endpoint or "127.0.0.1:0",
            log_dir=spec.log_dir or "",
        )
        return [sys.executable, "-m", "torch.distributed.run", *opts, "-m", spec.module, *spec.args]

    def render(self, spec: LaunchSpec) -> str:
        """The exact command line, shell-quoted, with the environment the launcher sets."""
        return shell_lines([self.command(spec)], spec)

    def run(self, spec: LaunchSpec, on_line: LineCallback) -> LaunchResult:
        """Start torchrun, stream every output line to ``on_line``, map failures to errors."""
        cmd = self.command(spec)
        return run_agents([cmd], spec, on_line, accept=lambda line: True)


class LocalMultinodeLauncher:
    """``local_multinode``: ``launch.nnodes`` torchrun agents on loopback, one c10d rendezvous.

    Each agent stands for a node (as under Slurm or Kubernetes): the job exercises multi-node
    rendezvous, rank assignment and teardown without a cluster.
    """

    def check(self, launch: Launch) -> None:
        """Any node count works; the rendezvous endpoint must be on this host."""
        host = launch.rdzv_endpoint.rpartition(":")[0]
        if host and host not in ("127.0.0.1", "localhost", socket.gethostname()):
            raise ConfigError(
                f"launch.rdzv_endpoint: local_multinode rendezvous on this host, expected "
                f"127.0.0.1:PORT or empty, got {launch.rdzv_endpoint!r}"
            )

    def probe(self) -> None:
        """Nothing to check: torchrun comes with torch."""

    def commands(self, spec: LaunchSpec) -> list[list[str]]:
        """One torchrun command per agent (same rendezvous endpoint and id, picked now)."""
        self.check(spec.launch)
        launch = spec.launch
        endpoint = launch.rdzv_endpoint or f"127.0.0.1:{_free_port()}"
        rdzv_id = f"titan-{uuid.uuid4().hex[:12]}"
        cmds = []
        for node in range(launch.nnodes):
            opts = torchrun_args(
                launch,
                nnodes=launch.nnodes,
                endpoint=endpoint,
                rdzv_id=rdzv_id,
                log_dir=os.path.join(spec.log_dir, f"agent{node}") if spec.log_dir else "",
                local_ranks_filter=False,
            )
            torchrun = [sys.executable, "-m", "torch.distributed.run", *opts]
            cmds.append([*torchrun, "-m", spec.module, *spec.args])
        return cmds

    def render(self, spec: LaunchSpec) -> str:
        """The agents' command lines, one per line (the port is picked now)."""
        return shell_lines(self.commands(spec), spec, background=True)

    def run(self, spec: LaunchSpec, on_line: LineCallback) -> LaunchResult:
        """Start every agent, stream their lines (ranks per ``launch.log_ranks``), wait."""
        return run_agents(self.commands(spec), spec, on_line, rank_filter(spec.launch.log_ranks))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
