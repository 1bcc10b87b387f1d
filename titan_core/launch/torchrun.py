"""The torchrun command line and the job's environment, shared by every backend.

``torchrun_args`` gives torchrun's options for a ``Launch``; ``launcher_variables`` and
``job_environment`` the variables a job runs with; ``shell_lines`` the commands as pasteable
shell lines (the dry run); ``rank_filter`` picks the ranks whose lines are streamed.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable

from titan_core.config.job import Launch
from titan_core.launch.spec import LaunchSpec
from titan_core.logging import RANK_PREFIX_ENV

# torchrun prefixes tee'd lines with the local rank unless told otherwise: global ranks, so that
# lines from several nodes stay apart and ``launch.log_ranks`` can pick them.
PREFIX_TEMPLATE_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
PREFIX_TEMPLATE = "[${role_name}${rank}]:"
NO_SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def torchrun_args(
    launch: Launch,
    *,
    nnodes: int,
    endpoint: str,
    rdzv_id: str = "",
    log_dir: str = "",
    local_ranks_filter: bool = True,
) -> list[str]:
    """torchrun's options for ``launch`` (without the interpreter and the module).

    ``local_ranks_filter``: pass ``launch.log_ranks`` to torchrun (one node: local = global
    ranks); with several nodes every rank is tee'd and ``rank_filter`` picks lines instead.
    """
    args = [
        f"--nnodes={nnodes}",
        f"--nproc_per_node={launch.nproc_per_node}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={endpoint}",
    ]
    if rdzv_id:
        args.append(f"--rdzv_id={rdzv_id}")
    args += [f"--max_restarts={launch.max_restarts}", "--role=rank", "--tee=3"]
    if local_ranks_filter and launch.log_ranks != "all":
        args.append(f"--local-ranks-filter={launch.log_ranks}")
    if log_dir:
        args.append(f"--log-dir={log_dir}")
    return args


def rank_filter(log_ranks: str) -> Callable[[str], bool]:
    """Whether to stream a line: torchrun prefixes rank output ``[rankN]:``; other lines (the
    agents' own) always pass."""
    if log_ranks == "all":
        return lambda line: True
    keep = {int(r) for r in log_ranks.split(",")}

    def accept(line: str) -> bool:
        if not line.startswith("[rank"):
            return True
        head = line[5 : line.find("]")]
        return not head.isdigit() or int(head) in keep

    return accept


def launcher_variables(launch: Launch) -> dict[str, str]:
    """The variables every backend sets for its job (threads, unbuffered output, rank tags)."""
    # torchrun tags every tee'd line with the rank: the engine's logger then adds no tag of its
    # own (no doubled "[rank0]:[rank0]").
    env = {"PYTHONUNBUFFERED": "1", PREFIX_TEMPLATE_ENV: PREFIX_TEMPLATE, RANK_PREFIX_ENV: "0"}
    # A fresh rendezvous store per round: torchrun's shared one keeps a killed attempt's keys
    # (see titan_core.distributed.utils._restart_store).
    env[NO_SHARED_STORE_ENV] = "1"
    if launch.omp_num_threads > 0:
        env["OMP_NUM_THREADS"] = str(launch.omp_num_threads)
    return env


def job_environment(spec: LaunchSpec) -> dict[str, str]:
    """This process's environment (less ``env_unset``) plus the spec's and the launcher's."""
    env = {k: v for k, v in os.environ.items() if k not in spec.env_unset}
    env.update(spec.env)
    env.update(launcher_variables(spec.launch))
    return env


def shell_lines(cmds: list[list[str]], spec: LaunchSpec, background: bool = False) -> str:
    """``cmds`` as pasteable shell lines with the environment changes the launcher makes; the
    spec's own variables are named in a comment, never shown (they may hold credentials)."""
    unset = [f"-u {shlex.quote(k)}" for k in sorted(spec.env_unset)]
    sets = [f"{k}={shlex.quote(v)}" for k, v in launcher_variables(spec.launch).items()]
    lines = [f"# plus from the caller's environment: {' '.join(sorted(spec.env))}"] * bool(spec.env)
    for cmd in cmds:
        lines.append(" ".join(["env", *unset, *sets, shlex.join(cmd)]) + " &" * background)
    return "\n".join(lines + ["wait"] * background)
