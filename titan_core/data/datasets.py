"""Dataset registry and document sources: one rank's stream of text documents, resumable by row.

A source's rows are split across data-parallel ranks; `iter_from(n)` restarts a rank's stream
after its first n rows (rows, not documents, so empty rows cannot shift a resume). Empty and
undecodable rows are skipped and counted in `stats`, never fatal.
"""

from __future__ import annotations

import itertools
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from titan_core.config.job import Dataloader
from titan_core.data.assets import bundled_corpus_dir
from titan_core.data.sources import raw_rows as _raw_rows
from titan_core.data.sources import short_repr
from titan_core.data.sources import strip_compression as _strip_compression
from titan_core.errors import DataError

TEXT_SUFFIXES = (".txt", ".jsonl", ".json")
# `datasets` builders that read local files: dataset="json" with path=<data files>.
HF_FILE_BUILDERS = ("json", "csv", "parquet", "text", "arrow")


@dataclass(frozen=True, kw_only=True)
class DatasetSpec:
    """A registered dataset: a local folder with <split>/ subfolders, or a Hugging Face dataset."""

    description: str
    local_root: Callable[[], Path] | None = None
    """Folder holding one subfolder of .jsonl/.txt files per split (resolved lazily)."""
    hf_path: str = ""
    """Hugging Face dataset name or path, when not local."""
    hf_name: str | None = None
    """Hugging Face config name (e.g. "en" for C4)."""
    text_field: str = "text"
    """Row field holding the document text (overrides the caller's text_field)."""
    splits: tuple[str, ...] = ("train", "validation")
    """Splits the dataset provides."""
    missing_hint: str = ""
    """Appended to the not-found error of a local dataset (how to create it)."""


_REGISTRY: dict[str, DatasetSpec] = {
    "titan_corpus": DatasetSpec(
        description="Bundled offline English corpus (python -m titan_core.data.assets)",
        local_root=bundled_corpus_dir,
        missing_hint="build it with `python -m titan_core.data.assets`",
    ),
    "c4": DatasetSpec(
        description="allenai/c4 'en' from the Hugging Face hub (needs a connection)",
        hf_path="allenai/c4",
        hf_name="en",
    ),
}


def register_dataset(name: str, spec: DatasetSpec, *, overwrite: bool = False) -> None:
    """Make `name` resolvable by build_document_source (e.g. a test copy of a corpus)."""
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"dataset {name!r} is already registered (pass overwrite=True)")
    _REGISTRY[name] = spec


def registered_datasets() -> dict[str, DatasetSpec]:
    """A copy of the registry: name -> spec."""
    return dict(_REGISTRY)


class DocumentStream(Iterator[str]):
    """Iterator over one rank's documents; `position` counts the rank's rows consumed so far."""

    def __init__(self, rows: Iterator[str | None], position: int) -> None:
        self._rows = rows
        self.position = position

    def __iter__(self) -> DocumentStream:
        return self

    def __next__(self) -> str:
        for text in self._rows:
            self.position += 1
            if text is not None:
                return text
        raise StopIteration


class DocumentSource(ABC):
    """One data-parallel rank's share of a dataset's documents."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.stats: dict[str, int] = {"skipped_empty": 0, "skipped_undecodable": 0}
        self.text_field = "text"
        self._fields_checked = False

    @abstractmethod
    def _rows(self, start: int, stats: dict[str, int]) -> Iterator[str | None]:
        """This rank's rows from row `start` on: text, or None for a skipped row."""

    def iter_from(self, doc_index: int = 0) -> DocumentStream:
        """Documents after the first doc_index rows of this rank's stream (exact resume)."""
        return DocumentStream(self._rows(doc_index, self.stats), doc_index)

    def __iter__(self) -> DocumentStream:
        return self.iter_from(0)

    def _text(self, row: Any, stats: dict[str, int], where: str = "") -> str | None:
        """The text of one parsed row (None: skipped and counted); ``where`` names the row in
        errors (default: the source's label). The first row with fields
        must have the text field: a DataError names it and the fields found, instead of a wrong
        ``dataloader.text_field`` skipping every row as empty. Later rows without it are
        skipped like empty ones."""
        if not self._fields_checked and isinstance(row, dict) and row:
            if self.text_field not in row:
                found = ", ".join(repr(str(k)) for k in list(row)[:20])
                raise DataError(
                    f"{self.label}: rows have no field {self.text_field!r} (found: {found}); "
                    "set dataloader.text_field"
                )
            self._fields_checked = True
        return _row_text(row, self.text_field, stats, where or f"{self.label}: a row")

    def check_nonempty(self) -> None:
        """Raise DataError unless this rank's stream yields at least one document."""
        scratch = {"skipped_empty": 0, "skipped_undecodable": 0}  # a peek must not count skips
        if next(DocumentStream(self._rows(0, scratch), 0), None) is None:
            raise DataError(f"{self.label}: no documents (skipped rows: {scratch})")


