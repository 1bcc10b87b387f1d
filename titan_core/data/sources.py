"""Raw sources of data preparation: parse a source, list and fingerprint its files, read them.

A source is a local path or fsspec URL (a file, or a folder read recursively in sorted order) of
.txt/.jsonl/.json/.parquet files, optionally compressed (.gz/.bz2/.xz/.zst), or a Hugging Face
dataset ``hf:NAME?name=CONFIG&split=SPLIT&revision=REV`` read with ``datasets`` in streaming mode,
one unit of work per shard of its ``IterableDataset``.

Files are read with plain readers (lines of jsonl, a json array, blank-line-separated txt blocks,
pyarrow's ``ParquetFile.iter_batches`` over the text column only) instead of
``datasets.load_dataset``: a unit of work is one file whose documents are exactly its rows or
blocks, in file order, so document boundaries and the held-out split are exact and stable; and
nothing is copied into an Arrow cache first (a non-streaming ``load_dataset`` writes the whole
corpus again under ~/.cache before the first token). Hub datasets have no such files to read
directly, so they go through ``datasets``.

Empty and undecodable rows are skipped and counted; a text field that the rows do not have is a
DataError naming the field and the file.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode

import fsspec

from titan_core.data.shards import MANIFEST, SHARD_DIR, SourceFile, storage_errors
from titan_core.errors import DataError, first_line

DOC_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
HF_PREFIX = "hf:"
_HF_KEYS = ("name", "split", "revision")
_PARQUET_BATCH_ROWS = 1024
# fs.info keys that tell versions of an object apart, most specific first (S3, GCS, local...).
_VERSION_KEYS = ("ETag", "etag", "md5Hash", "mtime", "LastModified", "last_modified", "updated")
_VERSION_KEYS += ("created",)


def new_stats() -> dict[str, int]:
    """Counters of rows a reader skipped."""
    return {"skipped_empty": 0, "skipped_undecodable": 0}


def strip_compression(name: str) -> str:
    """``name`` without its compression suffixes (``a.jsonl.gz`` -> ``a.jsonl``)."""
    for ext in COMPRESSIONS:
        name = name.removesuffix(ext)
    return name


def is_document_file(name: str) -> bool:
    """Whether data preparation reads ``name`` (by suffix, compressed or not)."""
    return strip_compression(name).endswith(DOC_SUFFIXES)


def filesystem(location: str) -> tuple[Any, str]:
    try:
        return fsspec.core.url_to_fs(os.path.expanduser(location))
    except (ValueError, ImportError) as e:  # unknown protocol / its package not installed
        raise DataError(f"{location}: unknown source ({first_line(e)})") from None


def _is_url(location: str) -> bool:
    return "://" in location and not location.startswith("file://")


def normalize_source(source: str) -> str:
    """The canonical form of ``source``: local paths absolute, hf: specs with sorted options."""
    source = source.strip()
    if source.startswith(HF_PREFIX):
        return HFSource.parse(source).canonical()
    if _is_url(source):
        return source.rstrip("/") or source
    return os.path.abspath(os.path.expanduser(source.removeprefix("file://")))


# --------------------------------------------------------------------------- listing


def list_source(source: str) -> list[SourceFile]:
    """Every unit of work of ``source`` in stream order, with size and version (``unit`` is left
    empty: ids are the dataset's business). DataError when the source is unknown or empty."""
    if source.startswith(HF_PREFIX):
        return HFSource.parse(source).list_shards()
    fs, root = filesystem(source)
    with storage_errors(source):
        try:
            info = fs.info(root)  # not fs.exists: it reads denied access as "not found"
        except FileNotFoundError:
            raise DataError(f"{source}: source not found (no such file or folder)") from None
        if info.get("type") == "file":
            if not is_document_file(root):
                raise DataError(
                    f"{source}: not a {'/'.join(DOC_SUFFIXES)} file (compressed "
                    f"{'/'.join(COMPRESSIONS)} too)"
                )
            found = {root: info}
        else:
            found = fs.find(root, detail=True)
            # A symlinked file is listed as "other" (lstat): follow it, as reading it will.
            found = {
                p: fs.info(p) if i.get("islink") and i.get("type") != "file" else i
                for p, i in found.items()
            }
    files = [
        SourceFile(
            unit="",
            url=fs.unstrip_protocol(path) if _is_url(source) else path,
            size=int(entry.get("size") or 0),
            version=_version(entry),
        )
        for path, entry in sorted(found.items())
        if entry.get("type", "file") == "file" and is_document_file(path)
        and not _is_prepared_manifest(path, found)
    ]  # fmt: skip
    if not files:
        raise DataError(
            f"{source}: empty source (no {'/'.join(DOC_SUFFIXES)} files, compressed "
            f"{'/'.join(COMPRESSIONS)} too)"
        )
    return files


def _is_prepared_manifest(path: str, found: dict[str, Any]) -> bool:
    """A prepared dataset inside a source folder: its manifest.json is not a document file."""
    if posixpath.basename(path) != MANIFEST:
        return False
    shards = posixpath.join(posixpath.dirname(path), SHARD_DIR) + "/"
    return any(p.startswith(shards) for p in found)


def _version(info: dict[str, Any]) -> str:
    for key in _VERSION_KEYS:
        value = info.get(key)
        if value not in (None, ""):
            return repr(value) if isinstance(value, float) else str(value).strip('"')
    return ""


def file_identity(url: str) -> SourceFile:
    """Size and version of one source file now (for a unit to check it is still the same)."""
    if url.startswith(HF_PREFIX):
        version, _ = HFSource.parse_shard(url)[0].load()
        return SourceFile(unit="", url=url, version=version)
    fs, path = filesystem(url)
    with storage_errors(url):
        info = fs.info(path)
    return SourceFile(unit="", url=url, size=int(info.get("size") or 0), version=_version(info))


# --------------------------------------------------------------------------- reading


def read_documents(url: str, text_field: str, stats: dict[str, int] | None = None) -> Iterator[str]:
    """The documents of one unit of work (a file or an ``hf:…#shard=i/n``), in order."""
    stats = new_stats() if stats is None else stats
    if url.startswith(HF_PREFIX):
        spec, index, num_shards = HFSource.parse_shard(url)
        yield from spec.read_shard(index, num_shards, text_field, stats)
        return
    name = strip_compression(url)
    if url.endswith(".zst") and "zstd" not in fsspec.compression.compr:
        raise DataError(f"{url}: reading .zst files needs the zstandard package")
    with storage_errors(url):
        if name.endswith(".parquet"):
            yield from _parquet_documents(url, text_field, stats)
            return
        if name.endswith(".txt"):
            for _, block in raw_rows(url):
                try:
                    yield block.decode("utf-8")
                except UnicodeDecodeError:
                    stats["skipped_undecodable"] += 1
            return
        rows = (row for kind, raw in raw_rows(url) for row in _parse_rows(kind, raw, stats))
        yield from _row_documents(rows, url, text_field, stats)


def _parse_rows(kind: str, raw: Any, stats: dict[str, int]) -> Iterator[Any]:
    if kind == "row":
        yield raw
        return
    try:
        yield json.loads(raw.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError and JSONDecodeError both are ValueErrors
        stats["skipped_undecodable"] += 1


class _FieldCheck:
    """Checks the first non-empty row of a unit for the text field (later rows lacking it are
    counted as empty: a source whose rows never had the field is a config error, one odd row
    is not)."""

    def __init__(self, where: str, text_field: str) -> None:
        self.where, self.text_field, self.done = where, text_field, False

    def __call__(self, row: Any) -> None:
        if self.done:
            return
        if not isinstance(row, dict):
            raise DataError(
                f"{self.where}: rows are {type(row).__name__}s, expected objects with a "
                f"{self.text_field!r} field"
            )
        if row:
            self.check_fields(list(row))

    def check_fields(self, fields: list[str]) -> None:
        """DataError unless ``fields`` include the text field."""
        if self.text_field not in fields:
            raise DataError(
                f"{self.where}: rows have no field {self.text_field!r} (fields: "
                f"{', '.join(map(str, fields))}); set data.text_field (--text-field)"
            )
        self.done = True


def _row_documents(
    rows: Iterator[Any], where: str, text_field: str, stats: dict[str, int], *, check: Any = None
) -> Iterator[str]:
    check = check if check is not None else _FieldCheck(where, text_field)
    for number, row in enumerate(rows, 1):
        check(row)
        text = row.get(text_field) if isinstance(row, dict) else None
        if isinstance(text, str) and text.strip():
            yield text
        elif text is None or isinstance(text, str):  # no text (null, missing) or blank
            stats["skipped_empty"] += 1
        else:  # a number, a list, an object: the wrong field, or a broken export
            raise DataError(
                f"{where}: row {number}: field {text_field!r} holds {type(text).__name__} "
                f"{short_repr(text)}, expected a string"
            )


def short_repr(value: Any) -> str:
    """``repr(value)``, cut to 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _parquet_documents(url: str, text_field: str, stats: dict[str, int]) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with fsspec.open(os.path.expanduser(url), "rb", compression="infer") as f:
        try:
            parquet = pq.ParquetFile(f)
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{url}: not a readable parquet file ({first_line(e)})") from None
        schema = parquet.schema_arrow
        _FieldCheck(url, text_field).check_fields(schema.names)
        kind = schema.field(text_field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise DataError(f"{url}: field {text_field!r} holds {kind}, expected strings")
        for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[text_field]):
            for text in batch.column(0).to_pylist():
                if text is not None and text.strip():
                    yield text
                else:
                    stats["skipped_empty"] += 1


def raw_rows(file: str) -> Iterator[tuple[str, Any]]:
    """(kind, raw) per row: ("txt", block bytes), ("jsonl", line bytes) or ("row", parsed row).

    A compressed file that is not what its extension says (or is cut short) is one DataError
    line naming it, wherever reading stops."""
    suffix = file.rsplit(".", 1)[-1]
    compressed = strip_compression(file) != file
    try:
        yield from _raw_rows(file)
    except DataError:
        raise
    except Exception as e:
        if not (compressed and _is_decompression_error(e)):
            raise
        raise DataError(
            f"{file}: not a readable .{suffix} file ({type(e).__name__}: {first_line(e)})"
        ) from None


def _is_decompression_error(e: Exception) -> bool:
    """A decoder's complaint (gzip's BadGzipFile, bz2's OSError, an EOFError for a cut-short
    stream, lzma's LZMAError, zstandard's ZstdError, zlib.error); not a missing or denied file."""
    if isinstance(e, FileNotFoundError | PermissionError):
        return False
    if isinstance(e, OSError | EOFError | ValueError):
        return True
    origin = f"{type(e).__module__}.{type(e).__name__}".lower()
    return any(name in origin for name in ("lzma", "zstd", "bz2", "gzip", "zlib"))


def _raw_rows(file: str) -> Iterator[tuple[str, Any]]:
    with fsspec.open(file, "rb", compression="infer") as raw:
        # zstd's stream reader has no readline/line iteration: buffer every decompressor alike.
        f = (
            raw
            if hasattr(raw, "readline") and not file.endswith(".zst")
            else io.BufferedReader(raw)
        )
        if strip_compression(file).endswith(".txt"):
            yield from (("txt", block) for block in txt_blocks(f))
            return
        first = f.read(1)
        while first.isspace():
            first = f.read(1)
        if first == b"[":  # a JSON array file; anything else is read as JSON lines
            try:
                rows = json.loads((first + f.read()).decode("utf-8"))
            except ValueError:
                raise DataError(f"{file}: expected a JSON array of rows or JSON lines") from None
            yield from (("row", row) for row in rows)
            return
        lines = itertools.chain([first + f.readline()], f) if first else iter(())
        yield from (("jsonl", line) for line in lines if line.strip())


def txt_blocks(f: Any) -> Iterator[bytes]:
    """Blank-line-separated blocks of a binary text file, without their trailing newline."""
    block: list[bytes] = []
    for line in f:
        if line.strip():
            block.append(line)
        elif block:
            yield b"".join(block).rstrip(b"\r\n")
            block = []
    if block:
        yield b"".join(block).rstrip(b"\r\n")


# --------------------------------------------------------------------------- Hugging Face


@dataclass(frozen=True)
class HFSource:
    """``hf:NAME?name=CONFIG&split=SPLIT&revision=REV``: a dataset on the hub or a local folder
    that ``datasets`` reads (NAME may be an absolute path)."""

    path: str
    name: str | None = None
    split: str = "train"
    revision: str | None = None

    @classmethod
    def parse(cls, source: str) -> HFSource:
        """The spec of ``source``; DataError naming what does not parse."""
        body = source.removeprefix(HF_PREFIX).partition("#")[0]
        path, _, query = body.partition("?")
        try:
            options = dict(parse_qsl(query, strict_parsing=True)) if query else {}
        except ValueError:
            raise DataError(f"{source}: expected hf:NAME?name=CONFIG&split=SPLIT") from None
        unknown = sorted(set(options) - set(_HF_KEYS))
        if not path or unknown:
            raise DataError(
                f"{source}: expected hf:NAME?name=CONFIG&split=SPLIT&revision=REV"
                + (f" (unknown option {', '.join(unknown)})" if unknown else "")
            )
        if path.startswith(("/", ".", "~")):
            path = os.path.abspath(os.path.expanduser(path))
        return cls(
            path=path,
            name=options.get("name") or None,
            split=options.get("split") or "train",
            revision=options.get("revision") or None,
        )

    @classmethod
    def parse_shard(cls, url: str) -> tuple[HFSource, int, int]:
        """(spec, shard index, number of shards) of a unit URL ``hf:…#shard=i/n``."""
        fragment = url.partition("#")[2]
        index, _, num_shards = fragment.removeprefix("shard=").partition("/")
        if not (fragment.startswith("shard=") and index.isdigit() and num_shards.isdigit()):
            raise DataError(f"{url}: expected a Hugging Face shard hf:NAME?…#shard=i/n")
        return cls.parse(url), int(index), int(num_shards)

    def canonical(self) -> str:
        """The spec as a string, options in a fixed order (so equal specs fingerprint alike)."""
        options = {"name": self.name, "split": self.split, "revision": self.revision}
        query = urlencode({k: v for k, v in options.items() if v})
        return f"{HF_PREFIX}{self.path}?{query}"

    def list_shards(self) -> list[SourceFile]:
        """One unit per shard; version = the resolved dataset hash (hub commit, or a hash of
        the local files) so that a changed dataset is detected."""
        version, dataset = self.load(refresh=True)
        num_shards = dataset.num_shards
        return [
            SourceFile(unit="", url=f"{self.canonical()}#shard={i}/{num_shards}", version=version)
            for i in range(num_shards)
        ]

    def load(self, *, refresh: bool = False) -> tuple[str, Any]:
        """(version, streaming ``IterableDataset``), cached per process: every unit of a pool
        worker reuses one resolution of the dataset (listing refreshes it)."""
        key = self.canonical()
        if refresh or key not in _HF_DATASETS:
            _HF_DATASETS[key] = self._load()
        return _HF_DATASETS[key]

    def _load(self) -> tuple[str, Any]:
        import datasets

        try:
            builder = datasets.load_dataset_builder(
                self.path, name=self.name, revision=self.revision
            )
            dataset = builder.as_streaming_dataset(split=self.split)
        # datasets raises many types (hub unreachable, unknown dataset/config/split, bad files);
        # all mean the same to the user: this source cannot be read.
        except Exception as e:
            raise DataError(
                f"{self.canonical()}: unknown source, cannot load with `datasets`: {first_line(e)}"
            ) from None
        version = builder.hash or self.revision or ""
        return str(version), dataset

    def read_shard(
        self, index: int, num_shards: int, text_field: str, stats: dict[str, int]
    ) -> Iterator[str]:
        """Documents of shard ``index`` of ``num_shards``."""
        where = f"{self.canonical()}#shard={index}/{num_shards}"
        _, dataset = self.load()
        if dataset.num_shards != num_shards:
            raise DataError(
                f"{where}: the dataset now has {dataset.num_shards} shards, not {num_shards}"
            )
        check = _FieldCheck(where, text_field)
        if dataset.features is not None:
            check.check_fields(list(dataset.features))
        shard = dataset.shard(num_shards=num_shards, index=index)
        yield from _row_documents(iter(shard), where, text_field, stats, check=check)


_HF_DATASETS: dict[str, tuple[str, Any]] = {}
