"""Random access to token windows of one split of a prepared dataset, local or remote.

A split's token stream is the concatenation of its shards in manifest order; sample i is the
window of ``seq_len + 1`` tokens starting at token ``i * seq_len``. Windows are found by a
binary search over the cumulative shard sizes and may span shards. Local shards are memory-
mapped; remote shards (s3://, gs://, memory://...) are read by ranged requests of aligned blocks
kept in a bounded LRU cache, all missing blocks of a batch fetched by one concurrent
``cat_ranges`` call: nothing is ever downloaded whole. ``open_split`` checks a split before
anything reads it (``check_prepared``: manifest, tokenizer, shard files, enough tokens; then
``check_contents``: token ids and document offsets at each shard's ends), and every window is
checked again as it is read.
"""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict
from typing import Any

import fsspec
import numpy as np

from titan_core.data import shards
from titan_core.errors import DataError

_MAX_OPEN_MAPS = 256  # memory maps hold a file descriptor each: bound them
# What ``SplitReader.check_contents`` reads of each shard when a split is opened: 1024 token ids
# at each end (2-4 KiB), and of a remote shard's offsets 512 at each end (4 KiB): a shard
# rewritten whole (a bad copy, another file) shows there.
PROBE_TOKENS = 1 << 10
PROBE_DOCS = 1 << 9


def is_local(fs: Any) -> bool:
    """Whether ``fs`` is the local file system (memory-mappable)."""
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocol or "local" in protocol


class LocalFiles:
    """Reads byte ranges of local files through memory maps (an LRU of open maps).

    Resident memory stays bounded whatever the dataset's size: a page fault on a file mapping
    maps (and, with the device's read-ahead, reads) far more than the window it serves, so
    shuffled reads ask for no read-around (``MADV_RANDOM``), and every ``budget_bytes`` of
    windows the pages mapped so far are unmapped (``MADV_DONTNEED``: they stay in the page
    cache, the next fault maps them again without I/O).
    """

    def __init__(self, budget_bytes: int = 64 << 20, sequential: bool = False) -> None:
        self._maps: OrderedDict[str, np.memmap] = OrderedDict()
        self.bytes_read = 0
        self.requests = 0
        # Counted per window at the largest page-cache folio a fault may map (2 MiB) when
        # shuffled: resident file pages stay under about the budget.
        self._cost = 2 << 20
        self._budget = budget_bytes
        self._sequential = sequential
        self._mapped = 0

    def array(self, path: str, dtype: np.dtype) -> np.ndarray:
        """The whole file as a read-only array (mapped, not read)."""
        key = f"{path}|{dtype.str}"
        found = self._maps.get(key)
        if found is None:
            if os.path.getsize(path) == 0:
                return np.zeros(0, dtype=dtype)
            found = self._maps[key] = np.memmap(path, dtype=dtype, mode="r")
            if not self._sequential and hasattr(mmap, "MADV_RANDOM"):
                found._mmap.madvise(mmap.MADV_RANDOM)
            if len(self._maps) > _MAX_OPEN_MAPS:
                self._maps.popitem(last=False)
        else:
            self._maps.move_to_end(key)
        return found

    def read(self, requests: list[tuple[str, np.dtype, int, int]]) -> list[np.ndarray]:
        """``[path, dtype, first, end)`` element ranges, copied out of the maps."""
        out = [np.array(self.array(p, dt)[lo:hi]) for p, dt, lo, hi in requests]
        self.bytes_read += sum(a.nbytes for a in out)
        cost = sum(a.nbytes for a in out) if self._sequential else len(out) * self._cost
        self._mapped += cost
        if self._mapped > self._budget:
            self.unmap()
        return out

    def probe(self, requests: list[tuple[str, np.dtype, int, int]]) -> list[np.ndarray]:
        """``read`` for checks: the same ranges, not counted as reading."""
        return [np.array(self.array(p, dt)[lo:hi]) for p, dt, lo, hi in requests]

    def unmap(self) -> None:
        """Drop this process's mappings of the pages read so far (the page cache keeps them)."""
        if hasattr(mmap, "MADV_DONTNEED"):
            for found in self._maps.values():
                found._mmap.madvise(mmap.MADV_DONTNEED)
        self._mapped = 0


