"""A checkpoint knows its own bytes: per-file checksums, taken while saving, checked on load.

Every file a rank writes is hashed without lengthening the save where the disk is what it
waits for: a local file is read back from the page cache by a helper thread while DCP's writer
waits on its fsync (hashing the buffers as they are written, inline or on a helper thread beside
each write, cost 15-40% of the save's wall time on a loaded 2-core VM; this costs ~0-5%); a
file on an object store is hashed as its bytes pass to the upload. The hash is XXH3-64
(``xxhash``, a dependency: ~7-9 GB/s on one core here) or, where xxhash is
missing, CRC-32 from zlib (~2-3 GB/s); ``bench/checkpoint_verify.py`` measures both.

Each rank hands its digests to the coordinator inside its DCP write results, the one message
DCP's save already sends there; the coordinator's writer adds the digest of ``.metadata`` and
keeps them all in ``files``, which the manager writes into the commit marker::

    "files": {".metadata": {"bytes": 77595, "xxh3_64": "5c0e6f1a8d2b4e97"},
              "__0_0.distcp": {"bytes": 5201644, "xxh3_64": "d41f03b2c9a85e10"}}

No extra file and no collective: an asynchronous save commits on rank 0 alone.

On load, ``.metadata`` is checked whenever it is read (the safe reader reads it whole anyway),
and each data file is read whole against its entry before DCP reads any of it (``file_damage``);
with several ranks, each rank reads its own share. A commit marker without ``files`` (written
before checksums were) gets the size checks only.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import re
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from titan_core import storage
from titan_core.errors import CheckpointError, storage_errors

COMMIT_MARKER = ".titan_complete"
METADATA = ".metadata"
FileEntry = dict[str, Any]
"""What the commit marker says of one file: ``{"bytes": n, "<hash>": "hex digest"}``."""

_CHUNK = 8 << 20  # read size: large enough that hashing, not the calls, costs
_DIGESTS = "__titan_file_digests__"  # fqn of the extra write result that carries a rank's digests
_WRITER_RE = re.compile(r"^__(\d+)_")


class _Hash(Protocol):
    def update(self, data: Any, /) -> None: ...
    def hexdigest(self) -> str: ...


class _Crc32:
    """zlib's CRC-32 behind the ``update``/``hexdigest`` of hashlib and xxhash."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any, /) -> None:
        """Take in the next bytes."""
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        """The CRC of the bytes so far, 8 hex digits."""
        return f"{self.value:08x}"


HASHES: dict[str, Callable[[], _Hash]] = {"crc32": _Crc32}
"""The hashes this process can check, by their name in the commit marker; the first one is the
one it writes."""
try:
    import xxhash

    HASHES = {"xxh3_64": xxhash.xxh3_64, **HASHES}
except ImportError:  # a machine without xxhash (a GPU image, say): the standard library's CRC-32
    pass


class Digest:
    """A running hash and length of a byte stream."""

    def __init__(self, algorithm: str | None = None) -> None:
        self.algorithm = algorithm or next(iter(HASHES))
        self._hash = HASHES[self.algorithm]()
        self.nbytes = 0

    def update(self, data: Any) -> None:
        """Take in the next bytes (anything with the buffer protocol)."""
        self._hash.update(data)
        self.nbytes += memoryview(data).nbytes

    def entry(self) -> FileEntry:
        """The commit marker's entry for the bytes taken in."""
        return {"bytes": self.nbytes, self.algorithm: self._hash.hexdigest()}


