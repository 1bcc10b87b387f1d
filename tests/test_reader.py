"""The prepared-data loader: windows, sample order, O(1) resume at any DP degree, prefetch,
mixing, validation passes, remote ranged reads, bad data, and training from prepared data."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch
from prepared_helpers import TOKENIZER, prepare_corpus, random_docs, write_docs
from storage_faults import overwrite

from titan_core.config.job import Dataloader
from titan_core.data import shards, windows
from titan_core.data.loader import build_dataloader
from titan_core.data.reader import PreparedDataloader, build_prepared_dataloader
from titan_core.data.sampling import Permutation, derive_key
from titan_core.data.tokenizer import Tokenizer
from titan_core.errors import DataError

FP = TOKENIZER["fingerprint"]


LOADER_ARGS = ("fingerprint", "local_batch_size", "seq_len", "dp_rank", "dp_world_size", "infinite")


def _loader(datasets: str | list[tuple[str, float]], **kwargs: Any) -> PreparedDataloader:
    """The loader of one prepared dataset or a [(url, weight)] mix; ``kwargs`` holds
    ``Dataloader`` fields (prefetch 0 unless given) and the loader's own ``LOADER_ARGS``."""
    args = {"fingerprint": FP, "local_batch_size": 4, "seq_len": 16}
    args |= {k: kwargs.pop(k) for k in LOADER_ARGS if k in kwargs}
    if isinstance(datasets, str):
        data: dict[str, Any] = {"dataset": datasets}
    else:
        data = {"mix": [f"{url}={weight}" for url, weight in datasets]}
    return build_prepared_dataloader(Dataloader(**({"prefetch": 0} | data | kwargs)), **args)


def _take(loader: PreparedDataloader, n: int) -> list[tuple[torch.Tensor, ...]]:
    it = iter(loader)
    try:
        return [next(it) for _ in range(n)]
    finally:
        it.close()


def _global(mix: Any, dp: int, n: int, global_batch: int = 8, **kwargs: Any) -> list[torch.Tensor]:
    """n global batches of inputs (G, seq) assembled from dp ranks' loaders."""
    per_rank = [
        _take(
            _loader(
                mix, local_batch_size=global_batch // dp, dp_rank=r, dp_world_size=dp, **kwargs
            ),
            n,
        )
        for r in range(dp)
    ]
    return [torch.cat([per_rank[r][m][0] for r in range(dp)]) for m in range(n)]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list]:
    """A dataset of 5 train shards (one shorter than a window) and its documents."""
    url = str(tmp_path_factory.mktemp("small") / "ds")
    docs = random_docs(0, 5, 12)
    docs[2] = [[7, 8, 9]]  # a 3-token shard: windows span it and its neighbours
    write_docs(url, docs, random_docs(1, 2, 10))
    return url, docs


# --- windows and order ---------------------------------------------------------------------------


