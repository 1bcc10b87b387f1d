"""The on-disk format of a prepared dataset: flat token shards, document offsets, a JSON manifest.

A prepared dataset is a folder (any fsspec URL)::

    manifest.json                 what is here: format, tokenizer, sources, shards, split rule
    shards/<name>.tokens          one flat little-endian array of token ids (manifest ``dtype``)
    shards/<name>.docs            little-endian int64 end offset (in tokens) of each document
    .staging-<host>-<pid>-<id>/   a prepare at work: its shards until it commits (then gone)

Each unit of work (one source file, or one shard of a Hugging Face dataset) writes one ``train``
and, when the split rule holds documents out, one ``validation`` shard. Shards are immutable once
written: an increment appends new shards to the manifest and never rewrites old bytes. A split's
token stream is the concatenation of its shards in manifest order; every document is
``[bos] + tokens + [eos]``. The manifest is replaced atomically (written whole, then renamed on
local disks; S3 puts are atomic per object). A file under ``shards/`` is only ever created by a
commit (``titan_core.data.prepare``), so that no prepare deletes what another one committed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import shutil
import socket
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import fsspec
import numpy as np

from titan_core import errors, storage
from titan_core.errors import DataError

FORMAT = "titan-tokens"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARD_DIR = "shards"
DOC_DTYPE = np.dtype("<i8")
SPLITS = ("train", "validation")
STAGING_PREFIX = ".staging-"


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id of a vocabulary of ``vocab_size``."""
    for name in ("<u2", "<u4"):
        if vocab_size <= np.iinfo(name).max + 1:
            return np.dtype(name)
    raise DataError(f"tokenizer: a vocabulary of {vocab_size} ids does not fit in uint32")


@dataclass(kw_only=True)
class ShardInfo:
    """One shard: which unit of work wrote it, its split, sizes and checksums."""

    name: str
    """File stem under shards/: ``<name>.tokens`` and ``<name>.docs``."""
    split: str
    """``train`` or ``validation``."""
    unit: str
    """Id of the unit of work (source file or HF shard) that wrote it."""
    source: str
    """The source file or HF shard it came from (for messages)."""
    num_docs: int
    num_tokens: int
    sha256_tokens: str
    sha256_docs: str


@dataclass(kw_only=True)
class SourceFile:
    """A unit of work's identity: a changed size or mtime/etag/revision is a different file."""

    unit: str
    """Stable id: hash of the identity fields and the dataset's fingerprint."""
    url: str
    """File URL, or ``hf:NAME?…#shard=i/n`` for a Hugging Face dataset shard."""
    size: int = -1
    """Bytes (-1 when unknown, e.g. a Hugging Face shard)."""
    version: str = ""
    """mtime, etag, or Hugging Face revision: whatever the storage offers to tell versions apart."""


@dataclass(kw_only=True)
class Manifest:
    """What a prepared dataset holds; the JSON file is this dataclass, as a dict."""

    fingerprint: str
    """Dataset id: hash of the sources as given, text field, tokenizer and split rule."""
    tokenizer: dict[str, Any]
    """``fingerprint``, ``vocab_size``, ``bos_id``, ``eos_id``, ``path`` (informational)."""
    dtype: str
    """numpy dtype string of the token shards (``<u2`` or ``<u4``)."""
    text_field: str
    sources: list[str]
    """The sources as given to prepare (paths, URLs, hf: specs)."""
    validation: dict[str, Any]
    """Held-out rule: ``{"rule": "every_nth_document", "every": N}`` (document i of a unit of
    work, counted from 0, is held out when ``i % N == N - 1``); ``every`` 0 holds none out."""
    files: list[SourceFile] = field(default_factory=list)
    shards: list[ShardInfo] = field(default_factory=list)
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def split_shards(self, split: str) -> list[ShardInfo]:
        """The shards of ``split`` in stream order (empty shards left out)."""
        return [s for s in self.shards if s.split == split and s.num_tokens > 0]

    def to_json(self) -> str:
        """The manifest as indented JSON."""
        return json.dumps(asdict(self), indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str) -> Manifest:
        """Parse and check a manifest; DataError naming ``where`` when it is not one."""
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT:
                raise DataError(f"{where}: not a prepared dataset manifest (format {FORMAT!r})")
            if raw.get("format_version") != FORMAT_VERSION:
                raise DataError(
                    f"{where}: format_version {raw.get('format_version')!r}, this version of "
                    f"titan reads {FORMAT_VERSION}; prepare the data again"
                )
            raw["files"] = [SourceFile(**f) for f in raw.get("files", [])]
            raw["shards"] = [ShardInfo(**s) for s in raw.get("shards", [])]
            return cls(**raw)
        except (ValueError, TypeError, AttributeError) as e:
            if isinstance(e, DataError):
                raise
            raise DataError(f"{where}: unreadable manifest ({type(e).__name__}: {e})") from None


