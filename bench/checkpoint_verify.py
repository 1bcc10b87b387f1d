"""What checkpoint checksums cost: a DCP save with and without them, and the check before a load.

One process builds a ~300 MB fp32 state (model-like: a 16k x 512 embedding and output, 2 layers of
attention and MLP matrices, and twice as many optimizer-moment bytes, as AdamW keeps) and saves
it with DCP's own ``FileSystemWriter`` and with titan's writer (``dcp_writer``: the same writer,
hashing each file's bytes as they are written) in pairs whose order alternates (plain first,
then checksummed first), each save into a fresh folder, fsync on (DCP's default, as in
training). Per pair, checksummed / plain - 1; the estimate is order-balanced, the mean of the
medians over each order, so that the position of a save in its pair cancels (the page cache and
writeback of the save before it). The same is done with the stdlib fallback hash (CRC-32, where
xxhash is missing) and with the plain writer on both sides (an A/A check: the method's own
error). "CPU" is the save's own CPU time (``time.process_time``), which other jobs on the
machine barely move: its overhead is what the wall-time figure tends to on an idle machine.

On load, the check (``integrity.file_damage``: every data file read whole against its digest)
is timed against ``dcp.load`` of the same checkpoint, alternating which goes first; both read
from the page cache, as a resume right after a save does (from a cold disk or an object store,
the check costs one more read of every byte, as much as the load itself reads).

The table also gives each candidate hash's throughput here on one core (why XXH3, and CRC-32 as
the fallback). The last line is the save overhead of checksums (goal <= 5% of the save time).

    .venv/bin/python bench/checkpoint_verify.py [--pairs 8] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from _common import add_quick, final_line
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from titan_core.checkpoint import integrity
from titan_core.checkpoint.dcp_io import dcp_writer

Pair = tuple[tuple[float, float], tuple[float, float]]  # ((wall, cpu) of A, (wall, cpu) of B)


def state(layers: int, dim: int, vocab: int) -> dict[str, torch.Tensor]:
    """Model-like tensors (``model.*``) and AdamW's two moments per tensor (``optim.*``)."""
    shapes = {"tok_embeddings": (vocab, dim), "output": (vocab, dim)}
    for i in range(layers):
        shapes |= {f"layers.{i}.{n}": (dim, dim) for n in ("wq", "wk", "wv", "wo")}
        shapes |= {f"layers.{i}.{n}": (4 * dim, dim) for n in ("w1", "w2", "w3")}
        shapes[f"layers.{i}.norm"] = (dim,)
    gen = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        out[f"model.{name}"] = torch.randn(shape, generator=gen)
        for moment in ("exp_avg", "exp_avg_sq"):
            out[f"optim.{name}.{moment}"] = torch.randn(shape, generator=gen)
    return out


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall, CPU) seconds of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


@contextlib.contextmanager
def hashing(algorithm: str) -> Iterator[None]:
    """Checksummed saves use ``algorithm`` (one of ``integrity.HASHES``) meanwhile."""
    saved = integrity.HASHES
    integrity.HASHES = {algorithm: saved[algorithm]}
    try:
        yield
    finally:
        integrity.HASHES = saved


def save_seconds(sd: dict[str, torch.Tensor], root: Path, checksums: bool) -> tuple[float, float]:
    """(wall, CPU) seconds of one DCP save into a fresh folder (removed after, untimed)."""
    folder = Path(tempfile.mkdtemp(dir=root))
    writer = dcp_writer(str(folder)) if checksums else FileSystemWriter(str(folder))
    try:
        return timed(lambda: dcp.save(sd, storage_writer=writer, no_dist=True))
    finally:
        shutil.rmtree(folder)


def balanced(pairs: list[Pair], which: int) -> float:
    """Order-balanced overhead of A over B (``which``: 0 wall, 1 CPU) from pairs whose order
    alternated, A first in the even ones: the mean of the medians of A / B - 1 per order."""
    ratios = [a[which] / b[which] - 1 for a, b in pairs]
    return (statistics.median(ratios[0::2]) + statistics.median(ratios[1::2])) / 2


def paired_saves(sd: dict, root: Path, n: int, a_sums: bool) -> list[Pair]:
    """``n`` pairs (A, B): A with checksums if ``a_sums`` (else plain: the A/A check), B plain;
    A first in even pairs, B first in odd ones."""
    pairs = []
    for i in range(n):
        if i % 2 == 0:
            a = save_seconds(sd, root, a_sums)
            b = save_seconds(sd, root, False)
        else:
            b = save_seconds(sd, root, False)
            a = save_seconds(sd, root, a_sums)
        pairs.append((a, b))
    return pairs


