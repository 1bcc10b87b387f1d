"""A real two-node Slurm cluster on this host, for the launcher tests (Debian's slurm-wlm).

``start_cluster(workdir)`` writes a slurm.conf (auth/none, no accounting, two nodes ``n1``/``n2``
with their own slurmd ports — Debian builds slurmd with multiple-slurmd support; daemons bind
to every address, as this host's name resolves to loopback in /etc/hosts), starts
``slurmctld`` and two ``slurmd`` in the foreground as child processes, waits until both nodes
are idle, and returns a ``SlurmCluster`` whose ``env`` points clients (sbatch, squeue, srun) at
the config via ``SLURM_CONF``. ``unavailable()`` says why a cluster cannot run here (not root,
no slurm-wlm, no non-loopback IPv4 address, no cgroup filesystem), or returns "".

Run by hand: ``python -m tests.slurm_cluster`` starts one and prints the env to use.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from helpers import free_port

DAEMONS = ("slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scancel", "scontrol", "srun")
NODES = ("n1", "n2")
_READY_TIMEOUT_S = 60.0


def host_address() -> str:
    """This host's non-loopback IPv4 address ("" if there is none)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5)
        for addr in out.stdout.split():
            if "." in addr and not addr.startswith("127."):
                return addr
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.255.255.255", 9))  # sends nothing: picks the outgoing address
        addr = s.getsockname()[0]
        if not addr.startswith("127."):
            return addr
    return ""


def _find(name: str) -> str | None:
    return shutil.which(name) or next(
        (p for d in ("/usr/sbin", "/sbin") if os.access(p := os.path.join(d, name), os.X_OK)),
        None,
    )


def unavailable() -> str:
    """Why a local cluster cannot start here, or "" when it can."""
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root (slurmd runs job steps as their user)"
    missing = [n for n in (*DAEMONS, *CLIENTS) if _find(n) is None]
    if missing:
        return f"Slurm is not installed (missing {', '.join(missing)}): apt-get install slurm-wlm"
    if not host_address():
        return "Slurm needs a non-loopback IPv4 address on this host"
    if not os.path.isdir("/sys/fs/cgroup") or not os.listdir("/sys/fs/cgroup"):
        return "Slurm needs a mounted cgroup filesystem (/sys/fs/cgroup is empty)"
    return ""


def write_config(workdir: Path, addr: str) -> Path:
    """slurm.conf for a controller and two nodes on this host; returns its path."""
    host = socket.gethostname()
    cpus = os.cpu_count() or 1
    state = workdir / "state"
    state.mkdir(parents=True, exist_ok=True)
    lines = [
        "ClusterName=titan-test",
        f"SlurmctldHost={host}({addr})",
        f"SlurmctldPort={free_port('0.0.0.0')}",
        "AuthType=auth/none",
        "CredType=cred/none",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/builtin",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "MpiDefault=none",
        "SlurmUser=root",
        "SlurmdUser=root",
        "ReturnToService=2",
        "MinJobAge=600",
        "KillWait=5",
        "InactiveLimit=0",
        f"StateSaveLocation={state}",
        f"SlurmdSpoolDir={workdir}/spool-%n",
        f"SlurmctldPidFile={workdir}/slurmctld.pid",
        f"SlurmdPidFile={workdir}/slurmd-%n.pid",
        f"SlurmctldLogFile={workdir}/slurmctld.log",
        f"SlurmdLogFile={workdir}/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
    ]
    for name in NODES:
        lines.append(
            f"NodeName={name} NodeHostname={host} NodeAddr={addr} Port={free_port('0.0.0.0')} "
            f"CPUs={cpus} State=UNKNOWN"
        )
    lines.append(
        f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP "
        "OverSubscribe=FORCE:4"
    )
    conf = workdir / "slurm.conf"
    conf.write_text("\n".join(lines) + "\n")
    return conf


@dataclass
class SlurmCluster:
    """Controller + two slurmd as child processes; ``env`` points clients at the config."""

    workdir: Path
    conf: Path
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """Variables that point Slurm's clients at this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def logs(self) -> str:
        """The daemons' log tails (for failure messages)."""
        out = []
        for path in sorted(self.workdir.glob("*.log")):
            out.append(f"--- {path.name}\n{path.read_text(errors='replace')[-2000:]}")
        return "\n".join(out)

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A Slurm client command against this cluster."""
        return subprocess.run(
            args, env={**os.environ, **self.env}, capture_output=True, text=True, check=check
        )

    def wait_idle(self, timeout: float = _READY_TIMEOUT_S) -> None:
        """Until every node reports idle (fails with the daemons' logs otherwise)."""
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            for p in self.processes:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited with {p.returncode}\n{self.logs()}")
            res = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            states = res.stdout.strip()
            if (
                res.returncode == 0
                and states
                and all(line.split()[1] == "idle" for line in states.splitlines())
            ):
                return
            time.sleep(0.3)
        raise RuntimeError(f"Slurm nodes not idle after {timeout}s: {states!r}\n{self.logs()}")

    def stop(self) -> None:
        """Cancel what is left and wait for it to go (job steps outlive slurmd otherwise), stop
        the daemons, then kill any step daemon of this cluster that is still there."""
        with contextlib.suppress(OSError):
            self.run("scancel", "--full", "--user=root", check=False)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                res = self.run("squeue", "-h", check=False)
                if res.returncode != 0 or not res.stdout.strip():
                    break
                time.sleep(0.5)
        for p in reversed(self.processes):
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        for p in self.processes:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for proc in psutil.process_iter(["name"]):
            if proc.info["name"] == "slurmstepd":
                with contextlib.suppress(psutil.Error):
                    if proc.environ().get("SLURM_CONF") == str(self.conf):
                        for child in proc.children(recursive=True):
                            child.kill()
                        proc.kill()


def start_cluster(workdir: Path) -> SlurmCluster:
    """A running cluster with nodes n1 and n2 idle (``unavailable()`` must be "")."""
    reason = unavailable()
    if reason:
        raise RuntimeError(reason)
    workdir.mkdir(parents=True, exist_ok=True)
    conf = write_config(workdir, host_address())
    cluster = SlurmCluster(workdir=workdir, conf=conf)
    out = open(workdir / "daemons.out", "ab")  # noqa: SIM115 (kept open for the daemons)
    try:
        cmds = [[_find("slurmctld"), "-D", "-i", "-f", str(conf)]]
        cmds += [[_find("slurmd"), "-D", "-N", n, "-f", str(conf)] for n in NODES]
        for cmd in cmds:
            cluster.processes.append(
                subprocess.Popen(
                    cmd,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "SLURM_CONF": str(conf)},
                )
            )
        cluster.wait_idle()
    except BaseException:
        cluster.stop()
        raise
    finally:
        out.close()
    return cluster


if __name__ == "__main__":
    import tempfile

    c = start_cluster(Path(tempfile.mkdtemp(prefix="slurm-")))
    print(f"export SLURM_CONF={c.conf}")
    print(c.run("sinfo").stdout)
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        signal.pause()
    finally:
        c.stop()
