"""Free TCP ports on loopback, for servers the tests and benchmarks start."""

from __future__ import annotations

import socket


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports the kernel reports free now (all held open until every one is
    picked, so they differ)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    return free_ports(1, host)[0]