class RemoteFiles:
    """Reads byte ranges of remote files by ranged requests of aligned ``block_bytes`` blocks,
    keeping at most ``cache_bytes`` of them (least recently used first out)."""

    def __init__(self, fs: Any, block_bytes: int, cache_bytes: int, sizes: dict[str, int]) -> None:
        self.fs = fs
        self.block_bytes = block_bytes
        self.cache_bytes = max(cache_bytes, block_bytes)
        self.sizes = sizes  # bytes of every file, from the manifest: no HEAD requests
        # Aligned blocks (bytes) by (path, block index); whole decoded arrays at index -1.
        self._blocks: OrderedDict[tuple[str, int], bytes | np.ndarray] = OrderedDict()
        self._cached = 0
        self.bytes_read = 0
        self.requests = 0

    def _fetch(self, keys: list[tuple[str, int]]) -> dict[tuple[str, int], bytes]:
        got: dict[tuple[str, int], bytes] = {}
        missing = []
        for key in dict.fromkeys(keys):
            block = self._blocks.get(key)
            if block is None:
                missing.append(key)
            else:
                self._blocks.move_to_end(key)
                got[key] = block
        if missing:
            starts = [b * self.block_bytes for _, b in missing]
            ends = [min(s + self.block_bytes, self.sizes[p]) for (p, _), s in zip(missing, starts)]
            blobs = self._cat([p for p, _ in missing], starts, ends)
            for key, blob in zip(missing, blobs, strict=True):
                got[key] = blob
                self._put(key, blob)
        return got

    def _cat(self, paths: list[str], starts: list[int], ends: list[int]) -> list[bytes]:
        try:
            blobs = self.fs.cat_ranges(paths, starts, ends, on_error="raise")
        except (OSError, ValueError) as e:
            raise DataError(f"{paths[0]}: ranged read failed ({type(e).__name__}: {e})") from e
        self.requests += len(paths)
        self.bytes_read += sum(len(b) for b in blobs)
        return blobs

    def probe(self, requests: list[tuple[str, np.dtype, int, int]]) -> list[np.ndarray]:
        """``[path, dtype, first, end)`` element ranges for checks: each one ranged request
        of just its bytes (all concurrent), neither cached nor aligned to blocks."""
        requests = [(p, dt, lo, hi) for p, dt, lo, hi in requests if hi > lo]
        blobs = self._cat(
            [p for p, _, _, _ in requests],
            [lo * dt.itemsize for _, dt, lo, _ in requests],
            [hi * dt.itemsize for _, dt, _, hi in requests],
        )
        return [
            np.frombuffer(b, dtype=dt) for (_, dt, _, _), b in zip(requests, blobs, strict=True)
        ]

    def _put(self, key: tuple[str, int], value: bytes | np.ndarray) -> None:
        self._blocks[key] = value
        self._cached += _nbytes(value)
        while self._cached > self.cache_bytes and len(self._blocks) > 1:
            _, old = self._blocks.popitem(last=False)
            self._cached -= _nbytes(old)

    def read(self, requests: list[tuple[str, np.dtype, int, int]]) -> list[np.ndarray]:
        """``[path, dtype, first, end)`` element ranges, fetched together."""
        spans = []
        keys: list[tuple[str, int]] = []
        for path, dtype, lo, hi in requests:
            start, end = lo * dtype.itemsize, hi * dtype.itemsize
            blocks = range(start // self.block_bytes, max(end - 1, start) // self.block_bytes + 1)
            spans.append((start, end, blocks))
            keys += [(path, b) for b in blocks] if end > start else []
        got = self._fetch(keys)
        out = []
        for (path, dtype, _, _), (start, end, blocks) in zip(requests, spans, strict=True):
            if end <= start:
                out.append(np.zeros(0, dtype=dtype))
                continue
            data = b"".join(got[(path, b)] for b in blocks)  # type: ignore[misc]
            skip = start - blocks[0] * self.block_bytes
            out.append(np.frombuffer(data[skip : skip + end - start], dtype=dtype).copy())
        return out


class SplitReader:
    """Token windows and document ids of one split of a prepared dataset."""

    def __init__(
        self,
        url: str,
        manifest: shards.Manifest,
        split: str,
        *,
        seq_len: int,
        cache_mb: int = 64,
        sequential: bool = False,
    ) -> None:
        self.url = url
        self.manifest = manifest
        self.split = split
        self.seq_len = seq_len
        self.shards = manifest.split_shards(split)
        self.dtype = np.dtype(manifest.dtype)
        # Every id read is checked against it: a damaged shard of the right size (only a
        # checksum would notice) is one line naming it, not an IndexError in the embedding.
        self.vocab_size = int(manifest.tokenizer.get("vocab_size") or 0)
        self._checked_ends: set[int] = set()
        counts = [s.num_tokens for s in self.shards]
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])  # (shards + 1,)
        self._urls = [shards.shard_urls(url, s) for s in self.shards]
        fs, _ = fsspec.core.url_to_fs(os.path.expanduser(url))
        paths = [
            tuple(fs._strip_protocol(os.path.expanduser(u)) for u in pair) for pair in self._urls
        ]
        self._paths: list[tuple[str, str]] = paths  # type: ignore[assignment]
        if is_local(fs):
            self.files: LocalFiles | RemoteFiles = LocalFiles(cache_mb << 20, sequential)
        else:
            sizes = {}
            for (tokens, docs), s in zip(self._paths, self.shards, strict=True):
                sizes[tokens] = s.num_tokens * self.dtype.itemsize
                sizes[docs] = s.num_docs * shards.DOC_DTYPE.itemsize
            window_bytes = (seq_len + 1) * self.dtype.itemsize
            self.files = RemoteFiles(
                fs, block_size(window_bytes, cache_mb << 20, sequential), cache_mb << 20, sizes
            )

    def check_contents(self) -> None:
        """The cheap checks when the split is opened, before anything trains on it: each
        shard's first and last ``PROBE_TOKENS`` token ids against the vocabulary, and its
        document offsets increasing within its tokens, the last one its size (local: every
        offset; object stores: the first and last ``PROBE_DOCS``). What lies between is checked
        as it is read (``windows``, ``doc_ids``). A damaged shard is one ``DataError`` line
        naming it."""
        tokens: list[tuple[int, tuple[str, np.dtype, int, int]]] = []
        docs: list[tuple[int, tuple[str, np.dtype, int, int]]] = []
        for i, shard in enumerate(self.shards):
            tok_path, doc_path = self._paths[i]
            n, d = shard.num_tokens, shard.num_docs
            for lo, hi in _head_and_tail(n, PROBE_TOKENS):
                tokens.append((i, (tok_path, self.dtype, lo, hi)))
            if isinstance(self.files, LocalFiles):
                self._check_ends(i, self.files.array(doc_path, shards.DOC_DTYPE)[:d])
                continue
            for lo, hi in _head_and_tail(d, PROBE_DOCS):
                docs.append((i, (doc_path, shards.DOC_DTYPE, lo, hi)))
        for (i, (_, _, lo, _)), part in zip(
            tokens, self.files.probe([r for _, r in tokens]), strict=True
        ):
            self._check_ids(i, lo, part)
        for (i, (_, _, _, hi)), ends in zip(
            docs, self.files.probe([r for _, r in docs]), strict=True
        ):
            self._check_ends(i, ends, last=hi == self.shards[i].num_docs)

    def _check_ids(self, shard: int, lo: int, part: np.ndarray) -> None:
        """Token ids ``part`` (from shard-local token ``lo`` on) within the vocabulary."""
        if self.vocab_size and len(part) and int(part.max()) >= self.vocab_size:
            at = lo + int(np.argmax(part >= self.vocab_size))
            raise DataError(
                f"{self._urls[shard][0]}: token {at} is id {int(part.max())}, beyond the "
                f"tokenizer's {self.vocab_size} ids: the shard is damaged; prepare the data "
                "again (dataloader.verify=checksum finds such shards before training)"
            )

    def num_samples(self, num_shards: int | None = None) -> int:
        """Samples in the first ``num_shards`` shards (default: all): (tokens - 1) // seq_len."""
        n = len(self.shards) if num_shards is None else num_shards
        return max(int(self.starts[n]) - 1, 0) // self.seq_len

    def windows(self, samples: np.ndarray) -> np.ndarray:
        """Windows of ``samples`` as int64 (n, seq_len + 1)."""
        pieces = self._pieces(samples)
        parts = self.files.read(
            [(self._paths[i][0], self.dtype, lo, hi) for _, i, lo, hi in pieces]
        )
        out = np.empty((len(samples), self.seq_len + 1), dtype=np.int64)
        fill = np.zeros(len(samples), dtype=np.int64)
        for (row, shard, lo, _), part in zip(pieces, parts, strict=True):
            self._check_ids(shard, lo, part)
            out[row, fill[row] : fill[row] + len(part)] = part
            fill[row] += len(part)
        if not (fill == self.seq_len + 1).all():
            raise DataError(f"{self.url}: a shard is shorter than the manifest says")
        return out

    def doc_ids(self, samples: np.ndarray) -> np.ndarray:
        """For each sample's ``seq_len`` input tokens, the number of the document each belongs
        to, counted from 0 within the sample: int32 (n, seq_len)."""
        out = np.empty((len(samples), self.seq_len), dtype=np.int32)
        first = np.asarray(samples, dtype=np.int64) * self.seq_len
        pieces = self._pieces(samples, self.seq_len)
        ends: list[list[np.ndarray]] = [[] for _ in range(len(samples))]
        for row, i, lo, hi in pieces:
            # Ends after the piece's first token, up to its end (a shard ends with a document);
            # an end is the first token of the next document.
            ends[row].append(self._doc_ends(i, lo, hi) + self.starts[i])
        positions = np.arange(self.seq_len, dtype=np.int64)
        for row in range(len(samples)):
            row_ends = np.concatenate(ends[row]) if ends[row] else np.zeros(0, np.int64)
            row_ends = row_ends[row_ends < first[row] + self.seq_len]
            out[row] = np.searchsorted(row_ends, first[row] + positions, side="right")
        return out

    def _doc_ends(self, shard: int, lo: int, hi: int) -> np.ndarray:
        """The document ends ``e`` of ``shard`` with ``lo < e <= hi`` (shard-local tokens).

        Local: a binary search of the mapped offsets. Remote: an interpolation search over
        ranged reads (the offsets of a shard can be megabytes): read the offsets around where
        ``lo`` falls if documents were spread evenly, and widen until they bracket
        ``[lo, hi]``; ends strictly increase, so what lies outside the bracket is outside.
        """
        path = self._paths[shard][1]
        if isinstance(self.files, LocalFiles):
            ends = self.files.array(path, shards.DOC_DTYPE)
        else:
            n, tokens = self.shards[shard].num_docs, max(self.shards[shard].num_tokens, 1)
            span = 256  # 2 KiB of offsets each side
            guess = min(int(lo / tokens * n), n - 1)
            a, b = max(guess - span, 0), min(guess + span, n)
            while True:
                (ends,) = self.files.read([(path, shards.DOC_DTYPE, a, b)])
                left, right = a == 0 or ends[0] <= lo, b == n or ends[-1] >= hi
                if left and right:
                    break
                span *= 2
                a, b = (a if left else max(a - span, 0)), (b if right else min(b + span, n))
        self._check_ends(shard, ends)
        return ends[np.searchsorted(ends, lo, side="right") : np.searchsorted(ends, hi, "right")]

    def _check_ends(self, shard: int, ends: np.ndarray, last: bool = False) -> None:
        """Document ends strictly increase within the shard's tokens (a whole local array is
        checked once, and ends at the shard's size, as does a ``last`` slice; a remote slice
        each time it is read)."""
        tokens = self.shards[shard].num_tokens
        whole = len(ends) == self.shards[shard].num_docs
        if whole and shard in self._checked_ends:
            return
        bad = len(ends) and (
            bool((np.diff(ends) <= 0).any()) or int(ends[0]) <= 0 or int(ends[-1]) > tokens
        )
        if bad or ((whole or last) and len(ends) and int(ends[-1]) != tokens):
            raise DataError(
                f"{self._urls[shard][1]}: document offsets are not increasing ends within the "
                f"shard's {tokens} tokens: the shard is damaged; prepare the data again"
            )
        if whole:
            self._checked_ends.add(shard)

    def _pieces(self, samples: np.ndarray, length: int | None = None) -> list[tuple[int, ...]]:
        """(row, shard, first, end) token ranges, shard-local, covering each sample's window."""
        length = self.seq_len + 1 if length is None else length
        first = np.asarray(samples, dtype=np.int64) * self.seq_len
        shard_of = np.searchsorted(self.starts, first, side="right") - 1
        pieces = []
        for row, (start, i) in enumerate(zip(first.tolist(), shard_of.tolist(), strict=True)):
            end = start + length
            while start < end:
                if i >= len(self.shards):
                    raise IndexError(f"{self.url}: sample {samples[row]} beyond the split")
                stop = min(end, int(self.starts[i + 1]))
                pieces.append((row, i, start - int(self.starts[i]), stop - int(self.starts[i])))
                start, i = stop, i + 1
        return pieces

    def read_stats(self) -> dict[str, int]:
        """Bytes and requests read so far (requests: remote blocks fetched)."""
        return {"bytes_read": self.files.bytes_read, "requests": self.files.requests}


