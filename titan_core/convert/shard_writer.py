"""Write one safetensors file front to back, every output byte written once.

The format is an 8-byte little-endian header length, a JSON header (names, dtypes, shapes, byte
ranges; space-padded to 8 bytes) and the raw little-endian tensor data. The header is built from
the planned shapes, so tensors are streamed straight into the file: bytes that need no change
(same dtype, no row reordering) are copied file to file by the kernel (``copy_file_range``, what
``shutil.copyfile`` does) when their offsets allow it cheaply, else through one cache-sized
buffer; the rest is cast or row-reordered from a read-only mapping of the checkpoint into small
reused buffers. Everything is appended with large sequential writes, nothing is fsynced.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import struct
from types import TracebackType

import torch

from titan_core.convert.dcp_direct import DataFiles, RowBlock, StoredTensor, drop_pages
from titan_core.errors import CheckpointError

SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
}
CHUNK_BYTES = 8 << 20  # source bytes per cast / reorder step: big writes, small hot buffers
COPY_BYTES = 1 << 20  # per unchanged read + write: stays in the CPU cache between the two
_PAGE = mmap.PAGESIZE
# copy_file_range refusals that mean "not between these files" (other filesystems, old kernels)
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM}


def safetensors_header(
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]
) -> bytes:
    """The length prefix and JSON header for tensors laid out back to back in ``entries`` order."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in entries:
        end = offset + torch.Size(shape).numel() * dtype.itemsize
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, end],
        }
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