def manifest_url(dataset_url: str) -> str:
    """URL of the manifest of the prepared dataset at ``dataset_url``."""
    return _join(dataset_url, MANIFEST)


def shard_urls(dataset_url: str, shard: ShardInfo) -> tuple[str, str]:
    """(tokens URL, docs URL) of ``shard``."""
    base = _join(dataset_url, SHARD_DIR, shard.name)
    return f"{base}.tokens", f"{base}.docs"


def is_prepared(location: str) -> bool:
    """Whether ``location`` (path or URL) is a prepared dataset folder (has a manifest.json).

    Only "not found" means no: denied access or an unreachable store is a one-line DataError
    (``fs.isfile`` would read every failure as "not a file", and a dataset on S3 with a wrong
    secret would silently be taken for raw text)."""
    if not location or location.startswith("hf:"):
        return False
    try:
        fs, path = fsspec.core.url_to_fs(os.path.expanduser(location))
    except (ValueError, ImportError):  # not a URL fsspec knows: a dataset name
        return False
    with storage_errors(location):
        try:
            return fs.info(posixpath.join(path.rstrip("/"), MANIFEST))["type"] == "file"
        except (FileNotFoundError, NotADirectoryError):
            return False


def storage_errors(where: str) -> contextlib.AbstractContextManager[None]:
    """Storage failures under ``where`` as one DataError line."""
    return errors.storage_errors(where, DataError)