def check_prepared(
    url: str, split: str, *, fingerprint: str, seq_len: int, verify: str
) -> shards.Manifest:
    """Manifest present, same tokenizer, shard files as the manifest says (sizes from one
    listing; sha256 too when ``verify == "checksum"``), split holds >= 1 sample; returns the
    manifest. DataError naming the file otherwise."""
    manifest = shards.read_manifest(url)
    shards.check_tokenizer(manifest, url, fingerprint)
    if split not in shards.SPLITS:
        raise DataError(f"{url}: a prepared dataset has splits {shards.SPLITS}, not {split!r}")
    _check_files(url, manifest, split, checksum=verify == "checksum")
    tokens = sum(s.num_tokens for s in manifest.split_shards(split))
    if tokens < seq_len + 1:
        hint = (
            " (prepared with validation_every=0? then set validation.dataset_split=train on a "
            "held-out dataset)"
            if split == "validation"
            else ""
        )
        raise DataError(
            f"{url}: the {split} split holds {tokens} tokens, fewer than training.seq_len + 1 = "
            f"{seq_len + 1}{hint}"
        )
    return manifest


def _check_files(url: str, manifest: shards.Manifest, split: str, *, checksum: bool) -> None:
    if checksum:
        shards.verify_shards(url, manifest, checksum=True, splits=(split,))
        return
    # One listing instead of two size requests per shard (thousands of HEADs on object stores);
    # any difference is re-checked file by file, whose error names the file.
    fs, root = fsspec.core.url_to_fs(os.path.expanduser(url))
    try:
        found = fs.find(f"{root.rstrip('/')}/{shards.SHARD_DIR}", detail=True)
    except OSError:
        found = {}
    itemsize = np.dtype(manifest.dtype).itemsize
    for shard in manifest.split_shards(split):
        tokens, docs = (fs._strip_protocol(u) for u in shards.shard_urls(url, shard))
        want = {tokens: shard.num_tokens * itemsize, docs: shard.num_docs * 8}
        if any(found.get(p, {}).get("size") != size for p, size in want.items()):
            shards.verify_shards(url, manifest, checksum=False, splits=(split,))
            return