class ShardWriter:
    """A safetensors file being written: the header at once, then the tensors in header order.

    ``write_tensor`` takes an in-memory tensor; ``write_stored`` a tensor still in the checkpoint
    (``scratch`` holds its buffers; pass the same dict to every shard of a conversion). On
    leaving, the file must hold exactly the planned bytes (an internal invariant).
    """

    def __init__(
        self,
        path: str,
        entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
        files: DataFiles,
        scratch: dict[str, torch.Tensor] | None = None,
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.path = path
        self.header = safetensors_header(entries, metadata or {"format": "pt"})
        self.size = len(self.header) + sum(
            torch.Size(s).numel() * d.itemsize for _, d, s in entries
        )
        self.files = files
        self._kernel_copy = hasattr(os, "copy_file_range")  # Linux
        self._scratch = {} if scratch is None else scratch  # reused, also by later shards
        self.fd = -1

    def __enter__(self) -> ShardWriter:
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        self.write(self.header)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        written = os.lseek(self.fd, 0, os.SEEK_CUR)
        os.close(self.fd)
        assert exc_type is not None or written == self.size, (self.path, written, self.size)

    def write(self, data: object) -> None:
        """Append a bytes-like object (looping over short writes)."""
        view = memoryview(data).cast("B")  # type: ignore[arg-type]
        while view:
            view = view[os.write(self.fd, view) :]

    def write_tensor(self, tensor: torch.Tensor) -> None:
        """Append an in-memory tensor's bytes."""
        self.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())

    def write_stored(
        self, tensor: StoredTensor, dtype: torch.dtype, order: torch.Tensor | None
    ) -> None:
        """Append a stored tensor in ``dtype`` with its rows in ``order`` (None: as stored)."""
        if order is None:
            for block in tensor.blocks:
                if dtype == tensor.dtype:
                    self._copy(block, block.rows * tensor.row_bytes)
                else:
                    self._cast_rows(tensor, block, dtype)
            return
        if len(tensor.blocks) == 1:
            source = self._view(tensor.blocks[0], tensor, 0, tensor.blocks[0].rows)
        else:  # dim-0 slices saved by several ranks: gathered once, in a reused buffer
            source = self._assemble(tensor)
        rows_per_step = max(1, CHUNK_BYTES // max(1, tensor.row_bytes))
        for start in range(0, len(order), rows_per_step):
            index = order[start : start + rows_per_step]
            gathered = self._buffer("gather", len(index), tensor.dtype, tensor.shape)
            torch.index_select(source, 0, index, out=gathered)
            self._emit(gathered, dtype)
        del source
        for block in tensor.blocks:
            self._drop_pages(block, 0, block.rows * tensor.row_bytes)

    # ------------------------------------------------------------ helpers
    def _buffer(
        self, name: str, rows: int, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """A reused buffer viewed as ``rows`` rows of ``shape[1:]`` in ``dtype``."""
        row_shape = shape[1:]
        nbytes = rows * torch.Size(row_shape).numel() * dtype.itemsize
        if name not in self._scratch or self._scratch[name].numel() < nbytes:
            self._scratch[name] = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch[name][:nbytes].view(dtype).view(rows, *row_shape)

    def _emit(self, rows: torch.Tensor, dtype: torch.dtype) -> None:
        if rows.dtype != dtype:
            cast = self._buffer("cast", rows.shape[0], dtype, tuple(rows.shape))
            rows = cast.copy_(rows)
        self.write(rows.reshape(-1).view(torch.uint8).numpy())

    def _view(self, block: RowBlock, tensor: StoredTensor, first: int, rows: int) -> torch.Tensor:
        """Rows ``first:first + rows`` of a block, viewed in place in the checkpoint's mapping."""
        _, mapping = self.files.get(block.path)
        elems = torch.Size(tensor.shape[1:]).numel()
        flat = torch.frombuffer(
            mapping,
            dtype=tensor.dtype,
            count=rows * elems,
            offset=block.offset + first * tensor.row_bytes,
        )
        return flat.view(rows, *tensor.shape[1:])

    def _drop_pages(self, block: RowBlock, first: int, nbytes: int) -> None:
        drop_pages(self.files.get(block.path)[1], block.offset + first, nbytes)

    def _cast_rows(self, tensor: StoredTensor, block: RowBlock, dtype: torch.dtype) -> None:
        rows_per_step = max(1, CHUNK_BYTES // max(1, tensor.row_bytes))
        for first in range(0, block.rows, rows_per_step):
            count = min(rows_per_step, block.rows - first)
            rows = self._view(block, tensor, first, count)
            self._emit(rows, dtype)
            del rows
            self._drop_pages(block, first * tensor.row_bytes, count * tensor.row_bytes)

    def _assemble(self, tensor: StoredTensor) -> torch.Tensor:
        """The whole tensor, its blocks copied one after the other into a reused buffer."""
        whole = self._buffer("assemble", tensor.shape[0], tensor.dtype, tensor.shape)
        row = 0
        for block in tensor.blocks:
            whole[row : row + block.rows].copy_(self._view(block, tensor, 0, block.rows))
            row += block.rows
        return whole

    def _copy(self, block: RowBlock, nbytes: int) -> None:
        """Append ``nbytes`` from a block unchanged.

        ``copy_file_range`` (file to file in the kernel, as copytree) is the cheapest copy when
        source and destination offsets sit at the same place in a page; otherwise (the usual
        case: a .distcp item's payload lands at any offset of the shard) it costs ~10% more CPU
        here than reading into one cache-sized buffer and writing it out again.
        """
        fd, _ = self.files.get(block.path)
        offset, end = block.offset, block.offset + nbytes
        aligned = (offset - os.lseek(self.fd, 0, os.SEEK_CUR)) % _PAGE == 0
        while self._kernel_copy and aligned and offset < end:
            try:
                n = os.copy_file_range(fd, self.fd, end - offset, offset)
            except OSError as e:
                if e.errno not in _NO_KERNEL_COPY:
                    raise
                self._kernel_copy = False
                break
            if n == 0:
                raise CheckpointError(f"checkpoint: {block.path} ended while being read")
            offset += n
        if offset < end:
            buffer = self._buffer("copy", min(COPY_BYTES, end - offset), torch.uint8, (0,))
            view = memoryview(buffer.numpy())
            while offset < end:
                n = os.preadv(fd, [view[: end - offset]], offset)
                if n == 0:
                    raise CheckpointError(f"checkpoint: {block.path} ended while being read")
                self.write(view[:n])
                offset += n
