"""The batch script of the ``slurm`` backend (``titan launch --dry-run`` prints it).

One srun task per node, each a torchrun agent; the c10d rendezvous is hosted on the first node
of the allocation (its ``NodeAddr``) at ``launch.slurm.rdzv_port_base + job id % 1000``, so jobs
whose nodes share an address do not collide. The job inherits the submitting environment
(``--export=ALL``): credentials and the spec's ``env`` travel that way and are never written
into the script.
"""

from __future__ import annotations

import os
import re
import shlex
import sys

from titan_core.config.job import FaultTolerance, Launch
from titan_core.distributed.fault_tolerance import LIGHTHOUSE_ENV
from titan_core.errors import ConfigError
from titan_core.launch.spec import LaunchSpec
from titan_core.launch.torchrun import launcher_variables, torchrun_args

# srun runs this on every node: "$0" is python, "$@" torchrun's options, module and arguments.
_HOST_ON_NODE_0 = 'exec "$0" "$1" "$2" --rdzv_conf=is_host=$((SLURM_NODEID == 0)) "${@:3}"'
# The same for a replica group's job step: its first task (on the step's first node) hosts.
_HOST_ON_TASK_0 = 'exec "$0" "$1" "$2" --rdzv_conf=is_host=$((SLURM_PROCID == 0)) "${@:3}"'


def log_folder(spec: LaunchSpec) -> str:
    """The job's folder for its output file and batch script, absolute: the spec's
    ``log_dir``, else ``slurm-logs`` in its working directory."""
    base = spec.log_dir or os.path.join(spec.cwd or os.getcwd(), "slurm-logs")
    return os.path.abspath(base)


def render(spec: LaunchSpec) -> str:
    """The batch script for ``spec`` (paths resolved as the launcher's ``run`` would)."""
    lines = _head(spec)
    lines += _endpoint(spec.launch)
    lines.append(
        'echo "titan: job $SLURM_JOB_ID on $SLURM_JOB_NUM_NODES nodes ($SLURM_JOB_NODELIST), '
        'rendezvous $rdzv_endpoint"'
    )
    lines.append(" \\\n  ".join(_wrap(_srun(spec))))
    return "\n".join(lines) + "\n"


