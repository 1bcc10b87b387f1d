"""Prepared datasets written straight from token lists (shards.write_shard + write_manifest),
so reader tests need not run the prepare stage."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from titan_core.data import shards
from titan_core.data.tokenizer import Tokenizer

TOKENIZER = {"fingerprint": "f" * 64, "vocab_size": 50_000, "bos_id": 0, "eos_id": 1, "path": "-"}


def write_docs(
    url: str,
    train: list[list[list[int]]],
    validation: list[list[list[int]]] = (),  # type: ignore[assignment]
    *,
    tokenizer: dict | None = None,
    fingerprint: str = "",
) -> shards.Manifest:
    """A prepared dataset at ``url`` whose shards hold the given documents (token id lists):
    ``train[k]`` is the k-th train shard's documents; returns its manifest."""
    tokenizer = tokenizer or TOKENIZER
    dtype = shards.token_dtype(tokenizer["vocab_size"])
    infos = []
    for split, groups in (("train", train), ("validation", validation)):
        for k, docs in enumerate(groups):
            flat = np.array([t for doc in docs for t in doc], dtype=dtype)
            ends = np.cumsum([len(doc) for doc in docs], dtype=np.int64)
            name = f"unit{k:04d}-{split}"
            sha_tokens, sha_docs = shards.write_shard(url, name, flat, ends)
            infos.append(
                shards.ShardInfo(
                    name=name,
                    split=split,
                    unit=f"unit{k:04d}",
                    source=f"test-source-{k}",
                    num_docs=len(docs),
                    num_tokens=len(flat),
                    sha256_tokens=sha_tokens,
                    sha256_docs=sha_docs,
                )
            )
    manifest = shards.Manifest(
        fingerprint=fingerprint or url.rstrip("/").rsplit("/", 1)[-1],
        tokenizer=tokenizer,
        dtype=dtype.str,
        text_field="text",
        sources=[url],  # metric names of a mix start with the folder name
        validation={"rule": "every_nth_document", "every": 10 if validation else 0},
        shards=infos,
    )
    shards.write_manifest(url, manifest)
    return manifest


def random_docs(seed: int, num_shards: int, docs_per_shard: int, vocab: int = 50_000) -> list:
    """Documents of random ids and lengths 1..300 (``[[doc, ...] per shard]``)."""
    rng = np.random.default_rng(seed)
    return [
        [rng.integers(2, vocab, rng.integers(1, 300)).tolist() for _ in range(docs_per_shard)]
        for _ in range(num_shards)
    ]


def corpus_texts(corpus: Path, split: str) -> list[list[str]]:
    """The bundled corpus's documents of ``split``, one list per jsonl file."""
    return [
        [json.loads(line)["text"] for line in f.read_text().splitlines() if line.strip()]
        for f in sorted((corpus / split).glob("*.jsonl"))
    ]


def prepare_corpus(url: str, tokenizer: Tokenizer, corpus: Path, max_files: int = 0) -> str:
    """The bundled corpus as a prepared dataset at ``url`` (one shard per file), tokenized as
    prepare_data does (``[bos] + tokens + [eos]`` per document); returns ``url``."""

    def encode(files: list[list[str]]) -> list[list[list[int]]]:
        files = files[:max_files] if max_files else files
        return [[tokenizer.encode(t, bos=True, eos=True) for t in docs] for docs in files]

    write_docs(
        url,
        encode(corpus_texts(corpus, "train")),
        encode(corpus_texts(corpus, "validation")),
        tokenizer=shards.tokenizer_info(tokenizer),
        fingerprint="corpus" + tokenizer.fingerprint[:10],
    )
    return url


def cli_in_child(argv: list[str], log: str) -> None:
    """The body of a forkserver child: ``titan *argv`` through the CLI's own entry point (its
    Ctrl-C handling included), stdout and stderr to ``log``, its exit code the child's."""
    import os
    import signal
    import sys

    from titan_core.cli import main

    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C is KeyboardInterrupt
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)  # the parent waits for it
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
