"""Find a local DCP checkpoint's tensor bytes inside its ``.distcp`` files, without DCP's reader.

DCP's ``FileSystemWriter`` stores every tensor chunk as a complete ``torch.save`` zip at an
(offset, length) its metadata records. ``torch.save`` writes *stored* (uncompressed) zip entries,
so a chunk's elements lie contiguously in the file, little-endian, at an offset found from the
item's zip directory and the pickle that describes the tensor. This module reads those small
structures (the pickle is parsed by an unpickler that builds nothing and accepts only the names
``torch.save`` uses for a plain tensor) and checks every fact the converter relies on: dtype,
shape, contiguity, bounds, byte order, no compression and no DCP stream transforms.

``locate`` answers for whole tensors stored as one chunk or as dim-0 slices (FSDP); anything else
(remote URLs, column-split chunks, an unexpected pickle, a damaged item) is simply not located,
and the caller reads it through ``torch.distributed.checkpoint``, which also reports damage.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import pickle
import struct
import sys
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from titan_core import storage

# torch.save pickles a storage's class by name; these are the float types a model may hold.
_STORAGE_DTYPES = {
    "FloatStorage": torch.float32,
    "BFloat16Storage": torch.bfloat16,
    "HalfStorage": torch.float16,
    "DoubleStorage": torch.float64,
}
# zip records, laid out as zipfile's own structEndArchive / structCentralDir / structFileHeader
_END, _END_MAGIC = struct.Struct("<4s4H2LH"), b"PK\x05\x06"
_CENTRAL, _CENTRAL_MAGIC = struct.Struct("<4s4B4HL2L5H2L"), b"PK\x01\x02"
_LOCAL, _LOCAL_MAGIC = struct.Struct("<4s2B4HL2L2H"), b"PK\x03\x04"


@dataclass(frozen=True)
class RowBlock:
    """``rows`` consecutive dim-0 rows of a tensor, stored contiguously at ``offset``."""

    path: str  # file name inside the checkpoint directory
    offset: int  # byte offset of the first element in that file
    rows: int


@dataclass(frozen=True)
class StoredTensor:
    """A whole tensor as its bytes lie in the checkpoint: row blocks in row order."""

    name: str  # the key in the checkpoint, e.g. model.layers.0.attention.wq.weight
    dtype: torch.dtype
    shape: tuple[int, ...]
    blocks: tuple[RowBlock, ...]

    @property
    def row_bytes(self) -> int:
        """Bytes of one dim-0 row (the whole tensor for a 0-d one)."""
        return torch.Size(self.shape[1:]).numel() * self.dtype.itemsize


class _Storage:
    """What a pickled persistent storage id stands for (nothing is allocated)."""

    def __init__(self, dtype: torch.dtype, key: str, numel: int) -> None:
        self.dtype, self.key, self.numel = dtype, key, numel


class _Tensor:
    """The arguments of ``torch._utils._rebuild_tensor_v2``, recorded instead of run."""

    def __init__(self, storage: Any, offset: Any, size: Any, stride: Any, *_: Any) -> None:
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride


class _TensorPickle(pickle.Unpickler):
    """Reads the pickle ``torch.save`` writes for one plain tensor and refuses anything else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _Tensor
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict  # the (empty) backward-hooks argument
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise pickle.UnpicklingError(f"unexpected global {module}.{name}")

    def persistent_load(self, pid: Any) -> _Storage:
        kind, dtype, key, location, numel = pid
        if kind != "storage" or not isinstance(dtype, torch.dtype) or location != "cpu":
            raise pickle.UnpicklingError(f"unexpected storage {pid!r}")
        return _Storage(dtype, str(key), int(numel))