def hash_table(mb: int) -> None:
    """Throughput of each candidate hash on one core, best of 3."""
    data = memoryview(os.urandom(mb << 20))
    hashes: dict[str, Callable[[], object]] = {
        "crc32 (zlib)": lambda: zlib.crc32(data),
        "adler32 (zlib)": lambda: zlib.adler32(data),
        **{n: (lambda n=n: hashlib.new(n, data).digest()) for n in ("sha1", "sha256", "blake2b")},
    }
    if "xxh3_64" in integrity.HASHES:
        hashes["xxh3_64 (xxhash)"] = lambda: integrity.HASHES["xxh3_64"]().update(data)
    print(f"hash throughput, one core, {mb} MB buffer (best of 3)")
    print("| hash | GB/s |\n|---|---:|")
    for name, fn in hashes.items():
        best = min(timed(fn)[0] for _ in range(3))
        print(f"| {name} | {(mb << 20) / best / 1e9:.2f} |")
    print()


def load_check(sd: dict[str, torch.Tensor], root: Path, rounds: int) -> tuple[float, float]:
    """Median seconds of (the check of every data file, ``dcp.load``), alternating first."""
    ckpt = root / "ckpt"
    writer = dcp_writer(str(ckpt))
    dcp.save(sd, storage_writer=writer, no_dist=True)
    sizes = {p.name: p.stat().st_size for p in ckpt.iterdir()}
    files = {n: e for n, e in writer.files.items() if n != ".metadata"}
    target = {k: torch.empty_like(v) for k, v in sd.items()}

    def check() -> None:
        assert integrity.file_damage(str(ckpt), files, sizes) is None

    def load() -> None:
        dcp.load(target, storage_reader=FileSystemReader(str(ckpt)), no_dist=True)

    checks, loads = [], []
    for i in range(rounds):
        if i % 2 == 0:
            checks.append(timed(check)[0])
            loads.append(timed(load)[0])
        else:
            loads.append(timed(load)[0])
            checks.append(timed(check)[0])
    return statistics.median(checks), statistics.median(loads)


def row(name: str, pairs: list[Pair], mb: float) -> str:
    """A table row: median wall seconds and MB/s of A, its wall and CPU overheads over B."""
    wall = statistics.median(a[0] for a, _ in pairs)
    return (
        f"| {name} | {wall:.3f} | {mb / wall:,.0f} | {balanced(pairs, 0):+.1%} "
        f"| {balanced(pairs, 1):+.1%} |"
    )


def main() -> None:
    """Build the state, time the saves and the load check, print the tables and the figure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=8, help="pairs per comparison (even)")
    add_quick(parser)
    a = parser.parse_args()
    torch.set_num_threads(1)
    pairs, (layers, dim, vocab), hash_mb = a.pairs, (2, 512, 16000), 64
    if a.quick:
        pairs, (layers, dim, vocab), hash_mb = 2, (1, 64, 1000), 1
    sd = state(layers, dim, vocab)
    mb = sum(t.numel() * t.element_size() for t in sd.values()) / 1e6
    default = next(iter(integrity.HASHES))
    hash_table(hash_mb)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        save_seconds(sd, root, True)  # warm-up: allocator, page cache, DCP's first-call costs
        sums = paired_saves(sd, root, pairs, True)
        with hashing("crc32"):
            crc = paired_saves(sd, root, pairs, True)
        same = paired_saves(sd, root, pairs, False)
        check_s, load_s = load_check(sd, root, max(pairs, 2))
    plain = statistics.median(b[0] for _, b in sums + crc + same)
    print(f"checkpoint: {mb:.0f} MB fp32 in one file ({len(sd)} tensors), fsync on; {pairs} pairs")
    print("| save | median s | MB/s | overhead (wall) | overhead (CPU) |")
    print("|---|---:|---:|---:|---:|")
    print(f"| plain DCP writer | {plain:.3f} | {mb / plain:,.0f} | | |")
    print(row(f"with checksums ({default}, the default)", sums, mb))
    print(row("with checksums (crc32, the fallback)", crc, mb))
    print(row("plain vs plain (A/A: the method's error)", same, mb))
    print()
    print(f"| load ({default}) | median s | MB/s |\n|---|---:|---:|")
    print(f"| dcp.load (page cache) | {load_s:.3f} | {mb / load_s:,.0f} |")
    print(f"| check before the load (every byte) | {check_s:.3f} | {mb / check_s:,.0f} |")
    print()
    print(f"check before load / load: {check_s / load_s:.1%}; / plain save: {check_s / plain:.1%}")
    final_line(f"checksum cost on save ({default})", f"{balanced(sums, 0) * 100:.1f}%", "<= 5%")


if __name__ == "__main__":
    main()
