"""DCP storage readers and writers for local paths and fsspec URLs (the storage seam's DCP end)."""

from __future__ import annotations

import warnings

from torch.distributed.checkpoint.storage import StorageReader

from titan_core.checkpoint.integrity import ChecksumFileSystemWriter, ChecksumFsspecWriter
from titan_core.checkpoint.safe_reader import SafeFileSystemReader, SafeFsspecReader
from titan_core.storage import is_url

# DCP warns on every single-process save or load (a seed checkpoint, a one-rank run, an export)
# even when told so with no_dist=True, which titan does: the warning says nothing to a user.
warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized",
    category=UserWarning,
)


DcpWriter = ChecksumFileSystemWriter | ChecksumFsspecWriter


def dcp_writer(path: str) -> DcpWriter:
    """A DCP writer for a local path or any fsspec URL; after the save, the coordinator's
    ``files`` holds each file's checksum for the commit marker (``checkpoint.integrity``)."""
    return ChecksumFsspecWriter(path) if is_url(path) else ChecksumFileSystemWriter(path)


def dcp_reader(path: str) -> StorageReader:
    """A DCP reader for a local path or any fsspec URL (metadata unpickled safely)."""
    return SafeFsspecReader(path) if is_url(path) else SafeFileSystemReader(path)
