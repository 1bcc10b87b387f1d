"""Fault-tolerant replica groups (``fault_tolerance.enable``), on this host or on Slurm.

Backend ``local``: the launcher starts a torchft lighthouse (unless ``fault_tolerance.lighthouse``
names one) and one torchrun agent per replica group, each with ``launch.nproc_per_node / groups``
processes and its own restart policy (``launch.max_restarts``): a group that fails is restarted
by its agent and heals from the live ones, while the others train on.

Backend ``slurm``: one batch job whose script starts the lighthouse on its first node and runs
every group as a job step of its own on ``launch.nnodes / groups`` nodes
(``slurm_script.render_groups``): a step that fails (a lost node, its restarts used up) ends
that group only.

Either way the job succeeds when at least one group finishes; a group that fails for good is
reported in the log. When the lighthouse is lost every group fails (exit code 5): the job's one
line names it, and a relaunch is worth it only where the launch starts a lighthouse of its own.
"""

from __future__ import annotations

import dataclasses
import functools

from titan_core.config.job import FaultTolerance, JobConfig, Launch
from titan_core.distributed.fault_tolerance import (
    LIGHTHOUSE_ENV,
    lighthouse_unreachable,
    quiet_torchft,
)
from titan_core.errors import ConfigError
from titan_core.launch import slurm_script
from titan_core.launch.failures import LIGHTHOUSE_LOST_EXIT, LaunchError
from titan_core.launch.local import LocalLauncher
from titan_core.launch.slurm import SlurmLauncher
from titan_core.launch.spec import LaunchResult, LaunchSpec, LineCallback
from titan_core.launch.supervise import run_agents
from titan_core.launch.torchrun import shell_lines


def check_lighthouse(address: str, timeout_s: float = 3.0) -> None:
    """One ``ConfigError`` line unless something listens at the lighthouse ``address``."""
    if why := lighthouse_unreachable(address, timeout_s):
        raise ConfigError(f"fault_tolerance.lighthouse: {address}: unreachable ({why})")


class ReplicaGroupsLauncher:
    """The replica groups of a job and the lighthouse they share: one torchrun agent per group
    on this host (backend ``local``), or one job step per group of a Slurm job (``slurm``)."""

    def __init__(self, ft: FaultTolerance, groups: int, backend: str = "local") -> None:
        self.ft, self.groups, self.backend = ft, groups, backend
        self.local = LocalLauncher()
        self.slurm = SlurmLauncher(
            functools.partial(slurm_script.render_groups, ft=ft, groups=groups)
        )

    def check(self, launch: Launch) -> None:
        """``ConfigError`` for what this launcher cannot run."""
        if launch.backend == "slurm":
            self.slurm.check(launch)
            if launch.nnodes % self.groups:
                raise ConfigError(
                    f"launch.nnodes: {launch.nnodes} nodes do not split into {self.groups} "
                    "replica groups (parallelism.data_parallel_replicate_degree); on Slurm each "
                    "group runs on nodes of its own"
                )
            return
        if launch.backend != "local":
            raise ConfigError(
                "launch.backend: fault_tolerance.enable runs its replica groups with the local "
                f"(one host) or slurm backend, got {launch.backend!r}"
            )
        self.local.check(launch)
        if launch.nproc_per_node % self.groups:
            raise ConfigError(
                f"launch.nproc_per_node: {launch.nproc_per_node} processes do not split into "
                f"{self.groups} replica groups (parallelism.data_parallel_replicate_degree)"
            )

    def probe(self) -> None:
        """torchft is importable; a configured lighthouse answers."""
        quiet_torchft()  # before this process's first import of torchft (see quiet_torchft)
        import torchft  # noqa: F401  (a dependency of the project)

        if self.backend == "slurm":
            self.slurm.probe()
        if self.ft.lighthouse:
            check_lighthouse(self.ft.lighthouse)

    def commands(self, spec: LaunchSpec, lighthouse: str) -> list[list[str]]:
        """The torchrun command of each replica group."""
        self.check(spec.launch)
        per_group = dataclasses.replace(
            spec.launch, nproc_per_node=spec.launch.nproc_per_node // self.groups
        )
        return [
            self.local.command(
                dataclasses.replace(
                    spec,
                    launch=per_group,
                    args=[*spec.args, "--fault_tolerance.group_id", str(g)],
                    env={**spec.env, LIGHTHOUSE_ENV: lighthouse},
                )
            )
            for g in range(self.groups)
        ]

    def render(self, spec: LaunchSpec) -> str:
        """The commands, shell-quoted (the lighthouse's address is known once it runs), or the
        Slurm batch script."""
        if spec.launch.backend == "slurm":
            self.check(spec.launch)
            return self.slurm.render(spec)
        address = self.ft.lighthouse or "http://<lighthouse started by titan launch>"
        spec = dataclasses.replace(spec, env={**spec.env, LIGHTHOUSE_ENV: address})
        return shell_lines(self.commands(spec, address), spec)

    def run(self, spec: LaunchSpec, on_line: LineCallback) -> LaunchResult:
        """Start the lighthouse (unless configured) and the groups; stream their output. A lost
        lighthouse is relaunched only where the launch starts its own (a relaunch cannot bring
        back ``fault_tolerance.lighthouse``: its preflight would refuse it)."""
        try:
            return self._run(spec, on_line)
        except LaunchError as e:
            self.verdict(e)
            raise

    def verdict(self, error: LaunchError) -> LaunchError:
        """``error``, final (not relaunched) when the groups lost ``fault_tolerance.lighthouse``."""
        if error.exitcode == LIGHTHOUSE_LOST_EXIT and self.ft.lighthouse:
            error.retryable = False
        return error

    def _run(self, spec: LaunchSpec, on_line: LineCallback) -> LaunchResult:
        if spec.launch.backend == "slurm":
            self.check(spec.launch)
            return self.slurm.run(spec, on_line)
        from titan_core.launch.lighthouse import serve

        lighthouse, start, env = serve(
            host="127.0.0.1",
            min_replicas=self.ft.min_replicas,
            join_timeout_ms=self.ft.join_timeout_ms,
            heartbeat_timeout_ms=self.ft.heartbeat_timeout_ms,
            lighthouse=self.ft.lighthouse,
        )
        if lighthouse is not None:
            on_line(
                f"launch: torchft lighthouse at {env[LIGHTHOUSE_ENV]} for {self.groups} "
                "replica groups"
            )
        try:
            cmds = self.commands(spec, env[LIGHTHOUSE_ENV])
            spec = dataclasses.replace(spec, env={**spec.env, **env})
            tags = [f"g{g}" for g in range(self.groups)]  # [g1 rank0]: lines of group 1's rank 0
            return run_agents(cmds, spec, on_line, lambda line: True, independent=True, tags=tags)
        finally:
            if lighthouse is not None:
                lighthouse.shutdown()
            del start


def launcher_for(cfg: JobConfig) -> ReplicaGroupsLauncher | None:
    """The replica-groups launcher of a fault-tolerant job (None: the backend's own)."""
    if not cfg.fault_tolerance.enable:
        return None
    launcher = ReplicaGroupsLauncher(
        cfg.fault_tolerance, cfg.parallelism.data_parallel_replicate_degree, cfg.launch.backend
    )
    launcher.check(cfg.launch)
    return launcher