def _row_text(row: Any, text_field: str, stats: dict[str, int], where: str) -> str | None:
    """A row's text; None (counted as empty) for a null, missing or blank one. A number, list
    or object there is one DataError line (the wrong field, or a broken export), as when the
    data is prepared (``sources.py``)."""
    text = row.get(text_field) if isinstance(row, dict) else None
    if isinstance(text, str) and text.strip():
        return text
    if text is None or isinstance(text, str):
        stats["skipped_empty"] += 1
        return None
    raise DataError(
        f"{where}: field {text_field!r} holds {type(text).__name__} {short_repr(text)}, "
        "expected a string"
    )


class LocalDocumentSource(DocumentSource):
    """Documents from local or fsspec .jsonl/.json/.txt files (optionally compressed).

    jsonl: one row per non-blank line; json: an array of rows (else read as JSON lines); txt: one
    document per blank-line-separated block. Row i (counted across the sorted files) belongs to
    rank i % world_size.
    """

    def __init__(
        self, files: list[str], *, text_field: str, dp_rank: int, dp_world_size: int, label: str
    ) -> None:
        super().__init__(label)
        self.files = files
        self.text_field = text_field
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size

    def _rows(self, start: int, stats: dict[str, int]) -> Iterator[str | None]:
        global_index = mine = 0
        for file in self.files:
            for number, (kind, raw) in enumerate(_raw_rows(file), 1):
                if global_index % self.dp_world_size == self.dp_rank:
                    if mine >= start:  # rows before start are counted, never parsed
                        yield self._parse(kind, raw, stats, f"{file}: row {number}")
                    mine += 1
                global_index += 1

    def _parse(self, kind: str, raw: Any, stats: dict[str, int], where: str) -> str | None:
        if kind == "row":
            return self._text(raw, stats, where)
        try:
            text = raw.decode("utf-8")
            row = text if kind == "txt" else json.loads(text)
        except ValueError:  # UnicodeDecodeError and JSONDecodeError both are ValueErrors
            stats["skipped_undecodable"] += 1
            return None
        return row if kind == "txt" else self._text(row, stats, where)


class HFDocumentSource(DocumentSource):
    """Documents from `datasets.load_dataset`, split across ranks with split_dataset_by_node."""

    def __init__(
        self,
        path: str,
        *,
        name: str | None = None,
        data_files: str | None = None,
        split: str,
        streaming: bool,
        text_field: str,
        dp_rank: int,
        dp_world_size: int,
        label: str,
    ) -> None:
        super().__init__(label)
        import datasets
        from datasets.distributed import split_dataset_by_node

        try:
            ds = datasets.load_dataset(
                path, name=name, data_files=data_files, split=split, streaming=streaming
            )
        # datasets raises many types (hub unreachable, unknown dataset/config/split, bad files);
        # all mean the same to the user: this dataset cannot be read.
        except Exception as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataError(f"{label}: cannot load with `datasets`: {reason}") from e
        if dp_world_size > 1:
            ds = split_dataset_by_node(ds, rank=dp_rank, world_size=dp_world_size)
        self.dataset = ds
        # Streaming .skip(n) after split_dataset_by_node skips n rows of the *global* stream
        # (the node split is applied last), so such sources read past their own rows instead.
        self._skip_by_reading = dp_world_size > 1 and isinstance(ds, datasets.IterableDataset)
        self.text_field = text_field

    def _rows(self, start: int, stats: dict[str, int]) -> Iterator[str | None]:
        rows: Iterator[Any]
        if self._skip_by_reading:
            rows = itertools.islice(iter(self.dataset), start, None)
        else:
            rows = iter(self.dataset.skip(start) if start else self.dataset)
        for row in rows:
            yield self._text(row, stats)


def is_local_dataset(location: str) -> bool:
    """Whether build_document_source reads `location` as local/fsspec files (not a hub name)."""
    if "://" in location:
        return not location.startswith("hf://")
    if os.path.exists(location) or location.startswith(("/", ".", "~")):
        return True
    return _strip_compression(location).endswith(TEXT_SUFFIXES)


