"""Sample order without index arrays: a seeded permutation per epoch, mixing by weight, cursors.

Everything here is a pure function of a few integers, so the loader's state stays O(1) whatever
the dataset size: ``Permutation`` maps a position of an epoch to a sample index in O(1) memory,
``assign_sources`` deals global samples to mixed datasets deterministically, and ``Cursor``
tracks one dataset's (epoch, position, shards in use).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import numpy as np

_MASK64 = (1 << 64) - 1
_ROUNDS = 6


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer on uint64 arrays (wrapping arithmetic): a strong bit mixer."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def derive_key(*parts: object) -> int:
    """A 64-bit key from any printable parts (seed, epoch, dataset fingerprint...)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class Permutation:
    """A seeded bijection of ``[0, n)``, evaluated pointwise with O(1) memory.

    A balanced Feistel network permutes the smallest domain of 2^(2h) >= n values (at most 4n);
    values that land outside ``[0, n)`` are mapped again until they fall inside (cycle walking),
    which keeps it a bijection of ``[0, n)``; on average fewer than 4 rounds of walking.
    """

    def __init__(self, n: int, key: int) -> None:
        if n < 1:
            raise ValueError(f"Permutation: expected n >= 1, got {n}")
        self.n = n
        self._half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
        self._half_mask = np.uint64((1 << self._half_bits) - 1)
        keys = [derive_key(key, r) for r in range(_ROUNDS)]
        self._keys = [np.uint64(k) for k in keys]

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        h, mask = np.uint64(self._half_bits), self._half_mask
        left, right = x >> h, x & mask
        for k in self._keys:
            left, right = right, left ^ (_splitmix64(right ^ k) & mask)
        return (left << h) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """Sample indices (int64) of ``positions`` (ints in ``[0, n)``)."""
        x = np.asarray(positions, dtype=np.uint64).copy()
        if x.size and int(x.max()) >= self.n:
            raise IndexError(f"Permutation: position {int(x.max())} out of range [0, {self.n})")
        todo = np.arange(x.size)
        while todo.size:
            x[todo] = self._feistel(x[todo])
            todo = todo[x[todo] >= np.uint64(self.n)]
        return x.astype(np.int64)


class Identity:
    """The unshuffled order: position i is sample i."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """``positions`` as int64."""
        return np.asarray(positions, dtype=np.int64)


def assign_sources(
    weights: list[float], counts: list[int], num: int, bases: list[int] | None = None
) -> np.ndarray:
    """Which dataset each of the next ``num`` global samples comes from; updates ``counts``.

    Global sample j (counted from ``bases``, the counts when the weights last changed) goes to
    the dataset with the largest deficit ``w_s * (j + 1) - (count_s - base_s)`` (ties to the
    lower index): every prefix since the bases is within one sample of the weights, and the
    sequence depends only on the counts and bases. Without a rebase, new weights would be met
    over the whole run: a dataset ahead of its new share would get nothing for a long while.
    """
    out = np.zeros(num, dtype=np.int64)
    if len(weights) == 1:
        counts[0] += num
        return out
    bases = bases or [0] * len(weights)
    counts_since = [c - b for c, b in zip(counts, bases, strict=True)]
    result = _assign(weights, counts_since, num)
    for s, since in enumerate(counts_since):
        counts[s] = bases[s] + since
    return result


def _assign(weights: list[float], counts: list[int], num: int) -> np.ndarray:
    out = np.zeros(num, dtype=np.int64)
    j = sum(counts)
    for i in range(num):
        j += 1
        best, best_deficit = 0, weights[0] * j - counts[0]
        for s in range(1, len(weights)):
            deficit = weights[s] * j - counts[s]
            if deficit > best_deficit:
                best, best_deficit = s, deficit
        counts[best] += 1
        out[i] = best
    return out


@dataclass(frozen=True)
class Cursor:
    """One dataset's place in its sample order: ``consumed`` samples of ``epoch`` are done,
    and the epoch draws from the first ``num_shards`` shards of the split."""

    epoch: int = 0
    consumed: int = 0
    num_shards: int = 0
    count: int = 0
    """Samples drawn from this dataset so far, over every epoch (for the mix)."""
    base: int = 0
    """``count`` when the mix's weights last changed: deficits are measured from there."""


def locate(
    cursor: Cursor, offsets: np.ndarray, epoch_samples: int, next_samples: int
) -> tuple[np.ndarray, np.ndarray]:
    """(epoch, position) of the samples ``offsets`` (ascending, >= 0) after ``cursor``.

    The current epoch holds ``epoch_samples`` samples (its shard prefix); later epochs hold
    ``next_samples`` (every shard).
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    left = epoch_samples - cursor.consumed
    later = np.maximum(offsets - left, 0)
    in_current = offsets < left
    epochs = np.where(in_current, cursor.epoch, cursor.epoch + 1 + later // next_samples)
    positions = np.where(in_current, cursor.consumed + offsets, later % next_samples)
    return epochs, positions


def advance(
    cursor: Cursor, num: int, epoch_samples: int, next_samples: int, all_shards: int
) -> Cursor:
    """``cursor`` after ``num`` more samples; a new epoch takes every shard (``all_shards``)."""
    if num == 0:
        return cursor
    left = epoch_samples - cursor.consumed
    count = cursor.count + num
    if num < left:
        return replace(cursor, consumed=cursor.consumed + num, count=count)
    rest = num - left
    return Cursor(
        epoch=cursor.epoch + 1 + rest // next_samples,
        consumed=rest % next_samples,
        num_shards=all_shards,
        count=count,
        base=cursor.base,
    )
