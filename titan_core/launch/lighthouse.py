"""The lighthouse of a fault-tolerant job on a cluster: ``python -m titan_core.launch.lighthouse``.

The ``slurm`` backend's batch script runs it in the background on the allocation's first node
(unless ``fault_tolerance.lighthouse`` names one already running). It serves torchft's
lighthouse (the quorum server) and a small TCP store where the groups of a new job meet before
their first quorum, and writes both addresses, as ``NAME=value`` lines, to ``--out`` (atomically,
once both listen) for the script to export. It runs until it is terminated.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import threading
import urllib.parse
from typing import Any

from titan_core import storage


def serve(
    *,
    host: str,
    min_replicas: int,
    join_timeout_ms: int,
    heartbeat_timeout_ms: int,
    lighthouse: str = "",
) -> tuple[Any, Any, dict[str, str]]:
    """Start the lighthouse (unless ``lighthouse`` gives the address of a running one) and the
    start store; (lighthouse or None, store, the variables naming them, reachable at
    ``host``)."""
    import torch.distributed as dist

    from titan_core.distributed.fault_tolerance import (
        LIGHTHOUSE_ENV,
        START_STORE_ENV,
        quiet_torchft,
    )

    quiet_torchft()  # before torchft's Rust logger starts (it reads RUST_LOG once)
    from torchft.coordination import LighthouseServer

    server = None
    if not lighthouse:
        server = LighthouseServer(
            bind="[::]:0",
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            quorum_tick_ms=100,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
        lighthouse = f"http://{host}:{urllib.parse.urlsplit(server.address()).port}"
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    return server, store, {LIGHTHOUSE_ENV: lighthouse, START_STORE_ENV: f"{host}:{store.port}"}


def _write_atomically(path: str, text: str) -> None:
    storage.write_text(path, text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m titan_core.launch.lighthouse")
    parser.add_argument("--host", required=True, help="the address the groups reach it at")
    parser.add_argument("--min_replicas", type=int, required=True)
    parser.add_argument("--join_timeout_ms", type=int, required=True)
    parser.add_argument("--heartbeat_timeout_ms", type=int, required=True)
    parser.add_argument("--out", required=True, help="file for the NAME=value lines")
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    lighthouse, store, names = serve(
        host=args.host,
        min_replicas=args.min_replicas,
        join_timeout_ms=args.join_timeout_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    try:
        _write_atomically(args.out, "".join(f"{k}={v}\n" for k, v in names.items()))
        print(f"titan: torchft lighthouse at {names[next(iter(names))]}", flush=True)
        stop.wait()
    finally:
        lighthouse.shutdown()
        del store
        with contextlib.suppress(FileNotFoundError):
            os.unlink(args.out)


if __name__ == "__main__":
    main()