def _local_files(location: str, label: str) -> list[str]:
    fs, root = fsspec.core.url_to_fs(os.path.expanduser(location))
    if not fs.exists(root):
        raise DataError(f"{label}: path not found: {location}")
    found = [root] if fs.isfile(root) else sorted(fs.find(root))
    files = [fs.unstrip_protocol(p) if "://" in location else p for p in found]
    files = [f for f in files if _strip_compression(f).endswith(TEXT_SUFFIXES)]
    if not files:
        raise DataError(f"{label}: no {'/'.join(TEXT_SUFFIXES)} files under {location}")
    return files


def _split_location(location: str, split: str, explicit: bool, label: str) -> str:
    """Where a local split lives: <location>/<split>/ if present, else location itself."""
    fs, root = fsspec.core.url_to_fs(os.path.expanduser(location))
    if fs.isdir(f"{root.rstrip('/')}/{split}"):
        return f"{location.rstrip('/')}/{split}"
    if split != "train" and not explicit:
        raise DataError(
            f"{label}: local files have no {split!r} split; give that split its own path "
            f"(validation.dataset) or use a folder with train/ and {split}/ subfolders"
        )
    return location


def build_document_source(
    cfg: Dataloader, *, dp_rank: int = 0, dp_world_size: int = 1
) -> DocumentSource:
    """This rank's documents of ``cfg.dataset``: a registered name, a `datasets` file builder
    ("json" etc., files in ``cfg.path``), a local/fsspec file or folder, else a Hugging Face
    dataset name; ``cfg.split``, ``cfg.text_field`` and ``cfg.streaming`` say what to read.

    ``cfg.path`` overrides where a registered dataset is read from. Local data is one split unless
    it is a folder with <split>/ subfolders: 'train' reads it, and another split (validation) reads
    it only when it came from ``cfg.path`` (a path given for that split), so validation never
    silently re-reads the training files. Registered specs fix their own text_field; `streaming`
    applies to Hugging Face datasets only.
    """
    if dp_world_size < 1 or not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank: expected 0 <= dp_rank < {dp_world_size}, got {dp_rank}")
    dataset, path, split = cfg.dataset, cfg.path, cfg.split
    text_field, streaming = cfg.text_field, cfg.streaming
    where = f" at {path!r}" if path else ""
    rank = f" dp rank {dp_rank}/{dp_world_size}" if dp_world_size > 1 else ""
    label = f"dataset {dataset!r}{where} split {split!r}{rank}"
    ranks = {"dp_rank": dp_rank, "dp_world_size": dp_world_size}
    if dataset in _REGISTRY:
        return _from_spec(_REGISTRY[dataset], path, split, streaming, label, ranks)
    if dataset in HF_FILE_BUILDERS:
        if not path:
            raise DataError(
                f"{label}: the {dataset!r} builder needs dataloader.path (its data files)"
            )
        # The files given are the requested split; `datasets` files them under "train".
        return HFDocumentSource(
            dataset, data_files=path, split="train", streaming=streaming,
            text_field=text_field, label=label, **ranks,
        )  # fmt: skip
    location = cfg.location
    if is_local_dataset(location):
        location = _split_location(location, split, bool(path), label)
        files = _local_files(location, label)
        return LocalDocumentSource(files, text_field=text_field, label=label, **ranks)
    return HFDocumentSource(
        location, split=split, streaming=streaming, text_field=text_field, label=label, **ranks
    )


def _from_spec(
    spec: DatasetSpec,
    path: str,
    split: str,
    streaming: bool,
    label: str,
    ranks: dict[str, int],
) -> DocumentSource:
    if split not in spec.splits:
        raise DataError(f"{label}: unknown split, expected one of {list(spec.splits)}")
    if spec.local_root is None:
        return HFDocumentSource(
            path or spec.hf_path, name=spec.hf_name, split=split, streaming=streaming,
            text_field=spec.text_field, label=label, **ranks,
        )  # fmt: skip
    location = f"{(path or str(spec.local_root())).rstrip('/')}/{split}"
    try:
        files = _local_files(location, label)
    except DataError as e:
        raise DataError(f"{e}{f' ({spec.missing_hint})' if spec.missing_hint else ''}") from None
    return LocalDocumentSource(files, text_field=spec.text_field, label=label, **ranks)
