"""DCP storage readers and writers for local paths and fsspec URLs (the storage seam's DCP end)."""

from __future__ import annotations

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from titan_core.checkpoint.safe_reader import SafeFileSystemReader, SafeFsspecReader
from titan_core.storage import is_url


def dcp_writer(path: str) -> StorageWriter:
    """A DCP writer for a local path or any fsspec URL."""
    return FsspecWriter(path) if is_url(path) else FileSystemWriter(path)


def dcp_reader(path: str) -> StorageReader:
    """A DCP reader for a local path or any fsspec URL (metadata unpickled safely)."""
    return SafeFsspecReader(path) if is_url(path) else SafeFileSystemReader(path)