def render_groups(spec: LaunchSpec, ft: FaultTolerance, groups: int) -> str:
    """The batch script of a fault-tolerant job: ``groups`` replica groups of
    ``launch.nnodes / groups`` nodes each, every group a job step of its own (its own torchrun
    agents, rendezvous and restarts), so that one group's failure does not end the others.

    The lighthouse (``titan_core.launch.lighthouse``) runs in the background on the first node
    unless ``fault_tolerance.lighthouse`` names one. The job succeeds when a group finishes.
    """
    launch = spec.launch
    if launch.nnodes % groups:
        raise ConfigError(
            f"launch.nnodes: {launch.nnodes} nodes do not split into {groups} replica groups "
            "(parallelism.data_parallel_replicate_degree); each group runs on nodes of its own"
        )
    per_group = launch.nnodes // groups
    python = shlex.quote(launch.slurm.python or sys.executable)
    port_base = launch.slurm.rdzv_port_base
    lines = _head(spec)
    lines += [
        'read -r -a nodes <<< "$(scontrol show hostnames "$SLURM_JOB_NODELIST" | xargs)"',
        "node_addr() {  # a node's NodeAddr (its name when it has none)",
        "  local addr",
        "  addr=$(scontrol show node \"$1\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')",
        '  echo "${addr:-$1}"',
        "}",
        f'echo "titan: job $SLURM_JOB_ID on $SLURM_JOB_NUM_NODES nodes ($SLURM_JOB_NODELIST), '
        f'{groups} replica groups of {per_group} node{"s" * (per_group > 1)}"',
    ]
    if ft.lighthouse:
        lines.append(f"export {LIGHTHOUSE_ENV}={shlex.quote(ft.lighthouse)}")
    else:
        lines += [
            "# The lighthouse (torchft's quorum server) and the groups' start store, on this node.",
            'lighthouse_env="$log_dir/lighthouse-$SLURM_JOB_ID.env"',
            f'{python} -m titan_core.launch.lighthouse --host "$(node_addr "${{nodes[0]}}")" '
            f"--min_replicas {ft.min_replicas} --join_timeout_ms {ft.join_timeout_ms} "
            f'--heartbeat_timeout_ms {ft.heartbeat_timeout_ms} --out "$lighthouse_env" &',
            "lighthouse_pid=$!",
            "trap 'kill $lighthouse_pid 2>/dev/null || true' EXIT",
            "for _ in $(seq 1200); do",
            '  [ -s "$lighthouse_env" ] || ! kill -0 $lighthouse_pid 2>/dev/null && break',
            "  sleep 0.1",
            "done",
            '[ -s "$lighthouse_env" ] || { echo "titan: the lighthouse did not start" >&2; '
            "exit 1; }",
            'export $(cat "$lighthouse_env")',
        ]
    group_opts = torchrun_args(
        launch,
        nnodes=per_group,
        endpoint="$rdzv_endpoint",
        rdzv_id="$SLURM_JOB_ID-$g",
        log_dir="$log_dir/torchrun-$SLURM_JOB_ID-group-$g",
        local_ranks_filter=False,
    )
    srun = [
        "srun",
        "--job-name=titan-group-$g",
        f"--nodes={per_group}",
        f"--ntasks={per_group}",
        "--ntasks-per-node=1",
        f"--relative=$((g * {per_group}))",
        "--kill-on-bad-exit=1",
        "${SLURM_CPUS_PER_TASK:+--cpus-per-task=$SLURM_CPUS_PER_TASK}",
        "bash",
        "-c",
        shlex.quote(_HOST_ON_TASK_0),
        python,
        "-m",
        "torch.distributed.run",
        *(_quote_keeping_vars(o) for o in group_opts),
        "-m",
        shlex.quote(spec.module),
        *(shlex.quote(a) for a in spec.args),
        "--fault_tolerance.group_id",
        '"$g"',
        "&",
    ]
    lines += [
        "pids=()",
        f"for g in $(seq 0 {groups - 1}); do",
        f"  head=${{nodes[$((g * {per_group}))]}}",
        f'  rdzv_endpoint="$(node_addr "$head"):$(({port_base} + '
        f'(SLURM_JOB_ID * {groups} + g) % 1000))"',
        '  echo "titan: replica group $g on ${nodes[*]:$((g * '
        f'{per_group})):{per_group}}}, rendezvous $rdzv_endpoint"',
        "  " + " \\\n    ".join(_wrap(srun)),
        "  pids+=($!)",
        "done",
        "finished=0",
        'for g in "${!pids[@]}"; do  # the job succeeds when a group finishes',
        '  rc=0; wait "${pids[$g]}" || rc=$?',
        "  if [ $rc = 0 ]; then finished=$((finished + 1)); fi",
        '  echo "titan: replica group $g ended with exit code $rc"',
        "done",
        f'echo "titan: $finished of {groups} replica groups finished"',
        '[ $finished -gt 0 ] || exit "$rc"',
    ]
    return "\n".join(lines) + "\n"


def _head(spec: LaunchSpec) -> list[str]:
    """The directives and the preamble, after checking the paths they name."""
    log_dir = log_folder(spec)
    workdir = os.path.abspath(spec.cwd or os.getcwd())
    for what, path in (("log folder", log_dir), ("working directory", workdir)):
        if re.search(r"[\s#]", path):
            raise ConfigError(
                f"launch.backend: slurm cannot use a {what} with whitespace or '#' in its "
                f"path (#SBATCH lines do not quote), got {path!r}"
            )
    return _directives(spec.launch, log_dir, workdir) + _preamble(spec, log_dir)


def _directives(launch: Launch, log_dir: str, workdir: str) -> list[str]:
    """The interpreter line and the ``#SBATCH`` options."""
    slurm = launch.slurm
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={slurm.job_name}",
        f"#SBATCH --nodes={launch.nnodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --time={slurm.time_limit}",
        f"#SBATCH --output={log_dir.replace('%', '%%')}/slurm-%j.out",
        f"#SBATCH --chdir={workdir}",
        "#SBATCH --export=ALL",
        "#SBATCH --no-requeue",  # relaunching (and resuming) is the caller's decision
    ]
    if slurm.partition:
        lines.append(f"#SBATCH --partition={slurm.partition}")
    if slurm.account:
        lines.append(f"#SBATCH --account={slurm.account}")
    return lines + [f"#SBATCH {_long_option(arg)}" for arg in slurm.sbatch_args]


