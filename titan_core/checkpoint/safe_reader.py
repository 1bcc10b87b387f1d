"""DCP readers that never run code from a checkpoint.

DCP describes a checkpoint in a pickled ``.metadata`` file and reads it with ``pickle.load``,
which calls whatever the file names: a planted checkpoint could execute code when a job
resumes. These readers unpickle it with an allow-list of the classes that describe a
checkpoint (tensor layouts, chunk offsets, storage locations) and refuse anything else.
Entries are read by ``states.LoadPlanner``, which admits tensors and plain values only. Where the
commit marker lists a checksum for the file (``checkpoint.integrity``), bytes that do not match
it are refused before they are unpickled at all.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import posixpath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from titan_core.checkpoint.integrity import check_bytes, marker_files
from titan_core.errors import CheckpointError

_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # called with a layout's name
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}
_KNOWN = {
    ("torch", torch),
    ("torch.serialization", torch.serialization),
    ("torch.distributed.checkpoint.filesystem", dcp_filesystem),
    ("torch.distributed.checkpoint.metadata", dcp_metadata),
    ("pathlib", pathlib),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata only: its classes, torch dtypes and sizes, paths."""

    def find_class(self, module: str, name: str) -> Any:
        """The named global if it may appear in checkpoint metadata; else UnpicklingError."""
        obj = getattr(dict(_KNOWN).get(module), name, None)
        metadata_class = module == dcp_metadata.__name__ and isinstance(obj, type)
        dtype = module == "torch" and isinstance(obj, torch.dtype)
        if obj is None or not (metadata_class or dtype or (module, name) in _ALLOWED):
            raise pickle.UnpicklingError(f"unexpected global {module}.{name}")
        return obj


class _SafeMetadata:
    """Replaces ``read_metadata`` of a DCP file reader (same file, same result)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, checked against the commit marker's checksum (if it
        lists one), then unpickled through the allow-list."""
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            data = f.read()
        name = posixpath.basename(os.fspath(path))
        check_bytes(str(path), data, marker_files(os.fspath(self.path)).get(name))
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"checkpoint: {path} is not DCP metadata ({e})") from e
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"checkpoint: {path} is not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeFileSystemReader(_SafeMetadata, FileSystemReader):
    """``FileSystemReader`` with allow-listed metadata unpickling."""


class SafeFsspecReader(_SafeMetadata, FsspecReader):
    """``FsspecReader`` with allow-listed metadata unpickling."""
