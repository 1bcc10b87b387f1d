"""Token packing and batching with exact resume: documents -> fixed-length (input, label) pairs."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Generator, Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from titan_core.config.job import Dataloader
from titan_core.data import shards
from titan_core.data.datasets import DocumentSource, build_document_source
from titan_core.data.reader import PreparedDataloader, build_prepared_dataloader
from titan_core.data.tokenizer import Tokenizer
from titan_core.errors import ConfigError, DataError

logger = logging.getLogger(__name__)


class TextPackingDataset(IterableDataset):
    """Packs `[bos] + tokens + [eos]` documents into a stream cut into seq_len + 1 token chunks.

    Each chunk gives input = chunk[:-1] and label = chunk[1:] (seq_len,) int64; the next chunk
    starts after it, as in torchtitan. Infinite: iteration continues from the current state and
    re-loops the source (epoch += 1) keeping the leftover tokens. Finite: each iteration is one
    pass from the start (or from a just-loaded state); the last partial chunk is dropped.
    """

    def __init__(
        self, source: DocumentSource, tokenizer: Tokenizer, seq_len: int, *, infinite: bool
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len: expected an int >= 1, got {seq_len}")
        self.source = source
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.infinite = infinite
        self._epoch = 0
        self._position = 0  # rows of this rank's stream consumed in the current epoch
        # Tokens of the document at row _position - 1 already packed; -1: none pending. At a
        # yield the chunk took every earlier token, so (epoch, position, doc offset) is the
        # whole state: a resume re-reads that one document.
        self._doc_offset = -1
        self._carry: list[int] = []  # tokens of a chunk being filled (only between yields)
        self._state_loaded = False

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if not self.infinite and not self._state_loaded:
            self._rewind()  # every finite pass (a validation run) sees the same samples
        self._state_loaded = False
        while True:
            full_pass = self._position == 0
            num_docs = yield from self._pass()
            if full_pass and num_docs == 0:  # re-looping would spin forever
                raise DataError(f"{self.source.label}: no documents")
            self._epoch += 1
            self._position = 0
            if not self.infinite:
                self._rewind()
                return
            logger.info("Dataset %s: starting epoch %d", self.source.label, self._epoch)

    def _pass(self) -> Generator[tuple[torch.Tensor, torch.Tensor], None, int]:
        """Yield chunks from the current position to the end of the source; return the doc count."""
        chunk_len = self.seq_len + 1
        resume = self._doc_offset >= 0  # re-read the partly packed document first
        stream = self.source.iter_from(self._position - 1 if resume else self._position)
        num_docs = 0
        for text in stream:
            num_docs += 1
            doc = self.tokenizer.encode(text, bos=True, eos=True)
            offset = self._doc_offset if resume else 0
            resume = False
            self._position = stream.position
            while len(self._carry) + len(doc) - offset >= chunk_len:
                take = chunk_len - len(self._carry)
                chunk = torch.tensor(self._carry + doc[offset : offset + take], dtype=torch.long)
                # Advance before yielding: a state_dict() taken now must exclude this chunk.
                offset += take
                self._carry, self._doc_offset = [], offset
                yield chunk[:-1], chunk[1:]
            self._carry += doc[offset:]
            self._doc_offset = -1
        return num_docs

    def _rewind(self) -> None:
        self._position, self._doc_offset, self._carry = 0, -1, []

    def state_dict(self) -> dict[str, Any]:
        """Epoch, rows consumed and the offset in the partly packed document, as int64 tensors
        (and the skip counters): resuming yields the exact next token, no pickle needed."""
        assert not self._carry, "state taken mid-chunk (only between yields is it whole)"
        state = {
            "epoch": self._epoch,
            "position": self._position,
            "doc_offset": self._doc_offset,
            **{f"stats_{k}": v for k, v in self.source.stats.items()},
        }
        return {k: torch.tensor(v, dtype=torch.int64) for k, v in state.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a state_dict() of a dataset over the same source and tokenizer."""
        self._epoch = int(state["epoch"])
        self._position = int(state["position"])
        self._doc_offset = int(state["doc_offset"])
        self._carry = []
        self._state_loaded = True
        for key in self.source.stats:
            if f"stats_{key}" in state:
                self.source.stats[key] = int(state[f"stats_{key}"])


