r"""``titan launch``: run a config's training with its ``[launch]`` backend, or print the plan.

    titan launch --dry-run --module llama3 --config llama3_debugmodel --launch.backend slurm \
        --launch.nnodes 2 --launch.nproc_per_node 8
    titan launch --module llama3 --config llama3_debugmodel_tiny \
        --launch.backend local_multinode --launch.nnodes 2

Before anything is started or submitted, the job goes through the pipeline's preflight
(``titan_core.pipeline.stages.preflight``): the config at the job's world size (``nnodes *
nproc_per_node``), a fake-backend dry run of one step at that size and the memory budget
(``launch.device_memory_gib``, else the GPU's). ``--dry-run`` checks the config only and prints
the exact commands (local backends) or batch script (slurm) instead of running them. Every rank
receives the same config arguments.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated

from titan_core.cli.command import Command, default, run
from titan_core.errors import ConfigError


@dataclass
class LaunchOptions:
    """The options of ``titan launch`` (config arguments aside)."""

    dry_run: bool = False
    """check the config and print the commands or batch script; run nothing"""
    timeout: Annotated[float, default("0: never")] = 0.0
    """cancel the job after this many seconds"""


COMMAND = Command("titan launch", LaunchOptions, __doc__ or "")


def main(argv: list[str] | None = None) -> int:
    """Launch (or, with ``--dry-run``, print) the training job the config describes; a user
    error or a failed launch is one ``error:`` line (2, or 1 for the launch)."""
    return run(_launch, argv)


def _launch(argv: list[str]) -> int:
    from titan_core.build import check_job, local_side_folder
    from titan_core.launch import LaunchSpec, job_launcher
    from titan_core.resolve import parse_args

    parsed = COMMAND.parse(argv)
    ns, config_argv = parsed.options, parsed.config.argv()
    if ns.timeout < 0:
        raise ConfigError(f"--timeout: expected seconds >= 0, got {ns.timeout}")
    cfg = parse_args(config_argv)
    if ns.dry_run:
        check_job(cfg, cfg.launch.nnodes * cfg.launch.nproc_per_node)
    else:  # the pipeline's preflight: the launcher's probe of this machine (as titan train
        # --ngpu's), dry run on fake process groups, memory budget
        from titan_core.pipeline.stages.preflight import preflight_checks

        preflight_checks(cfg)
        from titan_core.build import check_outputs_writable

        check_outputs_writable(cfg)  # the dump and checkpoint folders
    launcher = job_launcher(cfg)
    spec = LaunchSpec(
        args=config_argv,
        launch=cfg.launch,
        log_dir=os.path.join(local_side_folder(cfg.job.dump_folder), "logs"),
        timeout_s=ns.timeout or None,
    )
    if ns.dry_run:
        print(launcher.render(spec).rstrip("\n"))
        return 0
    result = launcher.run(spec, on_line=lambda line: print(line, flush=True))
    job = f" (Slurm job {result.job_id})" if result.job_id else ""
    print(f"launch: {cfg.launch.backend} job finished in {result.elapsed_s:.1f}s{job}")
    return 0
