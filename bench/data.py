"""The prepared-data path, measured: prepare throughput, loader throughput, resume cost, RSS.

Four measurements in one run, each against the yardstick the issue names:

1. **Prepare throughput** — ``prepare`` (reading files, tokenizing, writing shards and the
   manifest) on ``--files`` copies of the bundled corpus with every core, against the
   tokenizer's own single-process rate (``Tokenizer.encode`` on the same documents, already in
   memory, one process, one thread) × the number of processes. Rounds alternate the two.
   Goal >= 0.8.
2. **Loader tokens/s per rank** — a ``PreparedDataloader`` (shuffled windows, ``seq_len`` 2048,
   batch 8, prefetch off, so the figure is the read path itself) over a synthetic local dataset
   (memory-mapped) and over the same dataset's first shards on a real S3 server (SeaweedFS from
   the dev extra; ranged reads through the block cache), with the bytes fetched from S3 against
   the dataset's size. Goal >= 1M tokens/s locally.
3. **Time to the first batch after a resume** at sample 0 and at 10^9 tokens, from a fresh
   process that builds the loader, loads the state and takes one batch. Goal: within 2×.
4. **Loader RSS** — the growth of a fresh process's resident memory (imports done; mapped shard
   pages count) while it reads the same number of batches from a 1 GB and an 8 GB dataset.
   Goal: flat.

The synthetic datasets are written once under ``--workdir`` (random ids of the bundled
tokenizer's vocabulary, documents of random length; 9 GB of disk) and reused by later runs.
The last line is the prepare ratio.

    .venv/bin/python bench/data.py [--rounds 3] [--files 8] [--workdir /tmp/titan-bench-data]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from _common import add_quick, final_line

SEQ_LEN, BATCH = 2048, 8
SHARD_TOKENS = 1 << 28  # 512 MB of uint16 per shard
_CHILD = "--child"


def _tokenizer():
    from titan_core.data.assets import default_tokenizer_path
    from titan_core.data.tokenizer import Tokenizer

    return Tokenizer(default_tokenizer_path())


# ---------------------------------------------------------------------------- 1. prepare
def _corpus(work: Path, copies: int) -> tuple[Path, list[str]]:
    """``copies`` jsonl files of the bundled corpus's documents (one unit of work each)."""
    from titan_core.data.assets import bundled_corpus_dir
    from titan_core.data.sources import list_source, read_documents

    src = bundled_corpus_dir() / "train"
    docs = [d for f in list_source(str(src)) for d in read_documents(f.url, "text")]
    folder = work / f"corpus-{copies}"
    if not folder.exists():
        folder.mkdir(parents=True)
        for i in range(copies):
            with open(folder / f"part-{i:03d}.jsonl", "w") as f:
                for doc in docs:
                    f.write(json.dumps({"text": doc}) + "\n")
    return folder, docs


def _encode_rate(docs: list[str]) -> tuple[float, int]:
    tokenizer = _tokenizer()
    start = time.perf_counter()
    tokens = sum(len(tokenizer.encode(d, bos=True, eos=True)) for d in docs)
    return tokens / (time.perf_counter() - start), tokens


def _encode_worker(docs: list[str]) -> int:
    tokenizer = _tokenizer()
    return sum(len(tokenizer.encode(d, bos=True, eos=True)) for d in docs)


def _parallel_encode_rate(docs: list[str], processes: int) -> float:
    """The bare encode loop in ``processes`` processes at once (documents already in each
    process's memory): what this machine's cores give when nothing else is done."""
    import multiprocessing

    shares = [docs[i::processes] for i in range(processes)]
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        pool.map(_encode_worker, [d[:50] for d in shares])  # workers started and warm
        start = time.perf_counter()
        tokens = sum(pool.map(_encode_worker, shares))
    return tokens / (time.perf_counter() - start)


def _prepare_rate(folder: Path, out: Path, workers: int) -> tuple[float, int]:
    from titan_core.data.assets import default_tokenizer_path
    from titan_core.data.prepare import PrepareSpec, prepare

    shutil.rmtree(out, ignore_errors=True)
    spec = PrepareSpec(
        sources=(str(folder),), tokenizer_path=str(default_tokenizer_path()), root=str(out)
    )
    start = time.perf_counter()
    result = prepare(spec, workers=workers)
    return result.tokens / (time.perf_counter() - start), result.tokens


