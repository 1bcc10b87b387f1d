"""``titan launch``: run a config's training with its ``[launch]`` backend, or print the plan.

    titan launch --dry-run --module llama3 --config llama3_debugmodel --launch.backend slurm \
        --launch.nnodes 2 --launch.nproc_per_node 8
    titan launch --module llama3 --config llama3_debugmodel_tiny \
        --launch.backend local_multinode --launch.nnodes 2

Before anything is started or submitted, the job goes through the pipeline's preflight
(``titan_core.pipeline.preflight``): the config at the job's world size (``nnodes *
nproc_per_node``), a fake-backend dry run of one step at that size and the memory budget
(``launch.device_memory_gib``, else the GPU's). ``--dry-run`` checks the config only and prints
the exact commands (local backends) or batch script (slurm) instead of running them. Every rank
receives the same config arguments.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    """Launch (or, with ``--dry-run``, print) the training job the config describes."""
    from titan_core.build import check_job, local_side_folder
    from titan_core.config.manager import parse_args
    from titan_core.launch import LaunchError, LaunchSpec, get_launcher

    parser = argparse.ArgumentParser(
        prog="titan launch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dry-run", action="store_true", help="print, do not run")
    parser.add_argument(
        "--timeout", type=float, default=None, help="cancel the job after this many seconds"
    )
    ns, rest = parser.parse_known_args(argv)
    cfg = parse_args(rest)
    if ns.dry_run:
        check_job(cfg, cfg.launch.nnodes * cfg.launch.nproc_per_node)
    else:  # the pipeline's preflight: dry run on fake process groups, memory budget
        from titan_core.pipeline.preflight import preflight_checks

        preflight_checks(cfg)
    launcher = get_launcher(cfg.launch)
    spec = LaunchSpec(
        args=rest,
        launch=cfg.launch,
        log_dir=os.path.join(local_side_folder(cfg.job.dump_folder), "logs"),
        timeout_s=ns.timeout,
    )
    if ns.dry_run:
        print(launcher.render(spec).rstrip("\n"))
        return 0
    launcher.probe()
    try:
        result = launcher.run(spec, on_line=lambda line: print(line, flush=True))
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    job = f" (Slurm job {result.job_id})" if result.job_id else ""
    print(f"launch: {cfg.launch.backend} job finished in {result.elapsed_s:.1f}s{job}")
    return 0
