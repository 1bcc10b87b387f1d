"""Fetch the tokenizer a run trains with into the run root (the ``download_tokenizer`` stage).

Sources (``tokenizer.path`` of the job):

- ``builtin`` (or empty): the project's offline BPE (built by ``titan_core.data.assets``);
- ``hf://org/repo[@revision]/path/in/repo``: through ``huggingface_hub``, honouring
  ``HF_ENDPOINT`` and the token in ``HF_TOKEN``;
- any fsspec URL (``s3://…``, ``https://…``) or a local file.

The file must be a tiktoken ranks file (checked before it is stored). The stage is cached by
source (the revision is part of it) and output root (``tokenizer_cache_key``): a later run
with the same source reuses the stored file instead of downloading it again.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
import tempfile
from dataclasses import dataclass

import fsspec

from titan_core import storage
from titan_core.errors import DataError
from titan_core.pipeline.run.common import Logger, redact
from titan_core.pipeline.run.paths import storage_identity
from titan_core.pipeline.run.transfer import download_file, upload_folder

BUILTIN = "builtin"
_HF_RE = re.compile(r"^hf://(?P<repo>[^/@]+/[^/@]+)(?:@(?P<rev>[^/]+))?/(?P<file>.+)$")
_REMOTE_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "az", "abfs", "http", "https", "memory", "file"}


def tokenizer_source(path: str) -> str:
    """The tokenizer source a config names (empty means the builtin BPE)."""
    return path or BUILTIN


def parse_hf_source(source: str) -> tuple[str, str | None, str]:
    """``hf://org/repo[@revision]/path`` → (repo id, revision or None, file path)."""
    match = _HF_RE.match(source)
    if match is None:
        raise DataError(
            f"tokenizer.path: expected hf://org/repo[@revision]/path/to/file, got {source!r}"
        )
    return match.group("repo"), match.group("rev"), match.group("file")


def _hf_download(source: str, cache_dir: str) -> str:
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo, revision, filename = parse_hf_source(source)
    endpoint = os.environ.get("HF_ENDPOINT") or None
    where = f"tokenizer.path: {source}"
    if constants.HF_HUB_OFFLINE:
        raise DataError(
            f"{where}: HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set, so the hub cannot be "
            "reached; unset it, or point tokenizer.path at a local file or fsspec URL"
        )
    try:
        return hf_hub_download(
            repo,
            filename,
            revision=revision,
            token=os.environ.get("HF_TOKEN") or None,
            endpoint=endpoint,
            cache_dir=cache_dir,
        )
    except (RepositoryNotFoundError, GatedRepoError):
        raise DataError(
            f"{where}: repository {repo!r} not found or not accessible with the token in HF_TOKEN"
        ) from None
    except RevisionNotFoundError:
        raise DataError(f"{where}: revision {revision!r} not found in {repo!r}") from None
    except EntryNotFoundError:
        raise DataError(f"{where}: no file {filename!r} in {repo!r}") from None
    except LocalEntryNotFoundError:
        raise DataError(
            f"{where}: cannot reach the hub at {endpoint or 'https://huggingface.co'} "
            "(set HF_ENDPOINT for a mirror)"
        ) from None
    except HfHubHTTPError as e:
        raise DataError(f"{where}: {redact(str(e).splitlines()[0])}") from None


def fetch_local(
    source: str,
    workdir: str,
    *,
    attempts: int = 4,
    progress: bool = True,
    logger: Logger | None = None,
) -> str:
    """A local copy (or the local file itself) of the tokenizer ``source`` (download retries
    logged to ``logger``)."""
    if source == BUILTIN:
        from titan_core.data import default_tokenizer_path, ensure_assets

        ensure_assets()
        return str(default_tokenizer_path())
    if source.startswith("hf://"):
        return _hf_download(source, os.path.join(workdir, "hf-cache"))
    if "://" in source:
        protocol = source.split("://", 1)[0]
        if protocol not in _REMOTE_PROTOCOLS and protocol not in fsspec.available_protocols():
            raise DataError(
                f"tokenizer.path: unknown source {source!r}; expected builtin, "
                "hf://org/repo[@revision]/path, a local file or an fsspec URL (s3://, https://)"
            )
        if protocol == "file":
            return fetch_local(source.removeprefix("file://"), workdir, logger=logger)
        if not storage.exists(source):
            raise DataError(f"tokenizer.path: file not found: {source}")
        local = os.path.join(workdir, posixpath.basename(source.rstrip("/")))
        return download_file(source, local, attempts=attempts, progress=progress, logger=logger)
    if not os.path.isfile(source):
        raise DataError(f"tokenizer.path: file not found: {source}")
    return source


def tokenizer_cache_key(source: str, root: str) -> str:
    """The cache key of a stored tokenizer: its source and the output root its runs share."""
    identity = f"{source}|{storage_identity(root)}"
    return "tokenizer-" + hashlib.sha256(identity.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class StoredTokenizer:
    """A tokenizer stored in a run root."""

    url: str
    """The stored ranks file."""
    n_words: int
    """Its vocabulary size."""


def store_tokenizer(
    source: str,
    dest: str,
    *,
    attempts: int = 4,
    progress: bool = True,
    logger: Logger | None = None,
) -> StoredTokenizer:
    """Fetch the tokenizer ``source``, check it is a tiktoken ranks file, store it under
    ``dest`` (transfer retries logged to ``logger``)."""
    from titan_core.data import Tokenizer

    with tempfile.TemporaryDirectory(prefix="titan-tokenizer-") as workdir:
        local = fetch_local(source, workdir, attempts=attempts, progress=progress, logger=logger)
        tokenizer = Tokenizer(local)  # a DataError now if it is no tiktoken ranks file
        name = os.path.basename(local)
        staging = os.path.join(workdir, "upload")
        with open(local, "rb") as src:
            storage.write_bytes(os.path.join(staging, name), src.read())
        upload_folder(staging, dest, attempts=attempts, progress=progress, logger=logger)
    return StoredTokenizer(url=storage.join(dest, name), n_words=tokenizer.n_words)