class _HashingStream:
    """A write stream that hashes the file it writes; everything else is the wrapped stream's.

    A file on an object store is hashed as its bytes pass. A local file is read back from the
    page cache by a ``_ReadBack`` thread, started when DCP asks for the descriptor to fsync the
    file it has written: the hashing then runs while the writer waits on the disk, instead of
    lengthening the write (at the latest it starts at close, without an fsync).
    """

    def __init__(self, raw: Any, local: str | None) -> None:
        self._raw = raw
        self._local = local
        self._digest = Digest() if local is None else None
        self._read_back: _ReadBack | None = None

    def write(self, data: Any) -> int:
        """Write ``data`` (and hash it, if not read back)."""
        if self._digest is not None:
            self._digest.update(data)
        return self._raw.write(data)

    def fileno(self) -> int:
        """The descriptor (DCP's fsync); the read-back starts now."""
        fd = self._raw.fileno()
        if self._local is not None and self._read_back is None:
            self._raw.flush()
            self._read_back = _ReadBack(self._local)
        return fd

    def entry(self) -> FileEntry:
        """The file's entry (call after the stream is closed)."""
        if self._digest is not None:
            return self._digest.entry()
        assert self._local is not None
        return (self._read_back or _ReadBack(self._local)).finish()

    def abandon(self) -> None:
        """Stop a read-back (the write failed: its error is the one to report)."""
        if self._read_back is not None:
            with contextlib.suppress(Exception):
                self._read_back.finish()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class _ReadBack:
    """Hashes a local file on a thread of its own, reading what is on storage (from the page
    cache, right after the write). DCP's writers only append (torch's zip writer cannot seek
    DCP's stream), so the bytes below the size it sees are final: it reads up to that size,
    and on to the final size once ``finish`` says the file is closed. (Were a writer ever to
    rewrite bytes it had written, the digest would not match and every load would say so: the
    tests save and load through DCP.)"""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_RDONLY)
        self._closed = threading.Event()
        self._digest = Digest()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="titan-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        buffer = memoryview(bytearray(_CHUNK))
        try:
            while True:
                closed = self._closed.is_set()  # before the size: then the size is final
                while n := os.preadv(self._fd, [buffer], self._digest.nbytes):
                    self._digest.update(buffer[:n])
                if closed:
                    return
                self._closed.wait()
        except BaseException as e:  # raised by finish, on the writer's thread
            self._error = e

    def finish(self) -> FileEntry:
        """The entry of the whole file, once it is closed."""
        self._closed.set()
        self._thread.join()
        os.close(self._fd)
        if self._error is not None:
            raise self._error
        return self._digest.entry()


class _HashingFileSystem:
    """A DCP writer's file system that records the entry of every file it writes, by name."""

    def __init__(self, fs: Any) -> None:
        self._fs = fs
        self.written: dict[str, FileEntry] = {}

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        """The wrapped file system's stream; for writing, hashed."""
        with self._fs.create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            # DCP's local file system takes Paths; its fsspec one, URLs (strings).
            hashing = _HashingStream(stream, os.fspath(path) if isinstance(path, Path) else None)
            try:
                yield hashing
            except BaseException:
                hashing.abandon()
                raise
        self.written[posixpath.basename(os.fspath(path))] = hashing.entry()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


class _Checksummed:
    """DCP file writer mixin: every rank hashes what it writes and sends its digests to the
    coordinator with its write results; there ``files`` holds every file's entry after
    ``finish``."""

    fs: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fs = _HashingFileSystem(self.fs)
        self.files: dict[str, FileEntry] = {}
        """Name -> entry of every file of the checkpoint (on the coordinator, once saved)."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """DCP's write, plus one extra result carrying this rank's digests (``finish`` drops it
        before the metadata is built)."""
        self.fs.written.clear()
        written = super().write_data(plan, planner)  # type: ignore[misc]
        written.wait()
        digests = WriteResult(
            index=MetadataIndex(_DIGESTS), size_in_bytes=0, storage_data=dict(self.fs.written)
        )
        results: Future[list[WriteResult]] = Future()
        results.set_result([*written.value(), digests])
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """DCP's finish (writes ``.metadata``) on the results without the digests, which go
        into ``files`` with the digest of ``.metadata`` itself."""
        files: dict[str, FileEntry] = {}
        for rank_results in results:
            for result in rank_results:
                if result.index.fqn == _DIGESTS:
                    files.update(result.storage_data)
        kept = [[r for r in rank if r.index.fqn != _DIGESTS] for rank in results]
        self.fs.written.clear()
        super().finish(metadata, kept)  # type: ignore[misc]
        for name, entry in self.fs.written.items():  # written as .metadata.tmp, then renamed
            files[name.removesuffix(".tmp")] = entry
        self.files = dict(sorted(files.items()))


class ChecksumFileSystemWriter(_Checksummed, FileSystemWriter):
    """``FileSystemWriter`` that records each file's checksum (``files``)."""


