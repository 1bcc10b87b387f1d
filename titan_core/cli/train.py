"""``titan train``: train in this process, or under torchrun on ``--ngpu`` local processes.

An engine command: it imports nothing of the pipeline layer (no Prefect, no MLflow).
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from dataclasses import dataclass

from titan_core.cli.command import Command
from titan_core.config.job import JobConfig
from titan_core.launch import Launcher, LaunchSpec, job_launcher


@dataclass
class TrainOptions:
    """The options of ``titan train`` (config arguments aside)."""

    ngpu: int = 1
    """processes on this host (torchrun when > 1)"""
    log_rank: str = "0"
    """ranks whose output is shown: 0,1 or all"""
    dry_run: bool = False
    """print the command, do not run it"""


TRAIN = Command(
    "titan train",
    TrainOptions,
    "Train in this process, or under torchrun on --ngpu local processes (the same command "
    "builder as titan launch's local backend). A COMM_MODE config (--comm.mode) simulates the "
    "--ngpu ranks in one process.",
    config_help=True,
)


def main(argv: list[str]) -> int:
    """``titan train`` on ``argv``: its options, then ``train`` with the config arguments."""
    parsed = TRAIN.parse(argv)
    ns = parsed.options
    return train(ns.ngpu, ns.log_rank, parsed.config.argv(), ns.dry_run)


def train(ngpu: int, log_rank: str, rest: list[str], dry_run: bool = False) -> int:
    """``titan train``: in this process, or under torchrun on ``ngpu`` local processes.

    Several processes go through ``titan_core.launch``'s local backend, the same command builder
    and supervision as ``titan launch`` and the pipeline's train task (``./run_train.sh`` calls
    this).
    ``dry_run`` checks the config and prints the command instead of running it.
    """
    if ngpu > 1 and (simulated := _comm_mode_args(ngpu, rest)):
        # COMM_MODE: one process simulates all ngpu ranks (titan_core.comm_mode).
        rest, ngpu = simulated, 1
    if ngpu > 1 or dry_run:
        from titan_core.build import check_job
        from titan_core.resolve import parse_args

        cfg = parse_args(rest)
        check_job(cfg, ngpu)  # a bad config fails here, before torchrun starts or is printed
    if ngpu > 1:
        launcher, spec = local_train_launch(cfg, rest, ngpu, log_rank)
        if dry_run:
            print(launcher.render(spec))
            return 0
        # What titan launch's preflight checks on this machine, by the same call: e.g. that a
        # configured fault_tolerance.lighthouse answers, before any worker starts.
        launcher.probe()
        from titan_core.build import check_outputs_writable

        check_outputs_writable(cfg)  # the dump and checkpoint folders
        # Supervised as titan launch's jobs are: a rank's failure is one line, its exit code
        # kept where a relaunch would fail the same way (a full disk: 2), and no process stays.
        launcher.run(spec, on_line=lambda line: print(line, flush=True))
        return 0
    if dry_run:
        print(shlex.join([sys.executable, "-m", "titan_core.train", *rest]))
        return 0
    from titan_core.train import main as train_main

    return train_main(rest)


def local_train_launch(
    cfg: JobConfig, args: list[str], ngpu: int, log_rank: str
) -> tuple[Launcher, LaunchSpec]:
    """The local launcher and spec of ``titan train --ngpu``: the config's ``[launch]`` section
    on this one host with ``ngpu`` processes, showing ``log_rank``'s output (a fault-tolerant
    job: its replica groups, ``ngpu`` processes in all)."""
    launch = dataclasses.replace(
        cfg.launch, backend="local", nnodes=1, nproc_per_node=ngpu, log_ranks=log_rank
    )
    return job_launcher(dataclasses.replace(cfg, launch=launch)), LaunchSpec(
        args=list(args), launch=launch
    )


def _comm_mode_args(ngpu: int, rest: list[str]) -> list[str]:
    """``rest`` with the simulated world size when the job asks for a COMM_MODE, else []."""
    from titan_core.resolve import parse_args

    if not any(a.startswith("--comm.fake_world_size") for a in rest):
        rest = [*rest, "--comm.fake_world_size", str(ngpu)]
    return rest if parse_args(rest).comm.mode != "default" else []
