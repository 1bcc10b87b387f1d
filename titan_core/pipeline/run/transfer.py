"""Moving run files in and out of storage: S3 credentials, access checks, retried transfers.

S3 goes through s3fs, whose endpoint and credentials come from the ``AWS_*`` environment or a
Secret block (``storage.credentials_block``) copied into it; never from block settings. The block
is read by the ``load_secret`` its caller hands in (``tasks.runtime.load_secret``: Prefect's).
The layout of a run root is in ``paths``.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from titan_core import storage
from titan_core.errors import StorageError
from titan_core.pipeline.run.common import Logger, register_secret, titan_logger

T = TypeVar("T")
SecretLoader = Callable[[str], Any]
"""The value of a named secret (a Prefect Secret block): a JSON string or a mapping."""
_BLOCK_KEYS = {
    "aws_access_key_id": "AWS_ACCESS_KEY_ID",
    "aws_secret_access_key": "AWS_SECRET_ACCESS_KEY",
    "aws_session_token": "AWS_SESSION_TOKEN",
    "endpoint_url": "AWS_ENDPOINT_URL",
    "region_name": "AWS_DEFAULT_REGION",
}


def configure_credentials(block: str, load_secret: SecretLoader) -> None:
    """Copy S3 credentials from the Secret block ``block`` (read by ``load_secret``, which
    raises ``ValueError`` for a block it cannot load) into the environment."""
    if not block:
        return
    try:
        value = load_secret(block)
    except ValueError as e:
        raise StorageError(f"storage.credentials_block: cannot load {block!r}: {e}") from None
    data = json.loads(value) if isinstance(value, str) else value
    if not isinstance(data, dict) or not set(data) & set(_BLOCK_KEYS):
        raise StorageError(
            f"storage.credentials_block: {block!r} must hold JSON with keys among "
            f"{sorted(_BLOCK_KEYS)}"
        )
    for key, env in _BLOCK_KEYS.items():
        if data.get(key):
            os.environ[env] = str(data[key])
            if "secret" in key or "token" in key:
                register_secret(str(data[key]))
    _clear_s3_cache()


def _clear_s3_cache() -> None:
    try:
        import s3fs
    except ImportError:
        return
    s3fs.S3FileSystem.clear_instance_cache()


def _reason(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def describe_error(url: str, e: BaseException, key: str = "job.dump_folder") -> StorageError:
    """A one-line ``StorageError`` for a failed storage operation on ``url``."""
    name = type(e).__name__
    if isinstance(e, PermissionError) or name in ("NoCredentialsError", "ClientError"):
        return StorageError(
            f"{key}: access to {url} denied ({_reason(e)}); check AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY or storage.credentials_block"
        )
    if "Connect" in name or isinstance(e, ConnectionError | TimeoutError):
        endpoint = os.environ.get("AWS_ENDPOINT_URL", "the default AWS endpoint")
        return StorageError(f"{key}: cannot reach {url} at {endpoint} ({_reason(e)})")
    return StorageError(f"{key}: {url}: {_reason(e)}")


def check_storage(url: str, key: str = "job.dump_folder") -> None:
    """Write, read back and delete a probe object under ``url``; ``StorageError`` otherwise."""
    probe = storage.join(url, f".titan-probe-{uuid.uuid4().hex[:8]}")
    try:
        fs, path = storage.filesystem(probe)
        storage.write_text(probe, "probe", raw_errors=True)  # described below, by kind
        ok = storage.read_text(probe) == "probe"
        fs.rm(path)
    except Exception as e:
        raise describe_error(url, e, key) from None
    if not ok:
        raise StorageError(f"{key}: {url}: a probe object read back different bytes")


_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError)  # retrying cannot fix these


def with_retries(fn: Callable[[], T], what: str, attempts: int, logger: Logger | None = None) -> T:
    """Call ``fn``, retrying transient failures (tenacity) with exponential backoff (0.5 s, 1 s,
    2 s, ...), each retry logged to ``logger`` (default ``titan``); the last failure becomes a
    one-line ``StorageError``."""
    import tenacity

    def warn(state: tenacity.RetryCallState) -> None:
        """Log the failure and the wait before the next attempt."""
        error = state.outcome.exception() if state.outcome else None
        (logger or titan_logger()).warning(
            "%s failed (%s); retry %d/%d in %.1fs",
            what,
            _reason(error) if error else "?",
            state.attempt_number,
            attempts - 1,
            state.upcoming_sleep,
        )

    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(max(attempts, 1)),
        wait=tenacity.wait_exponential(multiplier=0.5, max=30),
        retry=tenacity.retry_if_not_exception_type(_PERMANENT),
        before_sleep=warn,
        reraise=True,
    )
    try:
        return retrying(fn)
    except _PERMANENT:
        raise
    except Exception as e:
        raise describe_error(what, e, "storage") from None


def _local_files(local_dir: str) -> Iterator[tuple[str, str]]:
    """(absolute path, posix path relative to ``local_dir``) of every file, sorted."""
    for base, _, files in sorted(os.walk(local_dir)):
        for name in sorted(files):
            full = os.path.join(base, name)
            yield full, os.path.relpath(full, local_dir).replace(os.sep, "/")


class _Bar:
    """A byte progress bar (tqdm on stderr) fed by fsspec callbacks."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not enabled)

    def callback(self) -> Any:
        """A fresh fsspec callback for one file transfer."""
        from fsspec.callbacks import Callback

        bar = self.bar

        done = [0]

        class _FileCallback(Callback):
            def call(self, *args: Any, **kwargs: Any) -> None:
                """Advance the bar by what this transfer moved since the last call."""
                bar.update(self.value - done[0])
                done[0] = self.value

        return _FileCallback()