class _Slice:
    """A read-only file object over ``view[start:start + length]`` (what zipfile needs)."""

    def __init__(self, view: mmap.mmap, start: int, length: int) -> None:
        self.view, self.start, self.length, self.pos = view, start, length, 0

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos + (0, self.pos, self.length)[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = self.length if n < 0 else min(self.length, self.pos + n)
        data = self.view[self.start + self.pos : self.start + end]
        self.pos = max(self.pos, end)
        return data

    def seekable(self) -> bool:
        return True


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(size):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


@dataclass(frozen=True)
class _Entry:
    """One zip member: where its local header is, its size, method, flags and CRC."""

    header: int  # offset of the local header from the start of the zip
    size: int
    method: int
    flags: int
    crc: int


def _zip_entries(view: mmap.mmap, offset: int, length: int) -> dict[str, _Entry]:
    """The members of the zip at ``view[offset:offset + length]``, read from its directory."""
    end = offset + length
    sig, _, _, _, count, _, cd_offset, comment = _END.unpack(view[end - _END.size : end])
    plain = sig == _END_MAGIC and not comment and count != 0xFFFF and cd_offset != 0xFFFFFFFF
    entries, pos = {}, offset + cd_offset
    for _ in range(count if plain else 0):
        f = _CENTRAL.unpack(view[pos : pos + _CENTRAL.size])
        if f[0] != _CENTRAL_MAGIC:
            raise ValueError("bad central directory entry")
        if 0xFFFFFFFF in (f[10], f[11], f[18]):
            plain = False  # zip64 sizes or offsets
            break
        if f[10] != f[11]:
            raise ValueError("compressed member")
        name = view[pos + _CENTRAL.size : pos + _CENTRAL.size + f[12]].decode()
        entries[name] = _Entry(f[18], f[11], f[6], f[5], f[9])
        pos += _CENTRAL.size + f[12] + f[13] + f[14]
    if plain:
        return entries
    # zip64 (an item over 4 GB) or an archive comment: zipfile reads such directories.
    with zipfile.ZipFile(_Slice(view, offset, length)) as zf:
        if any(i.compress_size != i.file_size for i in zf.infolist()):
            raise ValueError("compressed member")
        return {
            i.filename: _Entry(i.header_offset, i.file_size, i.compress_type, i.flag_bits, i.CRC)
            for i in zf.infolist()
        }


def _member(view: mmap.mmap, offset: int, length: int, entry: _Entry) -> int:
    """Offset (from the zip's start) of a stored member's bytes, checked to lie in the zip."""
    at = offset + entry.header
    fields = _LOCAL.unpack(view[at : at + _LOCAL.size])
    if fields[0] != _LOCAL_MAGIC or entry.method != zipfile.ZIP_STORED or entry.flags & 0x1:
        raise ValueError("not a stored, unencrypted member")
    start = entry.header + _LOCAL.size + fields[10] + fields[11]
    if start + entry.size > length:
        raise ValueError("member beyond the end of the item")
    return start


def _read_member(view: mmap.mmap, offset: int, length: int, entry: _Entry) -> bytes:
    start = offset + _member(view, offset, length, entry)
    data = view[start : start + entry.size]
    if zlib.crc32(data) != entry.crc:
        raise ValueError("CRC mismatch")
    return data


def _payload_offset(view: mmap.mmap, offset: int, length: int, chunk: Any, dtype: Any) -> int:
    """File offset of the elements of the ``torch.save`` item at ``view[offset:offset+length]``.

    ValueError (or a pickle error) when the item is not exactly a plain contiguous tensor of
    ``chunk.sizes`` and ``dtype`` stored uncompressed in little-endian order.
    """
    entries = _zip_entries(view, offset, length)
    (pkl,) = [n for n in entries if n.endswith("/data.pkl")]
    prefix = pkl.removesuffix("data.pkl")
    byteorder = _read_member(view, offset, length, entries[f"{prefix}byteorder"])
    if byteorder != b"little" or sys.byteorder != "little":
        raise ValueError("not little-endian")
    tensor = _TensorPickle(io.BytesIO(_read_member(view, offset, length, entries[pkl]))).load()
    if not isinstance(tensor, _Tensor) or not isinstance(tensor.storage, _Storage):
        raise ValueError("not a plain tensor")
    size, stride = tuple(tensor.size), tuple(tensor.stride)
    if tensor.storage.dtype != dtype or size != tuple(chunk.sizes):
        raise ValueError(f"holds {tensor.storage.dtype} {size}, expected {dtype} {chunk.sizes}")
    if any(s != c and n != 1 for s, c, n in zip(stride, _contiguous_strides(size), size)):
        raise ValueError(f"non-contiguous strides {stride}")
    if tensor.offset < 0 or tensor.offset + torch.Size(size).numel() > tensor.storage.numel:
        raise ValueError("tensor outside its storage")
    entry = entries[f"{prefix}data/{tensor.storage.key}"]
    if entry.size < tensor.storage.numel * dtype.itemsize:
        raise ValueError("storage entry too short")
    start = _member(view, offset, length, entry)
    return offset + start + tensor.offset * dtype.itemsize


def _row_blocks(md: TensorStorageMetadata) -> Iterator[Any]:
    """The chunks of a tensor in dim-0 order; ValueError unless they tile it by whole rows."""
    shape = tuple(md.size)
    if not shape:
        if len(md.chunks) != 1:
            raise ValueError("0-d tensor in several chunks")
        yield md.chunks[0]
        return
    row = 0
    for chunk in sorted(md.chunks, key=lambda c: c.offsets[0]):
        if chunk.sizes[0] == 0:
            continue
        if chunk.offsets[0] != row or any(chunk.offsets[1:]) or chunk.sizes[1:] != shape[1:]:
            raise ValueError("chunks are not whole dim-0 slices")
        row += chunk.sizes[0]
        yield chunk
    if row != shape[0]:
        raise ValueError("chunks do not cover the tensor")


def drop_pages(view: mmap.mmap, start: int, nbytes: int) -> None:
    """Unmap ``view[start:start + nbytes]`` (whole pages) so that RSS stays small; the pages
    stay in the page cache and a later access maps them again. A no-op where unsupported."""
    if nbytes > 0 and hasattr(mmap, "MADV_DONTNEED"):
        aligned = start - start % mmap.PAGESIZE
        view.madvise(mmap.MADV_DONTNEED, aligned, start + nbytes - aligned)


class DataFiles:
    """The checkpoint's data files, each opened once: a descriptor and a private read mapping."""

    def __init__(self, checkpoint: str) -> None:
        self.root = checkpoint.removeprefix("file://")
        self._open: dict[str, tuple[int, mmap.mmap]] = {}

    def get(self, path: str) -> tuple[int, mmap.mmap]:
        """(fd, mapping) of the file ``path`` inside the checkpoint."""
        if path not in self._open:
            fd = os.open(os.path.join(self.root, path), os.O_RDONLY)
            try:
                if hasattr(os, "posix_fadvise"):  # Linux; a hint for cold reads
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                # ACCESS_COPY: writable as far as torch.frombuffer knows; never written to.
                self._open[path] = (fd, mmap.mmap(fd, 0, access=mmap.ACCESS_COPY))
            except BaseException:
                os.close(fd)
                raise
        return self._open[path]

    def drop_pages(self) -> None:
        """Unmap every page touched so far (they stay in the page cache), to keep RSS small."""
        for _, view in self._open.values():
            drop_pages(view, 0, len(view))

    def close(self) -> None:
        """Unmap and close everything (a mapping still viewed by a tensor is left to the GC)."""
        for fd, view in self._open.values():
            with contextlib.suppress(BufferError):
                view.close()
            os.close(fd)
        self._open.clear()


def locate(
    checkpoint: str, metadata: Any, names: list[str], files: DataFiles
) -> dict[str, StoredTensor]:
    """Where each named tensor's bytes lie, for those this module can vouch for.

    Empty for remote checkpoints; a tensor left out is one to read through DCP.
    """
    if storage.is_url(checkpoint):
        return {}
    found = {}
    for name in names:
        md = metadata.state_dict_metadata[name]
        try:
            blocks = []
            for chunk in _row_blocks(md):
                info = metadata.storage_data[MetadataIndex(name, chunk.offsets)]
                if info.transform_descriptors:
                    raise ValueError("stream transforms")
                _, view = files.get(info.relative_path)
                if info.offset + info.length > len(view):
                    raise ValueError("item beyond the end of its file")
                start = _payload_offset(view, info.offset, info.length, chunk, md.properties.dtype)
                rows = chunk.sizes[0] if chunk.sizes else 1
                blocks.append(RowBlock(info.relative_path, start, rows))
        except Exception:  # anything unexpected: the DCP reader takes it and reports damage
            continue
        found[name] = StoredTensor(name, md.properties.dtype, tuple(md.size), tuple(blocks))
    files.drop_pages()  # the zip directories just read
    return found