def test_windows_and_doc_ids_equal_the_concatenated_stream(small: tuple[str, list]) -> None:
    url, docs = small
    stream = np.array([t for shard in docs for doc in shard for t in doc])
    doc_of = np.repeat(np.arange(sum(len(s) for s in docs)), [len(d) for s in docs for d in s])
    seq = 16
    num = (len(stream) - 1) // seq
    loader = _loader(url, shuffle=False, document_masking=True, seq_len=seq)
    assert loader.readers[0].num_samples() == num
    batches = _take(loader, num // 4)
    for m, (inputs, labels, doc_ids) in enumerate(batches):
        assert inputs.dtype == labels.dtype == torch.int64 and doc_ids.dtype == torch.int32
        for r in range(4):
            i = m * 4 + r
            assert inputs[r].tolist() == stream[i * seq : i * seq + seq].tolist()
            assert labels[r].tolist() == stream[i * seq + 1 : i * seq + seq + 1].tolist()
            window_docs = doc_of[i * seq : i * seq + seq]
            assert doc_ids[r].tolist() == (window_docs - window_docs[0]).tolist()
    assert max(int(b[2].max()) for b in batches) >= 2  # several documents in some sample


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 97, 1000, 4099, 65_536, 65_537])
def test_permutation_is_a_seeded_bijection(n: int) -> None:
    values = Permutation(n, 11)(np.arange(n))
    assert sorted(values.tolist()) == list(range(n))
    assert np.array_equal(values, Permutation(n, 11)(np.arange(n)))  # deterministic
    if n >= 97:
        assert not np.array_equal(values, Permutation(n, 12)(np.arange(n)))
        assert not np.array_equal(values, np.arange(n))
    # Pointwise: any subset evaluates alone to the same values (no state, no index array).
    picks = np.arange(n)[:: max(n // 7, 1)]
    assert np.array_equal(Permutation(n, 11)(picks), values[picks])


def test_shuffled_epochs_cover_every_sample_once(small: tuple[str, list]) -> None:
    url, _ = small
    reader = _loader(url).readers[0]
    num = reader.num_samples()
    loader = _loader(url, local_batch_size=1, seed=3)
    windows = [b[0][0] for b in _take(loader, 2 * num)]
    key = {tuple(reader.windows(np.array([i]))[0, :-1].tolist()): i for i in range(num)}
    epoch0, epoch1 = (
        [key[tuple(w.tolist())] for w in windows[e * num : (e + 1) * num]] for e in range(2)
    )
    assert sorted(epoch0) == sorted(epoch1) == list(range(num))
    assert epoch0 != epoch1 and epoch0 != list(range(num))
    other_seed = [b[0][0] for b in _take(_loader(url, local_batch_size=1, seed=4), num)]
    assert not _equal(other_seed, windows[:num])


# --- state, resume, DP degree, prefetch ----------------------------------------------------------


def test_state_is_a_few_integers_and_resume_is_o1(small: tuple[str, list]) -> None:
    """Loading a state 10^9 samples in reads only the next batch's windows, at once."""
    url, _ = small
    loader = _loader(url)
    state = loader.state_dict()
    assert all(v.dtype == torch.int64 and v.dim() == 0 for v in state.values())
    assert len(state) <= 9
    num = loader.readers[0].num_samples()
    far = 10**9
    state |= {
        "source0_epoch": torch.tensor(far // num),
        "source0_consumed": torch.tensor(far % num),
    }
    state["source0_count"] = torch.tensor(far)
    resumed = _loader(url)
    start = time.perf_counter()
    resumed.load_state_dict(state)
    ((inputs, _),) = _take(resumed, 1)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, elapsed
    itemsize = np.dtype(resumed.readers[0].dtype).itemsize
    assert resumed.read_stats()["bytes_read"] <= 4 * 17 * itemsize  # one batch of windows
    order = Permutation(num, derive_key(0, resumed.readers[0].manifest.fingerprint, far // num))
    expected = resumed.readers[0].windows(order(far % num + np.arange(4)))[:, :-1]
    assert inputs.tolist() == expected.tolist()
    assert int(resumed.state_dict()["source0_count"]) == far + 4


@pytest.mark.parametrize("mixed", [False, True])
def test_global_batches_independent_of_dp_degree(
    small: tuple[str, list], tmp_path: Path, mixed: bool
) -> None:
    url, _ = small
    mix: Any = url
    if mixed:
        write_docs(str(tmp_path / "other"), random_docs(5, 2, 9))
        mix = [(url, 2.0), (str(tmp_path / "other"), 1.0)]
    # 40 global batches of 8 run through several epochs of the small dataset.
    reference = _global(mix, 1, 40)
    assert _equal(_global(mix, 2, 40), reference)
    assert _equal(_global(mix, 4, 40), reference)


def test_prefetch_gives_the_same_batches_and_state(small: tuple[str, list]) -> None:
    url, _ = small
    plain, ahead = _loader(url, prefetch=0), _loader(url, prefetch=3)
    assert _equal([b[0] for b in _take(plain, 7)], [b[0] for b in _take(ahead, 7)])
    # The state is that of the batches handed out, not of those read ahead.
    assert {k: int(v) for k, v in ahead.state_dict().items()} == {
        k: int(v) for k, v in plain.state_dict().items()
    }
    assert int(ahead.state_dict()["source0_count"]) == 7 * 4
    assert not [t for t in threading.enumerate() if t.name == "titan-data-prefetch"]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_resume_mid_epoch_and_across_epochs_is_exact(
    small: tuple[str, list], prefetch: int
) -> None:
    url, _ = small
    num_batches = _loader(url).readers[0].num_samples() // 4
    total = 3 * num_batches
    reference = [b[0] for b in _take(_loader(url, prefetch=prefetch), total)]
    for k in (1, num_batches - 1, num_batches, num_batches + 2, 2 * num_batches + 1):
        first = _loader(url, prefetch=prefetch)
        _take(first, k)
        state = first.state_dict()
        resumed = _loader(url, prefetch=prefetch)
        resumed.load_state_dict(state)
        assert _equal([b[0] for b in _take(resumed, total - k)], reference[k:]), k
    # Resumed at another DP degree with the same global batch: the same global sequence.
    first = _loader(url, local_batch_size=8)
    _take(first, 3)
    halves = [_loader(url, dp_rank=r, dp_world_size=2) for r in range(2)]
    for half in halves:
        half.load_state_dict(first.state_dict())
    rest = zip(*(_take(h, 5) for h in halves), strict=True)
    again = [torch.cat([a[0], b[0]]) for a, b in rest]
    assert _equal(again, [b[0] for b in _take(_loader(url, local_batch_size=8), 8)][3:])


def test_new_shards_enter_at_the_next_epoch(tmp_path: Path) -> None:
    """A resume keeps the checkpoint's shard prefix until its epoch ends."""
    url = str(tmp_path / "grow")
    old = [[list(range(2 + 40 * k, 42 + 40 * k)) for _ in range(4)] for k in range(3)]
    write_docs(url, old)
    first = _loader(url, local_batch_size=2)
    num = first.readers[0].num_samples()
    _take(first, 3)
    new = [[[30_000 + i] * 50 for i in range(4)]]
    write_docs(url, old + new)  # an increment: same shards plus one
    resumed = _loader(url, local_batch_size=2)
    resumed.load_state_dict(first.state_dict())
    rest_of_epoch = num - 6
    batches = _take(resumed, rest_of_epoch // 2 + 12)
    epoch0 = torch.cat([b[0] for b in batches])[:rest_of_epoch]
    epoch1 = torch.cat([b[0] for b in batches])[rest_of_epoch:]
    assert int(epoch0.max()) < 30_000 and int(epoch1.max()) >= 30_000
    shrunk = str(tmp_path / "shrunk")
    write_docs(shrunk, old[:2], fingerprint="grow")
    with pytest.raises(DataError, match="manifest lists 2"):
        _loader(shrunk).load_state_dict(resumed.state_dict())


def test_mixing_shares_within_one_percent_and_resume_exact(tmp_path: Path) -> None:
    weights = {"a": 5.0, "b": 3.0, "c": 2.0}
    mix = []
    for s, name in enumerate(weights):
        lo = 2 + 10_000 * s  # each dataset's ids in its own range: the source of a sample shows
        docs = [[np.arange(lo, lo + 37 + k).tolist() for k in range(6)] for _ in range(2)]
        write_docs(str(tmp_path / name), docs)
        mix.append((str(tmp_path / name), weights[name]))
    kwargs = {"local_batch_size": 100, "seq_len": 8}
    loader = _loader(mix, **kwargs)
    batches = _take(loader, 100)  # 10,000 samples
    sources = torch.cat([b[0][:, 0] for b in batches]) // 10_000
    total = sum(weights.values())
    for s, (name, w) in enumerate(weights.items()):
        assert abs(float((sources == s).float().mean()) - w / total) <= 0.01, name
        assert loader.names[s].startswith(name)  # a readable name: folder, fingerprint
        assert abs(loader.metrics()[f"data/mix/{loader.names[s]}"] - w / total) <= 0.01
    assert abs(sum(loader.metrics().values()) - 1.0) < 1e-9
    first = _loader(mix, **kwargs)
    _take(first, 37)
    resumed = _loader(mix, **kwargs)
    resumed.load_state_dict(first.state_dict())
    assert _equal([b[0] for b in _take(resumed, 63)], [b[0] for b in batches[37:]])


def test_validation_pass_is_finite_ordered_and_equal_across_ranks(small: tuple[str, list]) -> None:
    url, _ = small
    num = _loader(url, split="validation").readers[0].num_samples()
    ranks = [
        _loader(
            url,
            split="validation",
            infinite=False,
            local_batch_size=3,
            dp_rank=r,
            dp_world_size=2,
            prefetch=2,
        )
        for r in range(2)
    ]
    passes = [[b[0] for b in ranks[r]] for r in range(2)]
    assert len(passes[0]) == len(passes[1]) == num // 6  # the incomplete global batch dropped
    ordered = _loader(url, split="validation", shuffle=False, local_batch_size=6)
    expected = [b[0] for b in _take(ordered, num // 6)]
    assert _equal([torch.cat([a, b]) for a, b in zip(*passes, strict=True)], expected)
    assert _equal([b[0] for b in ranks[0]], passes[0])  # every pass starts from the start
    next(iter(ranks[0]))  # abandoned after one batch: the prefetch thread still ends
    assert not [t for t in threading.enumerate() if t.name == "titan-data-prefetch"]
    with pytest.raises(DataError, match="fewer than one global batch"):
        _loader(url, split="validation", infinite=False, local_batch_size=num + 1)


# --- remote shards -------------------------------------------------------------------------------


def _watch_s3(fs: Any, bucket: str) -> list[tuple[str, str, Any]]:
    """Every request the (cached) s3fs client sends from now on: (operation, URL, Range)."""
    requests: list[tuple[str, str, Any]] = []
    fs.ls(bucket)  # connects: the client's event hooks exist from here on
    fs.invalidate_cache()  # listings cached so far would hide requests

    def record(request: Any, event_name: str, **_: Any) -> None:
        requests.append((event_name.rsplit(".", 1)[-1], request.url, request.headers.get("Range")))

    fs._s3.meta.events.register("before-send.s3", record)
    return requests


def _shard_bytes_fetched(requests: list[tuple[str, str, Any]]) -> int:
    """Bytes of shard files requested; fails on any unranged read or per-file HEAD of a shard."""
    shard = [(op, r) for op, url, r in requests if "/shards/" in url]
    assert shard and all(op == "GetObject" and r is not None for op, r in shard), shard[:5]
    ranges = [r.decode().removeprefix("bytes=").split("-") for _, r in shard]
    return sum(int(b) - int(a) + 1 for a, b in ranges)


def test_s3_reads_ranges_not_files(
    tmp_path: Path, s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shuffled batches from the real S3 server: shard sizes checked by one listing, every GET
    a ranged read, the bytes fetched a small fraction of the dataset, the windows equal to the
    local copy's."""
    s3_server.set_env(monkeypatch)
    docs = random_docs(7, 8, 1000)  # 2.4 MB of tokens
    url, local = s3_server.url(tmp_path.name, "ds"), str(tmp_path / "ds")
    for where in (url, local):
        write_docs(where, docs, fingerprint="remote")
    fs, _ = fsspec.core.url_to_fs(url)
    size = sum(fs.du(f"{s3_server.bucket}/{tmp_path.name}/ds/shards", total=False).values())
    requests = _watch_s3(fs, s3_server.bucket)
    kwargs = {"seq_len": 64, "document_masking": True}
    remote = _take(_loader(url, prefetch=2, **kwargs), 4)
    here = _take(_loader(local, **kwargs), 4)
    for i in (0, 2):  # inputs, document ids
        assert _equal([b[i] for b in remote], [b[i] for b in here])
    assert _shard_bytes_fetched(requests) < size / 10, size


def test_training_from_s3_reads_ranges(
    tmp_path: Path, s3_server: Any, monkeypatch: pytest.MonkeyPatch, assets: Path
) -> None:
    """`titan_core.train` (in this process) on prepared data on the S3 server: no full
    download, and the prefetch thread is gone when training returns."""
    from titan_core.resolve import parse_args
    from titan_core.train import run

    s3_server.set_env(monkeypatch)
    tok = Tokenizer(str(_tokenizer_path()))
    url = prepare_corpus(s3_server.url(tmp_path.name, "corpus"), tok, _corpus(), max_files=3)
    fs, _ = fsspec.core.url_to_fs(url)
    size = sum(fs.du(f"{s3_server.bucket}/{tmp_path.name}/corpus/shards", total=False).values())
    requests = _watch_s3(fs, s3_server.bucket)
    argv = [*TRAIN, "--job.dump_folder", str(tmp_path / "run"), "--training.steps", "3"]
    history = run(parse_args([*argv, "--dataloader.dataset", url, "--validation.no_enable"]))
    assert [int(h["step"]) for h in history] == [1, 2, 3]
    manifest = shards.read_manifest(url)  # the check at open reads a few KiB of each shard
    probe = (
        len(manifest.split_shards("train"))
        * 2
        * (
            windows.PROBE_TOKENS * np.dtype(manifest.dtype).itemsize
            + windows.PROBE_DOCS * shards.DOC_DTYPE.itemsize
        )
    )
    assert _shard_bytes_fetched(requests) < size / 20 + probe, size
    assert not [t for t in threading.enumerate() if t.name == "titan-data-prefetch"]
    # Credentials are enforced: a wrong secret is one line before anything trains.
    from titan_core.build import check_job
    from titan_core.testing.s3 import clear_fsspec_s3_cache

    s3_server.set_env(monkeypatch, secret_key="wrong-secret")
    clear_fsspec_s3_cache()
    cfg = parse_args([*argv, "--dataloader.dataset", url, "--validation.no_enable"])
    with pytest.raises(DataError) as info:
        check_job(cfg, 1)
    assert len(str(info.value).splitlines()) == 1 and url in str(info.value), info.value
    assert "wrong-secret" not in str(info.value)


# --- bad data, before training -------------------------------------------------------------------


def _one_line_data_error(url: str, **kwargs: Any) -> str:
    with pytest.raises(DataError) as info:
        _loader(url, **kwargs)
    message = str(info.value)
    assert len(message.splitlines()) == 1, message
    return message


def test_bad_data_fails_with_one_line_naming_the_file(tmp_path: Path) -> None:
    url = str(tmp_path / "ds")
    manifest = write_docs(url, random_docs(2, 3, 5))
    assert "no manifest" in _one_line_data_error(str(tmp_path / "nothing"))
    assert "another tokenizer" in _one_line_data_error(url, fingerprint="0" * 64)
    tokens, _ = shards.shard_urls(url, manifest.shards[1])
    original = Path(tokens).read_bytes()
    damaged = bytearray(original)
    damaged[10] ^= 0xFF
    Path(tokens).write_bytes(bytes(damaged))
    _loader(url)  # same size: the default check passes
    message = _one_line_data_error(url, verify="checksum")
    assert tokens in message and "checksum" in message
    Path(tokens).write_bytes(original[:-2])
    message = _one_line_data_error(url)
    assert tokens in message and "truncated" in message
    Path(tokens).unlink()
    assert tokens in _one_line_data_error(url)
    short = str(tmp_path / "short")
    write_docs(short, [[[5, 6, 7]]])
    assert "fewer than training.seq_len + 1" in _one_line_data_error(short)


def test_damaged_shards_of_the_right_size_are_one_line_naming_them(tmp_path: Path) -> None:
    """Only a checksum notices a shard rewritten at its size. A shard rewritten whole (ids
    beyond the vocabulary at its ends) or with offsets that do not increase is refused when the
    split is opened, before anything trains on it; a bad id between the ends when it is read.
    Each names the file (they were an IndexError in the embedding and silently wrong masks)."""
    url = str(tmp_path / "ds")
    manifest = write_docs(url, random_docs(3, 2, 40))  # ~6k tokens a shard: a middle to harm
    shard = manifest.shards[1]
    tokens, docs = shards.shard_urls(url, shard)
    assert shard.num_tokens > 2 * windows.PROBE_TOKENS + 64
    original = Path(tokens).read_bytes()
    overwrite(Path(tokens))  # every id 65535, beyond the 50,000 of the vocab
    with pytest.raises(DataError) as info:
        _loader(url, shuffle=False)  # opening it is enough
    message = str(info.value)
    assert message.startswith(f"{tokens}: token 0 is id 65535, beyond the tokenizer's 50000 ids")
    middle = windows.PROBE_TOKENS + 32  # one id, where the check at open does not look
    ids = np.frombuffer(original, dtype=manifest.dtype).copy()
    ids[middle] = 50_000
    Path(tokens).write_bytes(ids.tobytes())
    loader = _loader(url, shuffle=False)
    with pytest.raises(DataError) as info:
        _take(loader, 200)  # in order: the first shard, then the second's middle
    assert str(info.value).startswith(f"{tokens}: token {middle} is id 50000, beyond the")
    Path(tokens).write_bytes(original)
    ends = np.fromfile(docs, dtype=shards.DOC_DTYPE)
    ends[1:3] = ends[2:0:-1]  # two offsets swapped: no longer increasing
    ends.tofile(docs)
    for masking in (True, False):  # damaged either way, whether masks read them or not
        with pytest.raises(DataError, match=f"^{re.escape(docs)}: document offsets are not"):
            _loader(url, shuffle=False, document_masking=masking)


def test_remote_shards_are_checked_at_their_ends_when_opened(
    tmp_path: Path, s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an object store the check at open reads a few KiB at each end of every shard (one
    ranged request each), and refuses a shard rewritten whole or a last offset that is not
    the shard's size."""
    s3_server.set_env(monkeypatch)
    url = s3_server.url(tmp_path.name, "ds")
    manifest = write_docs(url, random_docs(4, 3, 40), fingerprint="remote")
    fs, _ = fsspec.core.url_to_fs(url)
    requests = _watch_s3(fs, s3_server.bucket)
    _loader(url, shuffle=False)
    shard_gets = [r for op, u, r in requests if "/shards/" in u and op == "GetObject"]
    # Of each of the three shards: its token ids at both ends, its 40 offsets in one read.
    assert len(shard_gets) == 3 * (2 + 1)
    assert _shard_bytes_fetched(requests) <= 3 * 2 * (
        windows.PROBE_TOKENS * np.dtype(manifest.dtype).itemsize
        + windows.PROBE_DOCS * shards.DOC_DTYPE.itemsize
    )
    tokens, docs = (u.removeprefix("s3://") for u in shards.shard_urls(url, manifest.shards[2]))
    ends = np.frombuffer(fs.cat(docs), dtype=shards.DOC_DTYPE).copy()
    ends[-1] -= 1  # the last document no longer ends at the shard's end
    fs.pipe(docs, ends.tobytes())
    with pytest.raises(DataError, match="document offsets are not increasing ends"):
        _loader(url, shuffle=False)
    fs.pipe(tokens, b"\xff" * fs.size(tokens))
    with pytest.raises(DataError, match="beyond the tokenizer's 50000 ids"):
        _loader(url, shuffle=False)


def test_dispatch_keeps_raw_text_on_the_raw_path(
    small: tuple[str, list], tmp_path: Path, assets: Path
) -> None:
    from titan_core.data.loader import ParallelAwareDataloader

    tok = Tokenizer(str(_tokenizer_path()))
    raw = tmp_path / "d.jsonl"
    raw.write_text("".join(json.dumps({"text": f"doc {i} " * 9}) + "\n" for i in range(20)))
    common: dict[str, Any] = {"tokenizer": tok, "local_batch_size": 2, "seq_len": 8}
    raw_loader = build_dataloader(Dataloader(dataset=str(raw)), **common)
    assert isinstance(raw_loader, ParallelAwareDataloader)
    corpus = prepare_corpus(str(tmp_path / "p"), tok, _corpus(), max_files=1)
    assert isinstance(build_dataloader(Dataloader(dataset=corpus), **common), PreparedDataloader)
    with pytest.raises(DataError, match="another tokenizer"):
        build_dataloader(Dataloader(dataset=small[0]), **common)


# --- training from prepared data -----------------------------------------------------------------


def _tokenizer_path() -> Path:
    from titan_core.data import default_tokenizer_path

    return default_tokenizer_path()


def _corpus() -> Path:
    from titan_core.data import bundled_corpus_dir

    return bundled_corpus_dir()


@pytest.fixture(scope="module")
def corpus_pair(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> tuple[str, str]:
    """Two prepared datasets of the bundled corpus (all of it, and its first file)."""
    root = tmp_path_factory.mktemp("prepared")
    tok = Tokenizer(str(_tokenizer_path()))
    full = prepare_corpus(str(root / "full"), tok, _corpus())
    part = prepare_corpus(str(root / "part"), tok, _corpus(), max_files=1)
    return full, part


TRAIN = ["--module", "llama3", "--config", "llama3_debugmodel_tiny", "--training.seq_len", "64"]
TRAIN += ["--metrics.log_freq", "1", "--metrics.cpu_peak_tflops", "1"]


def _train(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "titan_core.train", *TRAIN, *argv],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_titan_train_on_a_prepared_mix_with_validation(
    tmp_path: Path, corpus_pair: tuple[str, str]
) -> None:
    full, part = corpus_pair
    dump = tmp_path / "run"
    argv = ["--job.dump_folder", str(dump), "--training.steps", "4"]
    argv += ["--dataloader.mix", f"{full}=3", f"{part}=1"]
    argv += ["--validation.enable", "--validation.freq", "2", "--validation.steps", "2"]
    proc = _train(argv)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert sum("validation/loss" in r for r in rows) == 2  # on the first dataset's validation
    last = [r for r in rows if any(k.startswith("data/mix/") for k in r)][-1]
    shares = {k.split("/")[-1].split("-")[0]: v for k, v in last.items() if "data/mix/" in k}
    assert shares == {"full": pytest.approx(0.75, abs=0.05), "part": pytest.approx(0.25, abs=0.05)}


def test_bad_prepared_data_stops_before_anything_is_written(
    tmp_path: Path, corpus_pair: tuple[str, str], monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """A damaged shard: `titan_core.train` and `titan train --ngpu 2` (before torchrun starts)
    print one line naming the file, exit 2, and write nothing."""
    import titan_core.cli as cli
    from titan_core.launch.local import LocalLauncher

    broken = tmp_path / "broken"
    write_docs(str(broken), random_docs(3, 2, 20), tokenizer=_tokenizer_info())
    shard = broken / "shards" / "unit0001-train.tokens"
    shard.write_bytes(shard.read_bytes()[:-4])
    dump = tmp_path / "run"
    proc = _train(["--job.dump_folder", str(dump), "--dataloader.dataset", str(broken)])
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(shard) in errors[0], proc.stderr[-3000:]
    no_launch = lambda *_, **__: pytest.fail("torchrun was launched")  # noqa: E731
    monkeypatch.setattr(LocalLauncher, "run", no_launch)
    argv = ["train", *TRAIN, "--ngpu", "2", "--job.dump_folder", str(dump)]
    assert cli.main([*argv, "--dataloader.mix", f"{corpus_pair[0]}=1", f"{broken}=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(shard) in err, err
    assert not dump.exists()


def _tokenizer_info() -> dict:
    return shards.tokenizer_info(Tokenizer(str(_tokenizer_path())))


def test_resume_with_new_mix_weights_meets_them_from_there(tmp_path: Path) -> None:
    """New weights after a resume are met from the resume on (the lead a dataset built under
    the old weights does not starve the other one)."""
    urls = []
    for i in range(2):
        write_docs(str(tmp_path / f"ds{i}"), random_docs(10 + i, 3, 40))
        urls.append(str(tmp_path / f"ds{i}"))
    first = _loader(list(zip(urls, [0.5, 0.5])), local_batch_size=100, seq_len=8)
    _take(first, 10)
    resumed = _loader(list(zip(urls, [0.9, 0.1])), local_batch_size=100, seq_len=8)
    resumed.load_state_dict(first.state_dict())
    before = [c.count for c in resumed._cursors]
    _take(resumed, 40)
    drawn = [c.count - b for c, b in zip(resumed._cursors, before, strict=True)]
    assert drawn == [3600, 400]
    again = _loader(list(zip(urls, [0.9, 0.1])), local_batch_size=100, seq_len=8)
    again.load_state_dict(resumed.state_dict())  # same weights: no rebase, exact continuation
    assert again._cursors == resumed._cursors


def test_resume_over_replaced_shards_is_refused(tmp_path: Path) -> None:
    """A checkpoint's shard prefix must be the manifest's: a dataset re-prepared with other
    shards (or in another order) is one line, not silently different data."""
    url = str(tmp_path / "ds")
    write_docs(url, random_docs(3, 3, 20))
    loader = _loader(url)
    _take(loader, 3)
    state = loader.state_dict()
    manifest = shards.read_manifest(url)
    manifest.shards[0], manifest.shards[1] = manifest.shards[1], manifest.shards[0]
    shards.write_manifest(url, manifest)
    with pytest.raises(DataError, match="not the ones the checkpoint read"):
        _loader(url).load_state_dict(state)


def test_a_validation_split_smaller_than_one_global_batch_fails_before_launch(
    corpus_pair: tuple[str, str],
) -> None:
    """check_job (run before torchrun starts) knows the DP degree: a validation split with
    fewer samples than one validation batch over every rank is one line there."""
    from titan_core.build import check_job
    from titan_core.resolve import parse_args

    full, _ = corpus_pair
    argv = [*TRAIN, "--dataloader.dataset", full, "--validation.enable"]
    cfg = parse_args([*argv, "--validation.local_batch_size", "4"])
    check_job(cfg, 2)  # fits
    tokens = sum(s.num_tokens for s in shards.read_manifest(full).split_shards("validation"))
    samples = (tokens - 1) // 64  # every validation sample of the split (TRAIN's seq_len)
    too_big = parse_args([*argv, "--validation.local_batch_size", str(samples)])
    check_job(too_big, 1)
    with pytest.raises(DataError, match="fewer than one validation batch") as info:
        check_job(too_big, 2)
    assert len(str(info.value).splitlines()) == 1


def test_remote_doc_ids_read_offsets_by_range(tmp_path: Path) -> None:
    """Document masking on a remote dataset: the same doc_ids as the local reader, from ranged
    reads of the offsets around each window (not whole .docs files)."""
    from titan_core.data.windows import open_split

    local = str(tmp_path / "ds")
    docs = random_docs(5, 3, 3000)  # 3 shards of 3,000 documents: 24 KB of offsets each
    docs[1][:40] = [[7] * 2] * 40  # dense short documents inside a shard
    write_docs(local, docs)
    remote = f"memory://{tmp_path.name}/ds"
    fs = fsspec.filesystem("memory")
    for path in Path(local).rglob("*"):
        if path.is_file():
            fs.pipe_file(f"{remote}/{path.relative_to(local)}", path.read_bytes())
    kwargs = {"fingerprint": FP, "seq_len": 64, "verify": "size"}
    near, far = open_split(local, "train", **kwargs), open_split(remote, "train", **kwargs)
    rng = np.random.default_rng(0)
    edges = [int(near.starts[i]) // 64 + d for i in (1, 2) for d in (-1, 0)]
    samples = np.concatenate([rng.integers(0, near.num_samples(), 200), edges])
    assert (far.doc_ids(samples) == near.doc_ids(samples)).all()
    fresh = open_split(remote, "train", **kwargs)  # one lookup, nothing cached yet
    opened = fresh.read_stats()["bytes_read"]  # the check at open: a few KiB at the ends
    fresh.doc_ids(np.array([near.num_samples() // 6]))  # inside shard 0
    offsets_bytes = fresh.shards[0].num_docs * 8
    assert fresh.read_stats()["bytes_read"] - opened < offsets_bytes / 2, fresh.read_stats()