def upload_folder(
    local_dir: str,
    url: str,
    *,
    attempts: int = 4,
    progress: bool = True,
    on_file: Callable[[str], None] | None = None,
    logger: Logger | None = None,
) -> list[str]:
    """Upload every file under ``local_dir`` to ``url`` (each retried, retries logged to
    ``logger``); returns their URLs.

    ``on_file(url)`` is called after each file lands (progress reporting).
    """
    files = list(_local_files(local_dir)) if os.path.isdir(local_dir) else []
    if not files:
        return []
    # A bar where bytes cross to a store (a local copy does not report them, and is quick).
    enabled = progress and storage.is_url(url)
    bar = _Bar(sum(os.path.getsize(f) for f, _ in files), f"upload {url}", enabled)
    uploaded = []
    try:
        for full, rel in files:
            target = storage.join(url, rel)

            def put(full: str = full, target: str = target) -> None:
                """Upload one file (retried as a whole)."""
                storage.copy_file(full, target, callback=bar.callback())

            with_retries(put, f"upload of {rel} to {url}", attempts, logger)
            uploaded.append(storage.join(url, rel))
            if on_file is not None:
                on_file(uploaded[-1])
    finally:
        bar.bar.close()
    return uploaded


def download_file(
    url: str,
    local_path: str,
    *,
    attempts: int = 4,
    progress: bool = True,
    logger: Logger | None = None,
) -> str:
    """Copy one file from ``url`` to ``local_path`` (retried, retries logged to ``logger``, with
    a progress bar)."""
    fs, path = storage.filesystem(url)
    size = with_retries(lambda: fs.size(path), f"stat of {url}", attempts, logger) or 0
    bar = _Bar(size, f"download {url}", progress)
    try:
        with_retries(
            lambda: storage.copy_file(url, local_path, callback=bar.callback()),
            f"download of {url}",
            attempts,
            logger,
        )
    finally:
        bar.bar.close()
    return local_path


def refresh(url: str) -> None:
    """Forget cached listings of ``url``'s filesystem: other processes (the ranks) write there."""
    fs, _ = storage.filesystem(url)
    fs.invalidate_cache()
