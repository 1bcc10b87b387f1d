"""The one storage seam: paths and URLs through fsspec (plain paths stay plain paths).

Used by checkpoints, data, conversion, evaluation and the pipeline alike; DCP's readers and
writers on top of it are in ``titan_core.checkpoint.dcp_io``.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import posixpath
import tempfile
import uuid
from collections.abc import Iterator
from typing import IO, Any

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


# --------------------------------------------------------------------------- the one writer
# Every file titan writes goes through the functions below (tests/test_writers.py holds that):
# a file appears whole or not at all, a failure removes what the attempt made (the temp file,
# the folders it needed), and a full disk, a read-only folder or denied access is one
# ``StorageError`` line naming the file (exit code 2), never a traceback.


def writing_errors(path: str) -> contextlib.AbstractContextManager[None]:
    """Storage failures while writing ``path`` as one ``StorageError`` line naming it."""
    from titan_core.errors import StorageError, storage_errors

    return storage_errors(path, StorageError)


@contextlib.contextmanager
def open_write(path: str, mode: str = "w", *, raw_errors: bool = False) -> Iterator[IO[Any]]:
    """The file ``path`` (``"w"`` text, ``"wb"`` bytes), written whole: into a temp file beside
    it that replaces it when the body is done (a URL: a buffer, one PUT), so that readers never
    see half a file. Missing folders are made; a failure (a full disk, an exception in the body,
    Ctrl-C) removes the temp file and the folders made for it (``raw_errors``: storage errors
    as they are, for a caller that tells them apart, as ``output_path``)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"open_write: mode {mode!r}, expected 'w' or 'wb'")
    if is_url(path):
        buffer: IO[Any] = io.StringIO() if mode == "w" else io.BytesIO()
        yield buffer
        data = buffer.getvalue()
        with contextlib.nullcontext() if raw_errors else writing_errors(path):
            fs, p = filesystem(path)
            fs.pipe_file(p, data.encode() if isinstance(data, str) else data)
        return
    encoding = {"encoding": "utf-8"} if mode == "w" else {}
    with output_path(path, raw_errors=raw_errors) as tmp, open(tmp, mode, **encoding) as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


def write_text(path: str, text: str, *, raw_errors: bool = False) -> None:
    """Write a text file whole (``open_write``)."""
    with open_write(path, raw_errors=raw_errors) as f:
        f.write(text)


def write_bytes(path: str, data: bytes) -> None:
    """Write a binary file whole (``open_write``)."""
    with open_write(path, "wb") as f:
        f.write(data)


@contextlib.contextmanager
def output_path(path: str, *, raw_errors: bool = False) -> Iterator[str]:
    """A local temp path for a library that writes a file by name (matplotlib, the profiler,
    safetensors): it becomes ``path`` (renamed; a URL: uploaded) when the body is done. On a
    failure the temp file and the folders made for it are removed, and a storage error, in the
    body too, is one ``StorageError`` line naming ``path`` (``raw_errors``: passed through as
    they are, for a caller that retries the transient ones)."""
    errors = contextlib.nullcontext() if raw_errors else writing_errors(path)
    with errors:
        local = path.removeprefix("file://")
        if is_url(path):
            suffix = posixpath.splitext(path)[1]
            with tempfile.TemporaryDirectory(prefix="titan-out-") as folder:
                tmp = os.path.join(folder, f"out{suffix}")
                yield tmp
                fs, p = filesystem(path)
                fs.put_file(tmp, p)
            return
        made = make_folders(os.path.dirname(os.path.abspath(local)))
        tmp = temp_name(local)
        try:
            yield tmp
            os.replace(tmp, local)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            remove_empty_folders(made)
            raise


def temp_name(path: str) -> str:
    """The temp file a writer of ``path`` uses: ``<path>.<pid>-<id>.tmp`` (``temp_owner`` reads
    the pid back, to tell a dead writer's temp file from a live one's)."""
    return f"{path}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"


def temp_owner(name: str) -> int | None:
    """The pid of the writer of a ``temp_name``; None for any other name."""
    stem, dot, ext = name.rpartition(".")
    pid = stem.rpartition(".")[2].partition("-")[0]
    return int(pid) if dot and ext == "tmp" and pid.isdigit() else None


def missing_folders(folder: str) -> list[str]:
    """The local ``folder`` and those of its parents that do not exist, outermost first."""
    missing = []
    current = os.path.abspath(folder)
    while not os.path.isdir(current) and os.path.dirname(current) != current:
        missing.append(current)
        current = os.path.dirname(current)
    return missing[::-1]