class ChecksumFsspecWriter(_Checksummed, FsspecWriter):
    """``FsspecWriter`` that records each file's checksum (``files``)."""


def marker_files(step_dir: str) -> dict[str, FileEntry]:
    """The ``files`` a checkpoint's commit marker lists; empty when there is no marker, it
    lists none (written before checksums) or it does not parse (``read_marker`` says so)."""
    path = storage.join(step_dir, COMMIT_MARKER)
    try:
        if not storage.exists(path):
            return {}
        files = json.loads(storage.read_text(path)).get("files")
    except (OSError, ValueError, UnicodeDecodeError, AttributeError):
        return {}
    return files if isinstance(files, dict) else {}


def check_bytes(where: str, data: bytes | memoryview, entry: FileEntry | None) -> None:
    """``CheckpointError`` when ``data`` (the whole of file ``where``) does not match its
    commit-marker ``entry``; None passes."""
    if entry is None:
        return
    if len(data) != entry.get("bytes"):
        raise CheckpointError(f"checkpoint: {where}: {_size_words(len(data), entry)}")
    if (algorithm := _algorithm(entry)) is not None:
        digest = Digest(algorithm)
        digest.update(data)
        if (why := _mismatch(digest, entry)) is not None:
            raise CheckpointError(f"checkpoint: {where}: {why}")


def _algorithm(entry: FileEntry) -> str | None:
    """The hash of ``entry`` this process can compute (None: none it knows, e.g. xxh3_64 where
    xxhash is not installed; then only the size is checked)."""
    return next((name for name in HASHES if name in entry), None)


def _mismatch(digest: Digest, entry: FileEntry) -> str | None:
    if digest.nbytes != entry.get("bytes"):
        return _size_words(digest.nbytes, entry)
    got, want = digest.entry()[digest.algorithm], entry[digest.algorithm]
    if got != want:
        return f"checksum mismatch ({digest.algorithm} {got}, the commit marker says {want})"
    return None


def _size_words(size: int | None, entry: FileEntry) -> str:
    cut = isinstance(size, int) and size < entry.get("bytes", 0)
    return f"{size} bytes, the commit marker says {entry.get('bytes')} " + (
        "(truncated)" if cut else "(damaged)"
    )


def checker(name: str, world_size: int) -> int:
    """The rank (of ``world_size``) that reads file ``name`` against its checksum before a
    load: the rank that wrote it (``__<rank>_<n>.distcp``, modulo the world), else rank 0."""
    match = _WRITER_RE.match(name)
    return int(match.group(1)) % world_size if match else 0


def file_damage(
    step_dir: str,
    files: Mapping[str, FileEntry],
    sizes: Mapping[str, int | None],
    *,
    verify: bool = True,
    share: tuple[int, int] = (0, 1),
) -> str | None:
    """The first of ``files`` (name -> commit-marker entry) whose listed size (``sizes``)
    differs from its entry or, with ``verify``, whose bytes do not match its checksum, in one
    line; None when all match. ``share`` = (rank, world size): this rank reads only the files
    it checks (``checker``), so that every byte is read once across the ranks."""
    for name, entry in sorted(files.items()):
        if name not in sizes:
            return f"{storage.join(step_dir, name)}: data file missing"
        if (size := sizes[name]) != entry.get("bytes"):
            return f"{storage.join(step_dir, name)}: {_size_words(size, entry)}"
    rank, world_size = share
    for name, entry in sorted(files.items()):
        algorithm = _algorithm(entry)
        if verify and algorithm is not None and checker(name, world_size) == rank:
            where = storage.join(step_dir, name)
            with storage_errors(where, CheckpointError):
                digest = _read_digest(where, algorithm)
            if (why := _mismatch(digest, entry)) is not None:
                return f"{where}: {why}"
    return None


def _read_digest(path: str, algorithm: str) -> Digest:
    """The digest of a whole file, read in chunks into one buffer."""
    fs, inner = storage.filesystem(path)
    digest = Digest(algorithm)
    buffer = bytearray(_CHUNK)
    with fs.open(inner, "rb") as f:
        while n := f.readinto(buffer):
            digest.update(memoryview(buffer)[:n])
    return digest