class ParallelAwareDataloader(Stateful):
    """Batches local_batch_size samples into (input_ids, labels) of shape (bs, seq_len), in-process.

    The global batch is drawn from ``num_streams`` independent streams (one per dp rank by
    default); this rank owns streams ``dp_rank * k .. dp_rank * k + k - 1`` (k = num_streams /
    dp world size) and takes local_batch_size / k rows from each, in order. With num_streams
    fixed, any DP degree that divides it — a single process included — sees the same samples.

    state_dict() is keyed by stream ({"dp_rank_S": {name: int64 tensor}}) so that each rank
    restores its own streams from a DCP checkpoint holding every rank's entries.
    """

    def __init__(
        self,
        datasets: list[TextPackingDataset],
        *,
        local_batch_size: int,
        dp_rank: int,
        dp_world_size: int,
        num_streams: int = 0,
    ) -> None:
        num_streams = num_streams or dp_world_size
        k = len(datasets)
        if local_batch_size < 1:
            raise ValueError(f"local_batch_size: expected an int >= 1, got {local_batch_size}")
        if k * dp_world_size != num_streams or local_batch_size % k:
            raise ValueError(
                f"{num_streams} data streams over {dp_world_size} dp ranks with local batch "
                f"{local_batch_size}: expected {num_streams // max(dp_world_size, 1)} streams per "
                "rank dividing the local batch"
            )
        self.datasets = datasets
        self.dataset = datasets[0]
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.num_streams = num_streams
        self._stream_ids = [dp_rank * k + j for j in range(k)]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        rows = self.local_batch_size // len(self.datasets)
        iterators = [iter(ds) for ds in self.datasets]
        while True:
            inputs: list[torch.Tensor] = []
            labels: list[torch.Tensor] = []
            for it in iterators:
                for x, y in itertools.islice(it, rows):
                    inputs.append(x)
                    labels.append(y)
            if not inputs:  # only finite passes end
                return
            yield torch.stack(inputs), torch.stack(labels)  # (bs, seq), (bs, seq)
            if len(inputs) < self.local_batch_size:  # a finite pass's last, smaller batch
                return

    @property
    def stats(self) -> dict[str, int]:
        """Rows skipped so far (empty, undecodable), across resumes and this rank's streams."""
        total: dict[str, int] = {}
        for ds in self.datasets:
            for key, value in ds.source.stats.items():
                total[key] = total.get(key, 0) + value
        return total

    def metrics(self) -> dict[str, float]:
        """Data metrics to log: none for raw text (the prepared loader reports its mix)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """{"dp_rank_S": stream S's dataset state plus the stream count, as int64 tensors}."""
        streams = torch.tensor(self.num_streams, dtype=torch.int64)
        return {
            f"dp_rank_{sid}": ds.state_dict() | {"num_streams": streams.clone()}
            for sid, ds in zip(self._stream_ids, self.datasets, strict=True)
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore this rank's streams; start over (with a warning) if absent or mismatched."""
        if not state_dict:
            return
        for sid, ds in zip(self._stream_ids, self.datasets, strict=True):
            key = f"dp_rank_{sid}"
            if key not in state_dict:
                logger.warning("Dataloader state has no %s entry; starting from scratch", key)
                continue
            state = state_dict[key]
            saved = int(state["num_streams"]) if "num_streams" in state else None
            if saved != self.num_streams:
                logger.warning(
                    "Dataloader state was saved with %s data streams, now %s; starting from "
                    "scratch",
                    saved,
                    self.num_streams,
                )
                continue
            ds.load_state_dict(state)


def build_dataloader(
    cfg: Dataloader,
    *,
    tokenizer: Tokenizer,
    local_batch_size: int,
    seq_len: int,
    dp_rank: int = 0,
    dp_world_size: int = 1,
    infinite: bool = True,
) -> ParallelAwareDataloader | PreparedDataloader:
    """The dataloader of the data ``cfg`` names, for this dp rank.

    A prepared dataset (``cfg.location`` holds a manifest) or a ``cfg.mix`` of prepared datasets
    gets the prepared loader (``titan_core.data.reader``: ``shuffle``, ``seed``, ``verify``,
    ``prefetch``, ``cache_mb``, ``document_masking`` apply, and ``streams`` does not: any DP
    degree sees the same global batches). Raw text is tokenized here: ``cfg.streams`` (0 =
    ``dp_world_size``) must be a multiple of ``dp_world_size`` whose per-rank share divides
    ``local_batch_size``.
    """
    if cfg.mix or shards.is_prepared(cfg.location):
        return build_prepared_dataloader(
            cfg,
            fingerprint=tokenizer.fingerprint,
            local_batch_size=local_batch_size,
            seq_len=seq_len,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            infinite=infinite,
        )
    if cfg.document_masking:
        raise ConfigError(
            f"dataloader.document_masking: needs a prepared dataset (titan data prepare), got "
            f"{cfg.location!r}"
        )
    num_streams = cfg.streams or dp_world_size
    if num_streams % dp_world_size or local_batch_size % (num_streams // dp_world_size):
        raise DataError(
            f"dataloader.streams: expected a multiple of the data-parallel degree "
            f"({dp_world_size}) whose share per rank divides training.local_batch_size "
            f"({local_batch_size}), got {num_streams}"
        )
    k = num_streams // dp_world_size
    packed = []
    for stream in range(dp_rank * k, dp_rank * k + k):
        source = build_document_source(cfg, dp_rank=stream, dp_world_size=num_streams)
        source.check_nonempty()
        packed.append(TextPackingDataset(source, tokenizer, seq_len, infinite=infinite))
    return ParallelAwareDataloader(
        packed,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        num_streams=num_streams,
    )