def open_split(
    url: str,
    split: str,
    *,
    fingerprint: str,
    seq_len: int,
    verify: str = "size",
    cache_mb: int = 64,
    sequential: bool = False,
) -> SplitReader:
    """Check (``check_prepared``) and open one split of the prepared dataset at ``url``."""
    manifest = check_prepared(url, split, fingerprint=fingerprint, seq_len=seq_len, verify=verify)
    reader = SplitReader(
        url, manifest, split, seq_len=seq_len, cache_mb=cache_mb, sequential=sequential
    )
    reader.check_contents()
    return reader


def _head_and_tail(n: int, probe: int) -> list[tuple[int, int]]:
    """The element ranges of the first and last ``probe`` of ``n`` (one range when they meet)."""
    if n <= 2 * probe:
        return [(0, n)] if n else []
    return [(0, probe), (n - probe, n)]


def _nbytes(value: bytes | np.ndarray) -> int:
    return value.nbytes if isinstance(value, np.ndarray) else len(value)


def block_size(window_bytes: int, cache_bytes: int, sequential: bool) -> int:
    """Remote block size: large blocks read ahead in sequential passes; in shuffled order each
    window is somewhere else, so a block barely larger than one window wastes least."""
    if sequential:
        return int(min(max(cache_bytes // 16, 64 << 10), 8 << 20))
    return max(4 << 10, 1 << (2 * window_bytes - 1).bit_length())
