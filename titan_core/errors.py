"""User-facing error types: caught at entry points and printed as one line, exit code 2
(``CommError``: 3, so that launchers relaunch it rather than treat it as bad input)."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator


class TitanError(ValueError):
    """A problem with the user's input (config, files, data); printed as one line."""

    exit_code = 2


class ConfigError(TitanError):
    """Invalid configuration: the message names the key path and what was expected."""


class DataError(TitanError):
    """Missing, empty or unreadable dataset or tokenizer file."""


class CheckpointError(TitanError):
    """Missing, incomplete or incompatible checkpoint."""


class StorageError(TitanError):
    """A file could not be written: a full disk, a read-only folder, denied access. The message
    names the file; exit code 2, as for bad input: a relaunch would fail the same way."""


class CommError(TitanError):
    """A collective failed or timed out (a dead or stuck peer): worth a relaunch."""

    exit_code = 3


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


_ERRNO_WORDS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOTDIR: "a path component is a file, not a folder",
    errno.EISDIR: "is a folder, not a file",
}


def os_error_words(e: OSError, named: str = "") -> str:
    """What an OSError means, in words (``no space left on device``), with the file it names
    unless that is ``named`` (already in the message)."""
    words = _ERRNO_WORDS.get(e.errno or 0) or (e.strerror or first_line(e)).lower()
    return f"{words} ({e.filename})" if e.filename and e.filename != named else words


@contextlib.contextmanager
def storage_errors(where: str, error: type[TitanError]) -> Iterator[None]:
    """Turn storage failures (missing file, denied access, full disk, read-only folder, network,
    S3 client errors) into one ``error`` line naming ``where``; anything else passes through."""
    try:
        yield
    except FileNotFoundError as e:
        raise error(f"{where}: file not found: {e.filename or e}") from None
    except PermissionError as e:
        if "://" in where:  # an object store: its credentials decide
            raise error(
                f"{where}: access denied ({e}); check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
            ) from None
        raise error(f"{where}: {os_error_words(e)}") from None
    except OSError as e:  # disk full, read-only, a file where a directory should be, network
        raise error(f"{where}: {os_error_words(e)}") from None
    except Exception as e:
        if type(e).__module__.split(".")[0] not in ("botocore", "aiobotocore", "s3fs"):
            raise
        raise error(f"{where}: storage error {type(e).__name__}: {first_line(e)}") from None
