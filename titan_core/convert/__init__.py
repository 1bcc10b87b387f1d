"""Checkpoint conversion between DCP (the engine's format) and Hugging Face folders.

* ``titan_core.convert.dcp_to_hf.dcp_to_hf``: stream a DCP checkpoint (any sharding, local or
  fsspec URL) into sharded safetensors + config + tokenizer that ``transformers`` opens as is.
* ``titan_core.convert.hf_to_dcp.hf_to_dcp``: an HF Llama folder to a model-only DCP checkpoint;
  the folder is read by ``titan_core.checkpoint.hf_weights``, whose ``load_hf_into_model`` feeds
  HF weights to a (sharded) model directly.
* ``titan_core.convert.hf_tokenizer.export_hf_tokenizer``: the tiktoken BPE as HF tokenizer files.
* ``titan_core.cli.convert.main``: ``titan convert dcp-to-hf|hf-to-dcp``.
* ``dcp_direct`` (where a local checkpoint's tensor bytes lie in its ``.distcp`` files) and
  ``shard_writer`` (safetensors files written front to back) make dcp-to-hf a streaming copy.

This module holds what both directions share: ``StagedOutput`` (atomic output folders),
``storage_errors``, ``one_intra_op_thread``, ``progress_bar`` and ``format_size`` (a model's
``expected_shapes`` and the HF file names are ``checkpoint.hf_weights``'s). The
converters are not re-exported here: ``titan_core.convert.dcp_to_hf`` must stay the module, not
the function of the same name, so that ``mock.patch`` paths and ``import ... as`` resolve.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from types import TracebackType

import torch

from titan_core import errors, storage
from titan_core.errors import CheckpointError


def storage_errors(path: str) -> contextlib.AbstractContextManager[None]:
    """Storage failures under ``path`` as one CheckpointError line."""
    return errors.storage_errors(path, CheckpointError)


@contextlib.contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """Run torch ops on one thread, then restore the caller's setting.

    Conversion is memory-bound copying of MB-sized tensors, where intra-op threads only add
    fork/join cost: on the 2-core dev machines a 1 MB permuted copy takes 8 ms on 2 threads and
    0.1 ms on one.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextlib.contextmanager
def progress_bar(label: str, total: int, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A bytes progress bar on stderr (rich); draws nothing when disabled."""
    if not enabled:  # and does not import rich (~0.2 s) either
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn(label),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task("convert", total=total)
        yield lambda n: bar.advance(task, n)


def format_size(nbytes: int) -> str:
    """Human-readable decimal size, e.g. ``12.3 MB``."""
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1000 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    raise AssertionError("unreachable")


class StagedOutput:
    """Build an output folder out of sight, then publish it whole (or leave nothing).

    Files accumulate under ``staging``: a hidden sibling directory for local outputs, renamed
    onto ``output`` at the end; or a sibling ``.tmp-*`` prefix for URLs, whose objects are
    moved under ``output`` at the end with ``last`` (the file that marks completion) moved last.
    ``local_path(name)`` + ``commit(name)`` let callers write a file locally and push it there.
    """

    def __init__(self, output: str, *, last: str) -> None:
        self.output = output.removeprefix("file://").rstrip("/")
        self.last = last
        self.is_url = storage.is_url(self.output)
        self.fs, self._path = storage.filesystem(self.output)
        suffix = f".tmp-{uuid.uuid4().hex[:12]}"
        parent, base = os.path.split(os.path.abspath(self.output))
        self.staging = (
            f"{self.output}{suffix}" if self.is_url else os.path.join(parent, f".{base}{suffix}")
        )
        self.local_dir = ""

    def __enter__(self) -> StagedOutput:
        with storage_errors(self.output):
            if self.fs.exists(self._path) and (
                self.fs.isfile(self._path) or self.fs.ls(self._path)
            ):
                raise CheckpointError(f"output: {self.output} already exists and is not empty")
            if self.is_url:
                self.local_dir = tempfile.mkdtemp(prefix="titan-convert-")
            else:
                os.makedirs(self.staging)
                self.local_dir = self.staging
        return self

    def local_path(self, name: str) -> str:
        """Local file to write ``name`` to before ``commit(name)``."""
        return os.path.join(self.local_dir, name)

    def commit(self, name: str) -> None:
        """Move the local file ``name`` into the staging area (a no-op for local outputs)."""
        if self.is_url:
            with storage_errors(self.staging):
                self.fs.put_file(self.local_path(name), storage.join(self.staging, name))
            os.remove(self.local_path(name))

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if exc_type is None:
                self._publish()
        finally:
            if self.is_url:
                shutil.rmtree(self.local_dir, ignore_errors=True)
            if exc_type is not None or self.is_url:
                with contextlib.suppress(Exception):
                    storage.remove_tree(self.staging)

    def _publish(self) -> None:
        if not self.is_url:
            with storage_errors(self.output):
                if os.path.isdir(self.output):
                    os.rmdir(self.output)  # an empty directory the user made for us
                os.rename(self.staging, self.output)  # atomic: same parent directory
            return
        staged_root = storage.filesystem(self.staging)[1]
        try:
            with storage_errors(self.output):
                files = self.fs.find(staged_root)
                for src in sorted(files, key=lambda p: p.endswith("/" + self.last)):
                    self.fs.mv(src, f"{self._path}/{src[len(staged_root) :].lstrip('/')}")
        except BaseException:
            # Object stores have no rename: undo a half-done move rather than leave a torso.
            with contextlib.suppress(Exception):
                storage.remove_tree(self.output)
            raise
