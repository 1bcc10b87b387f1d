"""The engine's own ``titan`` commands: ``train``, ``config`` and the engine-only demo.

The ``titan`` console script itself (``flows.main``) dispatches here and to the other packages'
CLIs; this module imports nothing of the pipeline layer.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import statistics
import sys
from dataclasses import dataclass

from titan_core.config.command import Command
from titan_core.config.job import Launch
from titan_core.launch import Launcher, LaunchSpec, get_launcher
from titan_core.launch.local import job_environment


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


@dataclass
class ConfigOptions:
    """``titan config`` has no options of its own: config arguments only."""


CONFIG = Command(
    "titan config", ConfigOptions, "Print the resolved config as TOML.", config_help=True
)


def train_command(argv: list[str]) -> int:
    """``titan train`` on ``argv``: its options, then ``train`` with the config arguments."""
    parsed = TRAIN.parse(argv)
    ns = parsed.options
    return train(ns.ngpu, ns.log_rank, parsed.config.argv(), ns.dry_run)


def train(ngpu: int, log_rank: str, rest: list[str], dry_run: bool = False) -> int:
    """``titan train``: in this process, or under torchrun on ``ngpu`` local processes.

    Several processes go through ``titan_core.launch``'s local backend, the same command builder
    as ``titan launch`` and the pipeline's train task (``./run_train.sh`` calls this).
    ``dry_run`` checks the config and prints the command instead of running it.
    """
    if ngpu > 1 and (simulated := _comm_mode_args(ngpu, rest)):
        # COMM_MODE: one process simulates all ngpu ranks (titan_core.comm_mode).
        rest, ngpu = simulated, 1
    if ngpu > 1 or dry_run:
        from titan_core.build import check_job
        from titan_core.config.manager import parse_args

        cfg = parse_args(rest)
        check_job(cfg, ngpu)  # a bad config fails here, before torchrun starts or is printed
    if ngpu > 1:
        launcher, spec = local_train_launch(cfg.launch, rest, ngpu, log_rank)
        if dry_run:
            print(launcher.render(spec))
            return 0
        cmd = launcher.command(spec)
        os.execve(cmd[0], cmd, job_environment(spec))
    if dry_run:
        print(shlex.join([sys.executable, "-m", "titan_core.train", *rest]))
        return 0
    from titan_core.train import main as train_main

    return train_main(rest)


def local_train_launch(
    launch: Launch, args: list[str], ngpu: int, log_rank: str
) -> tuple[Launcher, LaunchSpec]:
    """The local launcher and spec of ``titan train --ngpu``: the config's ``[launch]`` section
    on this one host with ``ngpu`` processes, showing ``log_rank``'s output."""
    launch = dataclasses.replace(
        launch, backend="local", nnodes=1, nproc_per_node=ngpu, log_ranks=log_rank
    )
    return get_launcher(launch), LaunchSpec(args=list(args), launch=launch)


def _comm_mode_args(ngpu: int, rest: list[str]) -> list[str]:
    """``rest`` with the simulated world size when the job asks for a COMM_MODE, else []."""
    from titan_core.config.manager import parse_args

    if not any(a.startswith("--comm.fake_world_size") for a in rest):
        rest = [*rest, "--comm.fake_world_size", str(ngpu)]
    return rest if parse_args(rest).comm.mode != "default" else []


def config(argv: list[str]) -> int:
    """``titan config``: print the resolved config as TOML (``--help``: every config key)."""
    from titan_core.config.manager import main as config_main

    return config_main(CONFIG.parse(argv).config.argv())


def demo(steps: int, rest: list[str]) -> int:
    """Train the debug model offline; a rerun resumes from the newest checkpoint and goes on."""
    from titan_core import storage
    from titan_core.checkpoint.manager import complete_steps
    from titan_core.config.manager import parse_args
    from titan_core.train import run

    argv = ["--module", "llama3", "--config", "llama3_debugmodel", *rest]
    if steps:
        argv += ["--training.steps", str(steps)]
    cfg = parse_args(argv)
    folder = storage.resolve(cfg.job.dump_folder, cfg.checkpoint.folder)
    done = complete_steps(folder)
    if done and done[-1] >= cfg.training.steps:
        # Already trained this far: continue for another block of the same length.
        steps = done[-1] + cfg.training.steps
        print(f"demo: found checkpoint step-{done[-1]} in {folder}; continuing to step {steps}")
        cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, steps=steps))
    elif done:
        print(f"demo: resuming from checkpoint step-{done[-1]} in {folder}")
    history = run(cfg)
    losses = [h["loss"] for h in history if "loss" in h]
    if len(losses) >= 4:
        k = min(10, len(losses) // 2)
        first, last = statistics.mean(losses[:k]), statistics.mean(losses[-k:])
        print(
            f"demo: mean loss of the first {k} logged steps {first:.3f} → last {k}: "
            f"{last:.3f} ({100 * (first - last) / first:+.1f}% lower)"
        )
    print(
        f"demo: outputs in {cfg.job.dump_folder} (checkpoints: {folder}, "
        f"metrics: {os.path.join(cfg.job.dump_folder, 'metrics.jsonl')}); "
        "run `make demo` again to resume"
    )
    return 0