def _preamble(spec: LaunchSpec, log_dir: str) -> list[str]:
    """The lines before srun: the site's setup, the environment, the rendezvous endpoint."""
    lines = [
        "# Rendered by titan_core.launch (backend slurm); `titan launch --dry-run` prints it.",
        "set -eo pipefail",
    ]
    if spec.env:
        lines.append(f"# From the submitting environment: {' '.join(sorted(spec.env))}")
    lines += list(spec.launch.slurm.setup)
    lines.append("set -u")  # after the site's setup lines (some activate scripts trip on -u)
    if spec.env_unset:
        lines.append(f"unset {' '.join(sorted(spec.env_unset))}")
    exports = [f"{k}={shlex.quote(v)}" for k, v in launcher_variables(spec.launch).items()]
    lines.append(f"export {' '.join(exports)}")
    lines.append(f"log_dir={shlex.quote(log_dir)}")
    return lines


def _endpoint(launch: Launch) -> list[str]:
    """Lines setting ``rdzv_endpoint``: the configured one, else the head node's address at a
    port of this job's own."""
    if launch.rdzv_endpoint:
        return [f"rdzv_endpoint={shlex.quote(launch.rdzv_endpoint)}"]
    return [
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
        'head_addr=$(scontrol show node "$head_node" | '
        "sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')",
        f"rdzv_endpoint=${{head_addr:-$head_node}}:"
        f"$(({launch.slurm.rdzv_port_base} + SLURM_JOB_ID % 1000))",
    ]


def _srun(spec: LaunchSpec) -> list[str]:
    """The words of the ``srun torchrun`` command line, quoted for the script."""
    launch = spec.launch
    opts = torchrun_args(
        launch,
        nnodes=launch.nnodes,
        endpoint="$rdzv_endpoint",
        rdzv_id="$SLURM_JOB_ID",
        log_dir="$log_dir/torchrun-$SLURM_JOB_ID",
        local_ranks_filter=False,  # every node's ranks; run() picks launch.log_ranks
    )
    srun = [
        "srun",
        f"--nodes={launch.nnodes}",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        # srun does not inherit sbatch's --cpus-per-task (Slurm >= 22.05): pass it on.
        "${SLURM_CPUS_PER_TASK:+--cpus-per-task=$SLURM_CPUS_PER_TASK}",
    ]
    if not launch.rdzv_endpoint:
        # The head node's agent hosts the rendezvous store: torchrun's own guess compares
        # the endpoint with the addresses the hostname resolves to, and misses a NodeAddr
        # on a second interface. Evaluated per task, hence bash -c.
        srun += ["bash", "-c", shlex.quote(_HOST_ON_NODE_0)]
    srun += [
        shlex.quote(launch.slurm.python or sys.executable),
        "-m",
        "torch.distributed.run",
        *(_quote_keeping_vars(o) for o in opts),
        "-m",
        shlex.quote(spec.module),
        *(shlex.quote(a) for a in spec.args),
    ]
    return srun


def _long_option(arg: str) -> str:
    """``gpus-per-node=8`` (as the command line must spell it) → ``--gpus-per-node=8``."""
    return arg if arg.startswith("-") else f"--{arg}"


def _quote_keeping_vars(arg: str) -> str:
    """Shell-quote an option whose value may hold ``$name`` for the script to expand."""
    if "$" not in arg:
        return shlex.quote(arg)
    assert not re.search(r"[^\w$./=:{}+-]", arg), arg  # our own options: names, $vars
    return f'"{arg}"'


def _wrap(words: list[str]) -> list[str]:
    """Group a long command's words into lines of about 90 characters."""
    lines: list[str] = []
    cur = ""
    for w in words:
        if cur and len(cur) + len(w) > 90:
            lines.append(cur)
            cur = w
        else:
            cur = f"{cur} {w}" if cur else w
    if cur:
        lines.append(cur)
    return lines