def read_manifest(dataset_url: str) -> Manifest:
    """The manifest of the prepared dataset at ``dataset_url``; DataError when missing."""
    url = manifest_url(dataset_url)
    try:
        with fsspec.open(os.path.expanduser(url), "r", encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise DataError(f"{url}: no manifest (not a prepared dataset, or not finished)") from None
    return Manifest.from_json(text, url)


def write_manifest(dataset_url: str, manifest: Manifest) -> str:
    """Replace the manifest at ``dataset_url`` whole (temp file + rename on local disks)."""
    url = manifest_url(os.path.expanduser(dataset_url))
    storage.write_bytes(url, manifest.to_json().encode())
    return url


def write_shard(
    dataset_url: str,
    name: str,
    tokens: np.ndarray,
    doc_ends: np.ndarray,
    *,
    folder: str = SHARD_DIR,
) -> tuple[str, str]:
    """Write one shard's two files (atomically each) into ``folder`` of the dataset (a prepare
    writes into its own staging folder, see ``staging_folder``); their sha256 hex digests."""
    base = _join(os.path.expanduser(dataset_url), folder, name)
    tokens_url, docs_url = f"{base}.tokens", f"{base}.docs"
    token_bytes = np.ascontiguousarray(tokens).tobytes()
    doc_bytes = np.ascontiguousarray(doc_ends, dtype=DOC_DTYPE).tobytes()
    storage.write_bytes(tokens_url, token_bytes)
    storage.write_bytes(docs_url, doc_bytes)
    return hashlib.sha256(token_bytes).hexdigest(), hashlib.sha256(doc_bytes).hexdigest()


def verify_shards(
    dataset_url: str, manifest: Manifest, *, checksum: bool, splits: tuple[str, ...] = SPLITS
) -> None:
    """Check every shard of ``splits`` exists with its manifest size (and sha256 when
    ``checksum``); DataError naming the first bad file."""
    fs, _ = fsspec.core.url_to_fs(os.path.expanduser(dataset_url))
    itemsize = np.dtype(manifest.dtype).itemsize
    for shard in manifest.shards:
        if shard.split not in splits:
            continue
        tokens_url, docs_url = shard_urls(dataset_url, shard)
        expected = {
            tokens_url: (shard.num_tokens * itemsize, shard.sha256_tokens),
            docs_url: (shard.num_docs * DOC_DTYPE.itemsize, shard.sha256_docs),
        }
        for url, (size, digest) in expected.items():
            path = fs._strip_protocol(os.path.expanduser(url))
            try:
                actual = fs.size(path)
            except FileNotFoundError:
                raise DataError(f"{url}: shard file missing (listed in the manifest)") from None
            if actual != size:
                raise DataError(
                    f"{url}: {actual} bytes, the manifest says {size} (truncated or replaced); "
                    "prepare the data again"
                )
            if checksum and _sha256(fs, path) != digest:
                raise DataError(
                    f"{url}: checksum mismatch (sha256 differs from the manifest); the shard is "
                    "damaged: prepare the data again"
                )


def damaged_units(dataset_url: str, manifest: Manifest) -> dict[str, str]:
    """Units of ``manifest`` with a shard file missing or not of its manifest size, each with
    the first such file: one listing of the shard folder, no reads."""
    fs, root = fsspec.core.url_to_fs(os.path.expanduser(dataset_url))
    folder = posixpath.join(root.rstrip("/"), SHARD_DIR)
    with storage_errors(dataset_url):
        try:
            present = {
                posixpath.basename(e["name"]): e.get("size") for e in fs.ls(folder, detail=True)
            }
        except FileNotFoundError:
            present = {}
    itemsize = np.dtype(manifest.dtype).itemsize
    damaged: dict[str, str] = {}
    for shard in manifest.shards:
        for suffix, size in (
            (".tokens", shard.num_tokens * itemsize),
            (".docs", shard.num_docs * DOC_DTYPE.itemsize),
        ):
            if present.get(shard.name + suffix) != size and shard.unit not in damaged:
                damaged[shard.unit] = _join(dataset_url, SHARD_DIR, shard.name + suffix)
    return damaged


def staging_folder() -> str:
    """A new staging folder name for one prepare: ``.staging-<host>-<pid>-<nonce>``. A prepare
    writes its shards there and moves them under ``shards/`` only when it commits, so a failed
    or interrupted prepare removes its own folder and never a file another prepare wrote."""
    host = socket.gethostname().replace("/", "_") or "host"
    return f"{STAGING_PREFIX}{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def remove_orphan_temps(dataset_url: str) -> list[str]:
    """Remove what prepares that died on this host left (``kill -9`` gives them no chance to
    clean up): their staging folders, and temp files (``storage.temp_name``), whose process is
    gone.
    Local folders only (an object store's debris is named by host and pid too, but another
    host's processes cannot be asked); returns what was removed."""
    fs, root = fsspec.core.url_to_fs(os.path.expanduser(dataset_url))
    if "file" not in fs.protocol:
        return []
    root = root.rstrip("/")
    removed = []
    for path in fs.glob(posixpath.join(root, SHARD_DIR, "*.tmp")):
        pid = storage.temp_owner(posixpath.basename(path))
        if pid is not None and not _alive(pid):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
                removed.append(path)
    host = socket.gethostname().replace("/", "_") or "host"
    for path in fs.glob(posixpath.join(root, f"{STAGING_PREFIX}*")):
        writer_host, _, rest = posixpath.basename(path)[len(STAGING_PREFIX) :].rpartition("-")
        writer_host, _, pid = writer_host.rpartition("-")
        if writer_host == host and pid.isdigit() and rest and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: alive
        return True
    return True


def tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    """The manifest's tokenizer entry for a ``titan_core.data.tokenizer.Tokenizer``."""
    return {
        "fingerprint": tokenizer.fingerprint,
        "vocab_size": tokenizer.n_words,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "path": tokenizer.path,
    }


def check_tokenizer(manifest: Manifest, where: str, fingerprint: str) -> None:
    """DataError unless ``manifest`` was prepared with the tokenizer of ``fingerprint``."""
    theirs = manifest.tokenizer.get("fingerprint", "")
    if theirs != fingerprint:
        raise DataError(
            f"{where}: prepared with another tokenizer (fingerprint {theirs[:12]}, this job's "
            f"is {fingerprint[:12]}, from {manifest.tokenizer.get('path', '?')}); prepare it "
            "with this job's tokenizer"
        )


def _join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])


def _sha256(fs: Any, path: str) -> str:
    digest = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()
