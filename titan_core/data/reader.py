"""The dataloader of prepared datasets: a global sample order, O(1) state, any DP degree.

Micro-batch m is the global samples ``[m*G, (m+1)*G)``, ``G = local_batch_size * dp_degree``;
data-parallel rank r takes ``[m*G + r*lbs, m*G + (r+1)*lbs)``. Global sample j comes from one of
the mixed datasets (``sampling.assign_sources``) and is that dataset's next sample in its seeded
per-epoch permutation. The state is a few integers per dataset, the same on every rank: a resume
is O(1) at any position, and resuming with another DP degree but the same global batch continues
the same global sequence of samples.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful

from titan_core import storage
from titan_core.config.job import Dataloader, parse_mix, parse_ranges
from titan_core.data.sampling import (
    Cursor,
    Identity,
    Permutation,
    advance,
    assign_sources,
    derive_key,
    locate,
)
from titan_core.data.windows import SplitReader, open_split
from titan_core.errors import DataError

logger = logging.getLogger(__name__)

# Test hook: every training batch a rank hands out is appended to <dir>/rank<RANK>.jsonl.
DUMP_ENV = "TITAN_DATA_DUMP_DIR"
PREFETCH_THREAD = "titan-data-prefetch"
Batch = tuple[torch.Tensor, ...]


class PreparedDataloader(Stateful):
    """Batches of (inputs, labels) int64 (bs, seq) — and doc_ids int32 (bs, seq) with document
    masking — from prepared datasets mixed by weight.

    Infinite (training): epochs follow each other, each in a seeded order. Finite (validation):
    one unshuffled pass over the first dataset from its start at every iteration, dropping the
    last incomplete global batch so that every rank runs the same number of batches.
    ``prefetch`` batches are read ahead by a background thread; the state is that of the batches
    handed out, never of those read ahead.
    """

    def __init__(
        self,
        readers: list[SplitReader],
        weights: list[float],
        *,
        local_batch_size: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        infinite: bool = True,
        shuffle: bool = True,
        seed: int = 0,
        prefetch: int = 2,
        document_masking: bool = False,
        exclude: list[tuple[int, int]] | None = None,
    ) -> None:
        if local_batch_size < 1:
            raise ValueError(f"local_batch_size: expected an int >= 1, got {local_batch_size}")
        if not readers or len(readers) != len(weights):
            raise ValueError("PreparedDataloader: expected one weight per dataset")
        self.readers = readers
        self.weights = [w / sum(weights) for w in weights]
        self.local_batch_size = local_batch_size
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.global_batch = local_batch_size * dp_world_size
        self.infinite = infinite
        self.shuffle = shuffle and infinite
        self.seed = seed
        self.prefetch = prefetch
        self.document_masking = document_masking
        self.exclude = sorted(exclude or [])  # (start, end) ranges of the global sample order
        self.seq_len = readers[0].seq_len
        self.names = _names(readers)
        self._ids = [derive_key(r.manifest.fingerprint) >> 2 for r in readers]  # fits int64
        self._cursors = self._fresh()
        self._orders: dict[tuple[int, int, int], Permutation | Identity] = {}
        self._dump = os.environ.get(DUMP_ENV, "")
        self._dump_log: storage.LineLog | None = None
        if not infinite and readers[0].num_samples() < self.global_batch:
            raise DataError(
                f"{readers[0].url}: the {readers[0].split} split holds "
                f"{readers[0].num_samples()} samples of {self.seq_len + 1} tokens, fewer than "
                f"one global batch ({self.global_batch})"
            )

    def _fresh(self) -> tuple[Cursor, ...]:
        return tuple(Cursor(num_shards=len(r.shards)) for r in self.readers)

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[Batch]:
        state: Any = self._cursors if self.infinite else 0
        if self.prefetch == 0:
            while (item := self._produce(state)) is not None:
                batch, state = item
                yield self._hand_out(batch, state)
            return
        items: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        args = (self._produce, state, items, stop)
        worker = threading.Thread(target=_prefetch, args=args, name=PREFETCH_THREAD, daemon=True)
        worker.start()
        try:
            while (item := items.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                batch, state = item
                yield self._hand_out(batch, state)
        finally:  # also when the consumer stops early (close(), a validation's last batch)
            stop.set()
            while True:  # unblock a put() in flight; the worker then sees `stop` and exits
                try:
                    items.get_nowait()
                except queue.Empty:
                    break
            worker.join()

    def _hand_out(self, batch: tuple[Batch, int], state: Any) -> Batch:
        tensors, start = batch
        if self.infinite:
            self._cursors = state
            if self._dump:
                self._dump_batch(tensors, start)
        return tensors

    def _produce(self, state: Any) -> tuple[tuple[Batch, int], Any] | None:
        """The next batch after ``state`` and the state after it (None: a finite pass ended)."""
        if not self.infinite:
            if state + self.global_batch > self.readers[0].num_samples():
                return None
            first = state + self.dp_rank * self.local_batch_size
            picks = [(0, np.arange(first, first + self.local_batch_size))]
            return (self._read(picks), state), state + self.global_batch
        cursors: tuple[Cursor, ...] = state
        start = sum(c.count for c in cursors)
        while (end := self._excluded_until(start)) is not None:
            while start < end:  # whole global batches, exactly as training would draw them
                _, cursors = self._draw(cursors, read=False)
                start = sum(c.count for c in cursors)
        picks, after = self._draw(cursors, read=True)
        return (self._read(picks), start), after

    def _excluded_until(self, position: int) -> int | None:
        """The end of the ``exclude`` range ``position`` falls in, if any."""
        for start, end in self.exclude:
            if start <= position < end:
                return end
        return None

    @property
    def position(self) -> int:
        """Global samples drawn so far (the start of the next global batch)."""
        return sum(c.count for c in self._cursors)

    def _draw(
        self, cursors: tuple[Cursor, ...], *, read: bool
    ) -> tuple[list[tuple], tuple[Cursor, ...]]:
        """This rank's picks of the next global batch (when ``read``) and the cursors after
        it."""
        counts = [c.count for c in cursors]
        bases = [c.base for c in cursors]
        sources = assign_sources(self.weights, counts, self.global_batch, bases)  # (G,)
        mine = slice(
            self.dp_rank * self.local_batch_size, (self.dp_rank + 1) * self.local_batch_size
        )
        picks, after = [], []
        for s, (reader, cursor) in enumerate(zip(self.readers, cursors, strict=True)):
            drawn = sources == s
            rows = np.flatnonzero(drawn[mine])
            offsets = (np.cumsum(drawn) - 1)[mine][rows]
            now, later = reader.num_samples(cursor.num_shards), reader.num_samples()
            if read and rows.size:
                epochs, positions = locate(cursor, offsets, now, later)
                samples = np.empty(rows.size, dtype=np.int64)
                for epoch in np.unique(epochs).tolist():
                    sel = epochs == epoch
                    n = now if epoch == cursor.epoch else later
                    samples[sel] = self._order(s, epoch, n)(positions[sel])
                picks.append((s, samples, rows))
            after.append(advance(cursor, int(drawn.sum()), now, later, len(reader.shards)))
        return picks, tuple(after)

    def _order(self, source: int, epoch: int, n: int) -> Permutation | Identity:
        key = (source, epoch, n)
        if key not in self._orders:
            if len(self._orders) > 16:
                self._orders.clear()
            fingerprint = self.readers[source].manifest.fingerprint
            self._orders[key] = (
                Permutation(n, derive_key(self.seed, fingerprint, epoch))
                if self.shuffle
                else Identity(n)
            )
        return self._orders[key]

    def _read(self, picks: list[tuple]) -> Batch:
        bs, seq = self.local_batch_size, self.seq_len
        windows = np.empty((bs, seq + 1), dtype=np.int64)
        doc_ids = np.empty((bs, seq), dtype=np.int32) if self.document_masking else None
        for s, samples, *rest in picks:
            rows = rest[0] if rest else slice(None)
            windows[rows] = self.readers[s].windows(samples)
            if doc_ids is not None:
                doc_ids[rows] = self.readers[s].doc_ids(samples)
        inputs = torch.from_numpy(np.ascontiguousarray(windows[:, :-1]))  # (bs, seq)
        labels = torch.from_numpy(np.ascontiguousarray(windows[:, 1:]))  # (bs, seq)
        if doc_ids is None:
            return inputs, labels
        return inputs, labels, torch.from_numpy(doc_ids)

    def _dump_batch(self, tensors: Batch, start: int) -> None:
        if self._dump_log is None:
            path = os.path.join(self._dump, f"rank{os.environ.get('RANK', '0')}.jsonl")
            self._dump_log = storage.LineLog(path)
        row = {"dp_rank": self.dp_rank, "start": start, "inputs": tensors[0].tolist()}
        self._dump_log.write(json.dumps(row) + "\n")

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Per dataset: id, epoch, samples consumed in the epoch, shards in use, samples drawn;
        int64 tensors under rank-independent keys (every rank holds the same values)."""
        if not self.infinite:
            return {}
        out = {"seq_len": _t(self.seq_len)}
        for s, cursor in enumerate(self._cursors):
            out |= {
                f"source{s}_id": _t(self._ids[s]),
                f"source{s}_epoch": _t(cursor.epoch),
                f"source{s}_consumed": _t(cursor.consumed),
                f"source{s}_shards": _t(cursor.num_shards),
                f"source{s}_count": _t(cursor.count),
                f"source{s}_base": _t(cursor.base),
                # The mix's weight (parts per 2^40) and which shards the epoch reads: a resume
                # with other weights rebases the mix, one over other shards is refused.
                f"source{s}_weight": _t(round(self.weights[s] * 2**40)),
                f"source{s}_prefix": _t(self._prefix_key(s, cursor.num_shards)),
            }
        return out

    def _prefix_key(self, source: int, num_shards: int) -> int:
        """A 62-bit digest of the names and checksums of the first ``num_shards`` shards."""
        shards = self.readers[source].shards[:num_shards]
        return derive_key(*[(s.name, s.sha256_tokens) for s in shards]) >> 2

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict`` in O(1); a dataset whose id or seq_len differs starts
        over (with a warning)."""
        if not state_dict or not self.infinite:
            return
        if int(state_dict["seq_len"]) != self.seq_len:
            logger.warning(
                "Dataloader state was saved with seq_len %d, now %d: the data order starts over",
                int(state_dict["seq_len"]),
                self.seq_len,
            )
            return
        cursors = list(self._fresh())
        keys = ("id", "epoch", "consumed", "shards", "count", "base", "weight", "prefix")
        rebase = False
        for s, reader in enumerate(self.readers):
            get = {k: int(state_dict[f"source{s}_{k}"]) for k in keys}
            if get["id"] != self._ids[s]:
                logger.warning(
                    "Dataloader state is for another dataset than %s: starting it over", reader.url
                )
                rebase = True  # its count starts at 0: the others' lead must not starve it
                continue
            if get["shards"] > len(reader.shards):
                raise DataError(
                    f"{reader.url}: the checkpoint's data order reads {get['shards']} "
                    f"{reader.split} shards, the manifest lists {len(reader.shards)} (prepared "
                    "datasets only grow: was it replaced?)"
                )
            if get["prefix"] != self._prefix_key(s, get["shards"]):
                raise DataError(
                    f"{reader.url}: its first {get['shards']} {reader.split} shards are not the "
                    "ones the checkpoint read (the dataset was re-prepared or replaced); set "
                    "--checkpoint.exclude_from_loading dataloader to start its order over"
                )
            rebase |= get["weight"] != round(self.weights[s] * 2**40)
            # A resume keeps the epoch's shard prefix; shards added since enter at the next epoch.
            # (Advanced from the epoch's start: a position past its end rolls over.)
            start = Cursor(
                get["epoch"], 0, get["shards"], get["count"] - get["consumed"], get["base"]
            )
            now, later = reader.num_samples(get["shards"]), reader.num_samples()
            cursors[s] = advance(start, get["consumed"], now, later, len(reader.shards))
        if rebase and len(cursors) > 1:
            logger.info("Dataset mix weights changed since the checkpoint: met from here on")
            cursors = [dataclasses.replace(c, base=c.count) for c in cursors]
        self._cursors = tuple(cursors)

    # ------------------------------------------------------------------ reporting
    @property
    def stats(self) -> dict[str, int]:
        """Rows skipped while reading: none (prepare_data dropped empty documents)."""
        return {}

    def metrics(self) -> dict[str, float]:
        """The realized mix: ``{"data/mix/<name>": share of the samples drawn so far}``."""
        total = sum(c.count for c in self._cursors)
        if len(self.readers) < 2 or not self.infinite or total == 0:
            return {}
        return {f"data/mix/{n}": c.count / total for n, c in zip(self.names, self._cursors)}

    def read_stats(self) -> dict[str, int]:
        """Bytes read and remote block requests so far, over every dataset."""
        total = {"bytes_read": 0, "requests": 0}
        for reader in self.readers:
            for key, value in reader.read_stats().items():
                total[key] += value
        return total


def _prefetch(produce: Any, state: Any, items: queue.Queue, stop: threading.Event) -> None:
    """Worker of the prefetch thread: batches into ``items`` until ``stop`` or the end (None)."""
    try:
        while not stop.is_set():
            item = produce(state)
            items.put(item)
            if item is None:
                return
            state = item[1]
    except BaseException as e:  # handed to the consumer, which raises it in its own thread
        items.put(e)


def _t(value: int) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.int64)


def _names(readers: list[SplitReader]) -> list[str]:
    """Short metric names a person can read: the first source's name and the dataset's
    fingerprint prefix (``train-1f0c2a``), numbered where they still repeat."""
    names = []
    for r in readers:
        source = (r.manifest.sources or [r.url])[0].split("?")[0].rstrip("/")
        names.append(f"{source.rsplit('/', 1)[-1] or 'data'}-{r.manifest.fingerprint[:6]}")
    return [n if names.count(n) == 1 else f"{i}-{n}" for i, n in enumerate(names)]


def build_prepared_dataloader(
    cfg: Dataloader,
    *,
    fingerprint: str,
    local_batch_size: int,
    seq_len: int,
    dp_rank: int = 0,
    dp_world_size: int = 1,
    infinite: bool = True,
) -> PreparedDataloader:
    """Check and open ``cfg.split`` of the prepared datasets ``cfg`` names (its ``mix``, else
    its ``location``) and wrap them with its order, prefetch and masking settings. A finite
    (validation) loader reads only the first dataset, in order."""
    datasets = parse_mix(cfg.mix) or [(cfg.location, 1.0)]
    if not infinite:
        datasets = datasets[:1]
    readers = [
        open_split(
            url,
            cfg.split,
            fingerprint=fingerprint,
            seq_len=seq_len,
            verify=cfg.verify,
            cache_mb=cfg.cache_mb,
            sequential=not (cfg.shuffle and infinite),
        )
        for url, _ in datasets
    ]
    return PreparedDataloader(
        readers,
        [w for _, w in datasets],
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        infinite=infinite,
        shuffle=cfg.shuffle,
        seed=cfg.seed,
        prefetch=cfg.prefetch,
        document_masking=cfg.document_masking,
        exclude=parse_ranges(cfg.exclude) if infinite else None,
    )