# ---------------------------------------------------------------------------- synthetic data
def _synthetic(root: Path, num_tokens: int, name: str) -> str:
    """A prepared dataset of ``num_tokens`` random ids (train split only), written once."""
    import numpy as np

    from titan_core.data import shards

    url = str(root / name)
    if shards.is_prepared(url):
        return url
    tokenizer = _tokenizer()
    rng = np.random.default_rng(0)
    infos = []
    for i, start in enumerate(range(0, num_tokens, SHARD_TOKENS)):
        n = min(SHARD_TOKENS, num_tokens - start)
        tokens = rng.integers(0, tokenizer.n_words, n, dtype=np.uint16)
        ends = np.cumsum(rng.integers(200, 4000, n // 200 + 1))
        ends = np.append(ends[ends < n], n)
        sha_tokens, sha_docs = shards.write_shard(url, f"s{i:04d}-train", tokens, ends)
        infos.append(
            shards.ShardInfo(
                name=f"s{i:04d}-train",
                split="train",
                unit=f"s{i:04d}",
                source="synthetic",
                num_docs=len(ends),
                num_tokens=n,
                sha256_tokens=sha_tokens,
                sha256_docs=sha_docs,
            )
        )
    fingerprint = hashlib.sha256(name.encode()).hexdigest()[:16]
    manifest = shards.Manifest(
        fingerprint=fingerprint,
        tokenizer=shards.tokenizer_info(tokenizer),
        dtype=shards.token_dtype(tokenizer.n_words).str,
        text_field="text",
        sources=["synthetic"],
        validation={"rule": "every_nth_document", "every": 0},
        shards=infos,
    )
    shards.write_manifest(url, manifest)
    return url


def _loader(url: str, prefetch: int = 0):
    from titan_core.config.job import Dataloader
    from titan_core.data.reader import build_prepared_dataloader

    return build_prepared_dataloader(
        Dataloader(dataset=url, prefetch=prefetch),
        fingerprint=_tokenizer().fingerprint,
        local_batch_size=BATCH,
        seq_len=SEQ_LEN,
    )


def _loader_rate(url: str, batches: int) -> tuple[float, dict[str, int]]:
    loader = _loader(url)
    it = iter(loader)
    next(it)  # opening files and the first block are not the steady state
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    rate = batches * BATCH * SEQ_LEN / (time.perf_counter() - start)
    return rate, loader.read_stats()


# ---------------------------------------------------------------------------- 3/4. children
def _child(kind: str, url: str, arg: int) -> None:
    """Runs in a fresh process: ``resume`` (seconds to the first batch at token ``arg``) or
    ``rss`` (peak RSS growth in MB over ``arg`` batches)."""
    import torch

    import titan_core.data.reader  # noqa: F401

    process = psutil.Process()
    base = process.memory_info().rss
    start = time.perf_counter()
    loader = _loader(url)
    if kind == "resume":
        state = loader.state_dict()
        state["source0_consumed"] = torch.tensor(arg // SEQ_LEN)
        loader.load_state_dict(state)
        next(iter(loader))
        print(json.dumps({"seconds": time.perf_counter() - start}))
        return
    it = iter(loader)
    peak = 0
    for _ in range(arg):
        next(it)
        peak = max(peak, process.memory_info().rss)  # current RSS, mapped shard pages included
    print(json.dumps({"rss_mb": (peak - base) / 2**20}))


def _run_child(kind: str, url: str, arg: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, _CHILD, kind, url, str(arg)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- S3
def _s3_rate(local_url: str, batches: int, work: Path) -> tuple[float, int, int]:
    """(tokens/s, bytes fetched, dataset bytes) reading the first 2 shards from a real S3."""
    from titan_core.data import shards
    from titan_core.testing.s3 import clear_fsspec_s3_cache, start_s3_server

    manifest = shards.read_manifest(local_url)
    manifest.shards = manifest.shards[:2]
    server = start_s3_server(work / "s3")
    try:
        os.environ.update(server.env())
        clear_fsspec_s3_cache()
        fs = server.filesystem()
        remote = server.url("bench-data")
        for shard in manifest.shards:
            for path in shards.shard_urls(local_url, shard):
                fs.put_file(path, shards.shard_urls(remote, shard)[path.endswith(".docs")])
        shards.write_manifest(remote, manifest)
        size = sum(s.num_tokens * 2 + s.num_docs * 8 for s in manifest.shards)
        rate, stats = _loader_rate(remote, batches)
        return rate, stats["bytes_read"], size
    finally:
        server.stop()


# ---------------------------------------------------------------------------- main
def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == _CHILD:
        _child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--files", type=int, default=24, help="corpus copies to prepare")
    parser.add_argument(
        "--workdir", default=os.path.join(tempfile.gettempdir(), "titan-bench-data")
    )
    parser.add_argument("--batches", type=int, default=200)
    add_quick(parser)
    ns = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if ns.quick:
        with tempfile.TemporaryDirectory(prefix="titan-bench-data-") as tmp:
            ns.rounds, ns.files, ns.batches, ns.workdir = 1, 1, 8, tmp
            run(ns, sizes=((1 << 20, "synthetic-2mb"), (1 << 22, "synthetic-8mb")))
    else:
        run(ns, sizes=((1 << 29, "synthetic-1gb"), (1 << 32, "synthetic-8gb")))


def run(ns: argparse.Namespace, sizes: tuple[tuple[int, str], tuple[int, str]]) -> None:
    """Every measurement, then the table; ``sizes`` are the two synthetic datasets' token
    counts and names (a small one and a large one)."""
    work = Path(ns.workdir)
    work.mkdir(parents=True, exist_ok=True)
    processes = os.cpu_count() or 1

    folder, docs = _corpus(work, ns.files)
    docs = docs * ns.files  # the same documents prepare reads
    ratios, encode_rates, prepare_rates, parallel_rates = [], [], [], []
    for r in range(ns.rounds):
        steps = ("encode", "parallel", "prepare")
        rates = {}
        for step in steps if r % 2 == 0 else steps[::-1]:
            if step == "encode":
                rates[step], _ = _encode_rate(docs)
            elif step == "parallel":
                rates[step] = _parallel_encode_rate(docs, processes)
            else:
                rates[step], _ = _prepare_rate(folder, work / "prepared", processes)
        encode_rates.append(rates["encode"])
        parallel_rates.append(rates["parallel"])
        prepare_rates.append(rates["prepare"])
        ratios.append(rates["prepare"] / (rates["encode"] * processes))

    (small_tokens, small_name), (large_tokens, large_name) = sizes
    small = _synthetic(work, small_tokens, small_name)  # full mode: 2^29 uint16 tokens = 1 GiB
    large = _synthetic(work, large_tokens, large_name)  # full mode: 8 GiB
    far = min(10**9, large_tokens // 2)  # a resume point far into the data
    local_rates = [_loader_rate(large, ns.batches)[0] for _ in range(ns.rounds)]
    s3_rate, s3_bytes, s3_size = _s3_rate(large, max(ns.batches // 4, 10), work)
    resume: dict[int, list[float]] = {0: [], far: []}
    for r in range(ns.rounds):
        for tokens in (0, far) if r % 2 == 0 else (far, 0):
            resume[tokens].append(_run_child("resume", large, tokens)["seconds"])
    rss = {name: _run_child("rss", url, ns.batches)["rss_mb"] for name, url in
           ((_size(small_tokens), small), (_size(large_tokens), large))}  # fmt: skip

    med = statistics.median
    print(f"{'measurement':<52} {'value':>14}  goal")
    print(f"{'tokenizer encode, 1 process (tokens/s)':<52} {med(encode_rates):>14,.0f}")
    print(f"{f'tokenizer encode, {processes} processes at once (tokens/s)':<52} "
          f"{med(parallel_rates):>14,.0f}")  # fmt: skip
    print(f"{'  (the cores scale encode by)':<52} {med(parallel_rates) / med(encode_rates):>14.2f}")
    print(f"{f'prepare, {processes} processes (tokens/s)':<52} {med(prepare_rates):>14,.0f}")
    print(f"{'  prepare / encode in as many processes':<52} "
          f"{med(prepare_rates) / med(parallel_rates):>14.2f}")  # fmt: skip
    print(f"{'loader, local memmap (tokens/s per rank)':<52} {med(local_rates):>14,.0f}  >= 1M")
    print(f"{'loader, S3 ranged reads (tokens/s per rank)':<52} {s3_rate:>14,.0f}")
    print(f"{'  S3 bytes fetched / dataset bytes':<52} {s3_bytes / s3_size:>14.3f}  << 1")
    r0, r9 = med(resume[0]), med(resume[far])
    print(f"{'first batch after resume at 0 tokens (s)':<52} {r0:>14.3f}")
    print(f"{f'first batch after resume at {far:.0e} tokens (s)':<52} {r9:>14.3f}  <= 2x")
    print(f"{f'  resume {far:.0e} / resume 0':<52} {r9 / r0:>14.2f}")
    for name, mb in rss.items():
        print(f"{f'loader RSS growth, {name} dataset (MB)':<52} {mb:>14.1f}  flat")
    print(f"prepare ratio per round: {', '.join(f'{x:.2f}' for x in ratios)}")
    final_line(
        f"prepare ratio (prepare / (encode x {processes} processes))",
        f"{med(ratios):.2f}",
        ">= 0.8",
    )


def _size(tokens: int) -> str:
    """A dataset's size in uint16 tokens, as GB or MB."""
    return f"{tokens * 2 / 2**30:.0f} GB" if tokens >= 1 << 29 else f"{tokens * 2 / 2**20:.0f} MB"


if __name__ == "__main__":
    main()
