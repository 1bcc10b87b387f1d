"""The one storage seam: paths and URLs through fsspec (plain paths stay plain paths).

Used by checkpoints, data, conversion, evaluation and the pipeline alike; DCP's readers and
writers on top of it are in ``titan_core.checkpoint.dcp_io``.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import uuid
from collections.abc import Iterator

import fsspec
from fsspec.core import url_to_fs


def is_url(path: str) -> bool:
    """True for ``scheme://`` URLs other than ``file://``."""
    return "://" in path and not path.startswith("file://")


def join(base: str, *parts: str) -> str:
    """Join path parts, keeping a URL a URL."""
    if is_url(base):
        return posixpath.join(base, *parts)
    return os.path.join(base.removeprefix("file://"), *parts)


def resolve(base: str, path: str) -> str:
    """``path`` itself when absolute or a URL, else relative to ``base``."""
    if is_url(path) or os.path.isabs(path):
        return path
    return join(base, path)


def filesystem(path: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem for a path or URL, and the path within it."""
    return url_to_fs(path)


def exists(path: str) -> bool:
    """Whether a file or directory exists."""
    fs, p = filesystem(path)
    return fs.exists(p)


def list_dirs(path: str) -> list[str]:
    """Names of the immediate sub-directories (empty when ``path`` does not exist)."""
    fs, p = filesystem(path)
    if not fs.exists(p):
        return []
    return [
        posixpath.basename(e["name"].rstrip("/"))
        for e in fs.ls(p, detail=True)
        if e["type"] == "directory"
    ]


def read_text(path: str) -> str:
    """Read a small text file."""
    with fsspec.open(path, "r") as f:
        return f.read()


def write_text_atomic(path: str, text: str) -> None:
    """Write a small text file so readers never see it half-written.

    Locally that is write-to-temp + rename; object stores publish a PUT atomically anyway.
    """
    fs, p = filesystem(path)
    if is_url(path):
        with fs.open(p, "w") as f:
            f.write(text)
        return
    fs.makedirs(os.path.dirname(p) or ".", exist_ok=True)
    tmp = f"{p}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:  # a full disk, a kill: no half-written temp file stays behind
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def check_writable(path: str, key: str) -> None:
    """One ``ConfigError`` line, before anything runs, unless this process can create the local
    folder ``path`` and write a file in it (``key``: the setting that names it). Folders made
    for the check are removed again; an object store's permissions show at its first write."""
    from titan_core.errors import ConfigError, os_error_words

    if not path or is_url(path):
        return
    folder = os.path.abspath(os.path.expanduser(path))
    missing = folder
    while not os.path.exists(os.path.dirname(missing)) and os.path.dirname(missing) != missing:
        missing = os.path.dirname(missing)
    created = not os.path.exists(folder)
    probe = os.path.join(folder, f".titan-write-check-{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(folder, exist_ok=True)
        try:
            with open(probe, "w") as f:
                f.write("ok")
        finally:  # created, then the write failed (a full disk): the probe goes too
            with contextlib.suppress(FileNotFoundError):
                os.remove(probe)
    except OSError as e:
        if e.filename == probe:  # the folder is there, writing in it failed: name the folder
            e.filename = folder
        raise ConfigError(f"{key}: {path}: {os_error_words(e, named=folder)}") from None
    finally:
        if created and os.path.isdir(missing):
            _remove_empty_folders(missing)


@contextlib.contextmanager
def folders_kept_on_success(path: str) -> Iterator[None]:
    """Around writes into the local folder ``path``: if the body fails (an exception, not an
    interrupt), the folders of ``path`` that did not exist before and are still empty are
    removed again."""
    if is_url(path):
        yield
        return
    folder = os.path.abspath(os.path.expanduser(path.removeprefix("file://")))
    missing = folder
    while not os.path.exists(os.path.dirname(missing)) and os.path.dirname(missing) != missing:
        missing = os.path.dirname(missing)
    created = not os.path.exists(folder)
    try:
        yield
    except Exception:
        if created and os.path.isdir(missing):
            _remove_empty_folders(missing)
        raise


def _remove_empty_folders(top: str) -> None:
    """``top`` and the folders below it, deepest first, as long as they are empty."""
    with contextlib.suppress(OSError):
        for root, _, _ in sorted(os.walk(top), key=lambda w: -len(w[0])):
            os.rmdir(root)  # only empty folders: rmdir refuses anything else


def remove_tree(path: str) -> None:
    """Delete a directory tree if it exists."""
    fs, p = filesystem(path)
    if fs.exists(p):
        fs.rm(p, recursive=True)