def make_folders(folder: str) -> list[str]:
    """``os.makedirs(folder)``; the folders it made, outermost first (for
    ``remove_empty_folders`` after a failure)."""
    missing = missing_folders(folder)
    os.makedirs(folder, exist_ok=True)
    return missing


def remove_empty_folders(folders: list[str]) -> None:
    """Remove ``folders`` (outermost first, as ``make_folders`` returns them), innermost first,
    each only while it is empty."""
    for folder in reversed(folders):
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def copy_file(src: str, dst: str, callback: Any = None) -> None:
    """Copy the file ``src`` to ``dst`` (each a path or URL; one of them local): a local ``dst``
    through ``output_path`` (whole, or not at all), a URL by one upload. Storage errors pass
    through as they are, for a caller that retries the transient ones."""
    if is_url(dst):
        fs, p = filesystem(dst)
        fs.put_file(src.removeprefix("file://"), p, callback=callback)
        return
    fs, p = filesystem(src)
    with output_path(dst, raw_errors=True) as tmp:
        fs.get_file(p, tmp, callback=callback)


class LineLog:
    """A local file that grows by whole lines (``metrics.jsonl``, ``health.jsonl``): each
    ``write`` lands whole or not at all. A failed write (a full disk) cuts the file back to where
    it began, removes the file and folders this log made if they are still empty, closes it,
    and raises one ``StorageError`` line naming the file."""

    def __init__(self, path: str) -> None:
        self.path = path.removeprefix("file://")
        self._fd: int | None = None
        self._made: list[str] = []
        self._created = False

    def write(self, text: str) -> None:
        """Append ``text`` (one or more lines)."""
        if not text:
            return
        with writing_errors(self.path):
            if self._fd is None:
                self._open()
            assert self._fd is not None
            end = os.lseek(self._fd, 0, os.SEEK_END)
            try:
                data = memoryview(text.encode())
                while data:
                    data = data[os.write(self._fd, data) :]
            except BaseException:
                self._undo(end)
                raise

    def _open(self) -> None:
        self._made = make_folders(os.path.dirname(os.path.abspath(self.path)))
        self._created = not os.path.exists(self.path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _undo(self, end: int) -> None:
        fd, self._fd = self._fd, None
        assert fd is not None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, end)
        os.close(fd)
        if self._created and end == 0:
            with contextlib.suppress(OSError):
                os.remove(self.path)
            remove_empty_folders(self._made)

    def close(self) -> None:
        """Close the file (a later ``write`` opens it again)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@contextlib.contextmanager
def folder_lock(folder: str) -> Iterator[None]:
    """An exclusive ``flock`` on the local ``folder`` (made if missing), for the few steps that
    must not interleave between processes (several prepares of one data root, a build of the
    bundled assets). A folder removed and made again while we waited is locked anew."""
    while True:
        with writing_errors(folder):
            os.makedirs(folder, exist_ok=True)
            try:
                fd = os.open(folder, os.O_RDONLY)
            except FileNotFoundError:  # removed meanwhile by a process that made it
                continue
        fcntl.flock(fd, fcntl.LOCK_EX)
        with contextlib.suppress(FileNotFoundError):
            if os.stat(folder).st_ino == os.fstat(fd).st_ino:
                break  # locked the folder that is there now
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)  # explicitly: a forked child's copy must not keep it
        os.close(fd)


def check_writable(path: str, key: str) -> None:
    """One ``ConfigError`` line, before anything runs, unless this process can create the local
    folder ``path`` and write a file in it (``key``: the setting that names it). Folders made
    for the check are removed again; an object store's permissions show at its first write."""
    from titan_core.errors import ConfigError, os_error_words

    if not path or is_url(path):
        return
    folder = os.path.abspath(os.path.expanduser(path))
    probe = os.path.join(folder, f".titan-write-check-{uuid.uuid4().hex[:8]}")
    for attempt in range(5):
        made: list[str] = []
        try:
            made = make_folders(folder)
            try:
                with open(probe, "w") as f:
                    f.write("ok")
            finally:  # created, then the write failed (a full disk): the probe goes too
                with contextlib.suppress(FileNotFoundError):
                    os.remove(probe)
            return
        except FileNotFoundError:
            # Another rank removed a folder it made for its own check, between our makedirs
            # and our probe (every rank checks): check again.
            if attempt == 4:
                raise ConfigError(f"{key}: {path}: the folder keeps disappearing") from None
        except OSError as e:
            if e.filename == probe:  # the folder is there, writing in it failed: name the folder
                e.filename = folder
            raise ConfigError(f"{key}: {path}: {os_error_words(e, named=folder)}") from None
        finally:
            remove_empty_folders(made)


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
