"""Data preparation: raw sources -> token shards + manifest (titan_core.data.prepare, `titan data`).

The shards are read back here with numpy straight from the format in titan_core/data/shards.py,
not through the training reader, so that these tests pin the bytes on disk.
"""

from __future__ import annotations

import bz2
import functools
import gzip
import hashlib
import json
import lzma
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from storage_faults import Disk, files_under, one_line

from titan_core.cli import data as data_cli
from titan_core.data.assets import bundled_corpus_dir, default_tokenizer_path
from titan_core.data.prepare import (
    PrepareSpec,
    Unit,
    commit_prepare,
    plan_prepare,
    prepare,
    spec_from_config,
    tokenize_unit,
)
from titan_core.data.shards import (
    DOC_DTYPE,
    Manifest,
    read_manifest,
    shard_urls,
    verify_shards,
    write_manifest,
)
from titan_core.data.sources import HFSource
from titan_core.data.tokenizer import Tokenizer, train_bpe
from titan_core.errors import DataError, StorageError

# Documents with what tokenizers trip on: special-token text, non-ASCII, inner newlines, spaces.
DOCS = [
    f"Document {i}: "
    + " ".join(f"word{i * 7 + j}" for j in range(3 + i % 9))
    + ("\nsecond line <|end_of_text|> naïve café — 東京 🚀" if i % 4 == 1 else "")
    for i in range(40)
]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tok") / "t.tiktoken"
    return train_bpe([topics[k] for k in sorted(topics)][:40], 400, path)


@pytest.fixture(scope="module")
def tok(tok_path: str) -> Tokenizer:
    return Tokenizer(tok_path)


def _spec(root: Path, tok_path: str, *sources: Path | str, **kwargs: Any) -> PrepareSpec:
    return PrepareSpec(
        sources=tuple(str(s) for s in sources), tokenizer_path=tok_path, root=str(root), **kwargs
    )


def _jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def _rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _cut_bz2(path: Path) -> str:
    data = bz2.compress("".join(json.dumps({"text": d}) + "\n" for d in DOCS).encode())
    path.write_bytes(data[: len(data) // 2])
    return str(path)


def _split_docs(url: str, split: str) -> list[list[int]]:
    """Every document of ``split`` as token ids, in stream order, straight from the files."""
    manifest = read_manifest(url)
    docs: list[list[int]] = []
    for shard in manifest.split_shards(split):
        tokens_path, docs_path = shard_urls(url, shard)
        tokens = np.fromfile(tokens_path, dtype=np.dtype(manifest.dtype))
        ends = np.fromfile(docs_path, dtype=DOC_DTYPE)
        assert len(tokens) == shard.num_tokens and len(ends) == shard.num_docs
        assert ends[-1] == len(tokens) and np.all(np.diff(ends) > 0)
        docs += [chunk.tolist() for chunk in np.split(tokens, ends[:-1])]
    return docs


def _encoded(tok: Tokenizer, docs: list[str]) -> list[list[int]]:
    return [tok.encode(d, bos=True, eos=True) for d in docs]


def _tree(root: Path) -> dict[str, tuple[int, str]]:
    """relative path -> (mtime_ns, sha256) of every file under root."""
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# --------------------------------------------------------------------------- content


def test_every_document_is_its_encoding_in_every_format(
    tmp_path: Path, tok_path: str, tok: Tokenizer
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    # a.txt: blank-line blocks (one undecodable, skipped); b.jsonl: an empty, a non-JSON and a
    # field-less row (skipped); c.json: a JSON array; d.parquet: small row groups and nulls.
    (src / "a.txt").write_bytes(
        b"\n\n" + "\n\n\n".join(DOCS[:4]).encode() + b"\n \t\n\xff\xfe bad block\n\n"
    )
    rows = [json.dumps({"text": d}) for d in DOCS[4:8]]
    rows[1:1] = [json.dumps({"text": "  "}), "not json", json.dumps({"id": 3})]
    (src / "b.jsonl").write_text("\n".join(rows) + "\n")
    (src / "c.json").write_text(json.dumps([{"text": d, "n": 1} for d in DOCS[8:12]]))
    table = pa.table({"id": list(range(7)), "text": [*DOCS[12:16], None, "", DOCS[16]]})
    pq.write_table(table, src / "d.parquet", row_group_size=2)
    with gzip.open(src / "e.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in DOCS[17:22]))
    (src / "f.txt.bz2").write_bytes(bz2.compress("\n\n".join(DOCS[22:26]).encode()))
    (src / "g.jsonl.xz").write_bytes(
        lzma.compress("".join(json.dumps({"text": d}) + "\n" for d in DOCS[26:30]).encode())
    )
    (src / "README.md").write_text("not a document file")
    expected = DOCS[:30]

    result = prepare(_spec(tmp_path / "data", tok_path, src, validation_every=0), workers=1)

    assert not result.cached and result.new_units == 7 and result.new_shards == 7
    assert _split_docs(result.url, "train") == _encoded(tok, expected)
    assert _split_docs(result.url, "validation") == []
    manifest = read_manifest(result.url)
    assert manifest.dtype == "<u2" and manifest.tokenizer["fingerprint"] == tok.fingerprint
    assert [Path(f.url).name for f in manifest.files] == [
        "a.txt", "b.jsonl", "c.json", "d.parquet", "e.jsonl.gz", "f.txt.bz2", "g.jsonl.xz",
    ]  # fmt: skip
    assert [s.num_docs for s in manifest.shards] == [4, 4, 4, 5, 5, 4, 4]
    assert result.tokens == sum(len(d) for d in _encoded(tok, expected))
    verify_shards(result.url, manifest, checksum=True)


def test_zstd_files(tmp_path: Path, tok_path: str, tok: Tokenizer) -> None:
    zstandard = pytest.importorskip("zstandard")
    data = "".join(json.dumps({"text": d}) + "\n" for d in DOCS[:5]).encode()
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    text = "\n\n".join(DOCS[5:8]).encode()  # .txt: blank-line-separated documents
    (tmp_path / "b.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(text))
    spec = _spec(tmp_path / "data", tok_path, tmp_path / "a.jsonl.zst", tmp_path / "b.txt.zst")
    result = prepare(spec, workers=1)
    assert _split_docs(result.url, "train") == _encoded(tok, DOCS[:8])


def test_validation_rule_holds_out_every_nth_document_of_each_file(
    tmp_path: Path, tok_path: str, tok: Tokenizer
) -> None:
    _jsonl(tmp_path / "a.jsonl", DOCS[:7])
    _jsonl(tmp_path / "b.jsonl", DOCS[7:12])
    spec = _spec(tmp_path / "data", tok_path, tmp_path / "a.jsonl", tmp_path / "b.jsonl",
                 validation_every=3)  # fmt: skip
    result = prepare(spec, workers=1)
    held_out = [DOCS[2], DOCS[5], DOCS[7 + 2]]  # document i of a file with i % 3 == 2
    train = [d for d in DOCS[:12] if d not in held_out]
    assert _split_docs(result.url, "validation") == _encoded(tok, held_out)
    assert _split_docs(result.url, "train") == _encoded(tok, train)
    manifest = read_manifest(result.url)
    assert manifest.validation == {"rule": "every_nth_document", "every": 3}
    assert [(s.split, s.num_docs) for s in manifest.shards] == [
        ("train", 5), ("validation", 2), ("train", 4), ("validation", 1),
    ]  # fmt: skip


def test_hf_dataset_source_one_unit_per_shard(
    tmp_path: Path, tok_path: str, tok: Tokenizer
) -> None:
    """``hf:<local folder>`` goes through ``datasets`` (streaming), offline: the same code path
    as a hub dataset, which this machine cannot reach."""
    folder = tmp_path / "hf"
    folder.mkdir()
    _jsonl(folder / "part-0.jsonl", DOCS[:6])
    _jsonl(folder / "part-1.jsonl", DOCS[6:9])
    spec = _spec(tmp_path / "data", tok_path, f"hf:{folder}?split=train", validation_every=0)
    result = prepare(spec, workers=1)
    manifest = read_manifest(result.url)
    assert [f.url.rpartition("#")[2] for f in manifest.files] == ["shard=0/2", "shard=1/2"]
    assert all(f.version for f in manifest.files)  # the resolved dataset hash
    assert _split_docs(result.url, "train") == _encoded(tok, DOCS[:9])
    assert prepare(spec, workers=1).cached
    _jsonl(folder / "part-2.jsonl", DOCS[9:12])  # now 3 shards: not appendable, refused
    with pytest.raises(DataError, match=r"hf:.*: changed since it was prepared .* append-only"):
        prepare(spec, workers=1)
    with pytest.raises(DataError, match=r"rows have no field 'body' \(fields: text, id\)"):
        plan_prepare(_spec(tmp_path / "d2", tok_path, f"hf:{folder}", text_field="body"))
    with pytest.raises(DataError, match="unknown option colour"):
        HFSource.parse("hf:org/name?colour=red")


# --------------------------------------------------------------------------- caching, increments


def test_rerun_is_cached_and_writes_nothing(tmp_path: Path, tok_path: str) -> None:
    _jsonl(tmp_path / "a.jsonl", DOCS[:10])
    spec = _spec(tmp_path / "data", tok_path, tmp_path / "a.jsonl")
    first = prepare(spec, workers=1)
    before = _tree(tmp_path / "data")
    plan = plan_prepare(spec)
    again = prepare(spec, workers=1)
    assert again.cached and again.tokens == 0 and again.new_shards == 0
    assert again.reused_units == 1 and again.url == first.url and not plan.todo
    assert _tree(tmp_path / "data") == before  # not one byte or mtime changed
    assert plan_prepare(spec).cache_key == plan.cache_key
    # The dataset id covers the sources as given, the text field, tokenizer and split rule.
    other = prepare(_spec(tmp_path / "data", tok_path, tmp_path / "a.jsonl", validation_every=7))
    assert other.url != first.url and not other.cached


def test_appending_a_file_writes_only_its_shards(
    tmp_path: Path, tok_path: str, tok: Tokenizer
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    _jsonl(src / "a.jsonl", DOCS[:8])
    _jsonl(src / "c.jsonl", DOCS[8:16])
    spec = _spec(tmp_path / "data", tok_path, src, validation_every=4)
    first = prepare(spec, workers=1)
    old_manifest = read_manifest(first.url)
    before = _tree(Path(first.url))
    key = plan_prepare(spec).cache_key

    _jsonl(src / "b.jsonl", DOCS[16:24])  # sorts between the two old files
    plan = plan_prepare(spec)
    assert [Path(u.file.url).name for u in plan.todo] == ["b.jsonl"] and plan.cache_key != key
    second = prepare(spec, workers=2)

    assert (second.new_units, second.new_shards, second.reused_units) == (1, 2, 2)
    after = _tree(Path(second.url))
    new = {path for path in after if path not in before}
    unit = plan.todo[0].file.unit
    assert new == {f"shards/{unit}-{split}.{ext}" for split in ("train", "validation")
                   for ext in ("tokens", "docs")}  # fmt: skip
    assert {p: after[p] for p in before if p != "manifest.json"} == {
        p: v for p, v in before.items() if p != "manifest.json"
    }  # old shard bytes and mtimes untouched
    manifest = read_manifest(second.url)
    assert manifest.shards[:4] == old_manifest.shards and len(manifest.shards) == 6
    assert manifest.files[:2] == old_manifest.files
    # The stream: old shards first, in their order, then the new file's.
    train = [d for i, d in enumerate(DOCS[:8]) if i % 4 != 3]
    train += [d for i, d in enumerate(DOCS[8:16]) if i % 4 != 3]
    train += [d for i, d in enumerate(DOCS[16:24]) if i % 4 != 3]
    assert _split_docs(second.url, "train") == _encoded(tok, train)


def test_changed_file_is_an_error_and_removed_file_keeps_its_shards(
    tmp_path: Path, tok_path: str
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    _jsonl(src / "a.jsonl", DOCS[:8])
    _jsonl(src / "b.jsonl", DOCS[8:16])
    spec = _spec(tmp_path / "data", tok_path, src)
    prepare(spec, workers=1)
    before = _tree(tmp_path / "data")

    with (src / "a.jsonl").open("a") as f:
        f.write(json.dumps({"text": "an edit"}) + "\n")
    with pytest.raises(DataError) as err:
        prepare(spec, workers=1)
    message = str(err.value)
    assert "\n" not in message and f"{src / 'a.jsonl'}: changed since it was prepared" in message
    assert "append-only" in message and "start a new dataset" in message
    assert _tree(tmp_path / "data") == before

    (src / "a.jsonl").unlink()
    plan = plan_prepare(spec)
    assert [Path(f.url).name for f in plan.gone] == ["a.jsonl"] and not plan.todo
    assert prepare(spec, workers=1).cached
    assert _tree(tmp_path / "data") == before  # its shards stay, nothing rewritten


def test_worker_count_does_not_change_bytes(tmp_path: Path, tok_path: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        _jsonl(src / f"part-{i}.jsonl", DOCS[i * 10 : (i + 1) * 10])
    trees = []
    for name, kwargs in {
        "one": {"workers": 1},
        "two": {"workers": 2},
        "map": {"map_fn": map},
    }.items():
        result = prepare(_spec(tmp_path / name, tok_path, src, validation_every=3), **kwargs)
        trees.append({p: digest for p, (_, digest) in _tree(Path(result.url)).items()})
    assert trees[0] == trees[1] == trees[2] and len(trees[0]) == 1 + 4 * 2 * 2


def test_plan_tokenize_commit_are_separable(tmp_path: Path, tok_path: str) -> None:
    """What an engine (Prefect tasks, Dask) does: plan, run units anywhere in any order, commit."""
    _jsonl(tmp_path / "a.jsonl", DOCS[:10])
    _jsonl(tmp_path / "b.jsonl", DOCS[10:20])
    spec = _spec(tmp_path / "data", tok_path, tmp_path / "a.jsonl", tmp_path / "b.jsonl")
    plan = plan_prepare(spec)
    assert not (tmp_path / "data").exists()  # the plan writes nothing
    results = {u.index: tokenize_unit(u, **plan.unit_kwargs()) for u in reversed(plan.todo)}
    assert not Path(plan.url, "manifest.json").exists()  # only commit writes it
    manifest = commit_prepare(plan, [results[i] for i in range(len(plan.todo))])
    reference = prepare(_spec(tmp_path / "ref", tok_path, tmp_path / "a.jsonl",
                              tmp_path / "b.jsonl"), workers=1).manifest  # fmt: skip
    assert read_manifest(plan.url) == manifest == reference


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda d: str(d / "missing"), r"missing: source not found"),
        (lambda d: "nosuch://bucket/x", r"nosuch://bucket/x: unknown source"),
        (lambda d: str(d), r"empty source \(no .txt/.jsonl/.json/.parquet files"),
        (lambda d: str(_jsonl(d / "e.jsonl", ["", "  "])), r"e.jsonl: empty source \(no doc"),
        (lambda d: str(_jsonl(d / "f.jsonl", DOCS[:3], field="body")),
         r"f.jsonl: rows have no field 'text' \(fields: body, id\); set data.text_field"),
        (lambda d: str(d / "x.csv"), r"x.csv: not a .txt/.jsonl/.json/.parquet file"),
        (lambda d: "hf:org/name?colour=red", r"unknown option colour"),
        (lambda d: str(_rows(d / "g.jsonl", [{"text": "fine"}, {"text": 42}])),
         r"g.jsonl: row 2: field 'text' holds int 42, expected a string"),
        # Compressed files that are not what their extension says, or cut short.
        (lambda d: str(_rows(d / "h.jsonl.zst", [{"text": "plain"}])),
         r"h.jsonl.zst: not a readable .zst file \(ZstdError: "),
        (lambda d: str(_rows(d / "i.jsonl.xz", [{"text": "plain"}])),
         r"i.jsonl.xz: not a readable .xz file \(LZMAError: "),
        (lambda d: _cut_bz2(d / "j.jsonl.bz2"),
         r"j.jsonl.bz2: not a readable .bz2 file \(EOFError"),
    ],
    ids=["missing", "scheme", "no-files", "no-docs", "no-field", "suffix", "hf-option",
         "number-text", "fake-zst", "fake-xz", "cut-bz2"],
)  # fmt: skip
def test_bad_source_fails_before_writing(
    tmp_path: Path, tok_path: str, make: Any, expected: str
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "README.md").write_text("not data")
    (src / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=expected) as err:
        prepare(_spec(tmp_path / "data", tok_path, make(src)), workers=1)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "data").exists()


def test_missing_field_in_parquet_and_missing_tokenizer(tmp_path: Path, tok_path: str) -> None:
    pq.write_table(pa.table({"body": DOCS[:3]}), tmp_path / "a.parquet")
    with pytest.raises(DataError, match=r"a.parquet: rows have no field 'text' \(fields: body\)"):
        prepare(_spec(tmp_path / "data", tok_path, tmp_path / "a.parquet"), workers=1)
    _jsonl(tmp_path / "b.jsonl", DOCS[:3])
    with pytest.raises(DataError, match=r"tokenizer.path: file not found: .*nope.tiktoken"):
        prepare(_spec(tmp_path / "data", str(tmp_path / "nope.tiktoken"), tmp_path / "b.jsonl"))
    assert not (tmp_path / "data").exists()


def test_a_failing_unit_commits_nothing(tmp_path: Path, tok_path: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    _jsonl(src / "a.jsonl", DOCS[:5])
    _jsonl(src / "b.jsonl", DOCS[5:10], field="body")  # only the first file is peeked at plan
    spec = _spec(tmp_path / "data", tok_path, src)
    for workers in (1, 2):  # a.jsonl's unit finishes first inline; in the pool, either way
        with pytest.raises(DataError, match=r"b.jsonl: rows have no field 'text' \(fields: bo"):
            prepare(spec, workers=workers)
        assert not (tmp_path / "data").exists() or not list((tmp_path / "data").rglob("*"))
    # An increment that fails leaves the prepared dataset as it was, byte for byte.
    (src / "b.jsonl").unlink()
    prepare(spec, workers=1)
    before = _tree(tmp_path / "data")
    _jsonl(src / "c.jsonl", DOCS[:3])
    _jsonl(src / "d.jsonl", DOCS[3:6], field="body")
    with pytest.raises(DataError, match=r"d\.jsonl: rows have no field 'text'"):
        prepare(spec, workers=1)
    assert _tree(tmp_path / "data") == before


def test_an_interrupted_second_prepare_keeps_what_the_first_committed(
    tmp_path: Path, tok_path: str
) -> None:
    """Two prepares of one dataset planned together: the first commits, the second is
    interrupted (Ctrl-C) after that. Its cleanup must not delete the committed shards, which
    have the names (and bytes) its own would have had."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        _jsonl(src / f"{i}.jsonl", DOCS[i * 8 : i * 8 + 8])
    spec = _spec(tmp_path / "data", tok_path, src)
    late = plan_prepare(spec)  # planned before the first one commits: every unit to do
    first = prepare(spec, workers=1)
    committed = _tree(tmp_path / "data")

    def interrupted(fn: Any, units: Any) -> Any:
        yield fn(units[0])
        raise KeyboardInterrupt

    import titan_core.data.prepare as prepare_module

    with pytest.raises(KeyboardInterrupt), prepare_module.discard_on_failure(late):
        list(interrupted(functools.partial(tokenize_unit, **late.unit_kwargs()), late.todo))
    assert {k: v[1] for k, v in _tree(tmp_path / "data").items()} == {
        k: v[1] for k, v in committed.items()
    }
    verify_shards(first.url, read_manifest(first.url), checksum=True)
    assert prepare(spec, workers=1).cached


def _race_rounds(
    src: Path, out: Path, tok_path: str, base: Path | None, rounds: int, seed: int
) -> list[int]:
    """Rounds of two concurrent ``titan data prepare`` runs of ``src`` into ``out`` (from a copy
    of the prepared dataset ``base`` when given: an increment), the first one interrupted with
    Ctrl-C at a time spread over the whole run (planning, tokenizing, committing), the second
    one started at a varied time before that. After each round the surviving run has exited 0
    and printed a dataset that verifies byte for byte, holds every unit, and no debris of the
    interrupted run is left. Returns the interrupted run's exit code of each round."""
    import random
    import time

    from prepared_helpers import cli_in_child

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["prepared_helpers", "titan_core.cli", "titan_core.cli.data"])
    argv = ["data", "prepare", str(src), "--out", str(out), "--tokenizer", tok_path]
    argv += ["--workers", "1"]
    logs = out.parent / "logs"
    logs.mkdir(exist_ok=True)

    def reset() -> None:
        shutil.rmtree(out, ignore_errors=True)
        if base is not None:
            shutil.copytree(base, out)

    def start(name: str, wait: bool = True) -> Any:
        """A child running the CLI, returned once it is in the CLI (its log exists)."""
        log = logs / name
        log.unlink(missing_ok=True)
        child = ctx.Process(target=cli_in_child, args=(argv, str(log)))
        child.start()
        deadline = time.monotonic() + 60
        while wait and not log.exists() and child.is_alive() and time.monotonic() < deadline:
            time.sleep(0.001)
        return child

    reset()
    alone = start("alone")
    alone.join()
    assert alone.exitcode == 0, (logs / "alone").read_text()
    url = (logs / "alone").read_text().strip().splitlines()[-1]
    expected = {(s.name, s.sha256_tokens, s.sha256_docs) for s in read_manifest(url).shards}
    rng = random.Random(seed)
    base_files = len(read_manifest(str(base / Path(url).name)).files) if base else 0
    units = len(read_manifest(url).files) - base_files

    def after_units(child: Any, name: str, done: int) -> None:
        """Return once ``child`` has tokenized ``done`` units (or ended), by its log."""
        deadline = time.monotonic() + 120
        while child.is_alive() and time.monotonic() < deadline:
            if done == 0 or (logs / name).read_text().count(" units (last: ") >= done:
                return
            time.sleep(0.002)

    codes = []
    for i in range(rounds):
        reset()
        # Spread over the run whatever the load: the interrupted run ("first") gets Ctrl-C
        # after k of its units (0: while planning; all: while committing) plus a jitter. The
        # other run starts up to 50 ms before it (odd rounds: then its shards are on disk when
        # the interrupted one cleans up) or after it.
        k = min(units, i * (units + 1) // rounds + rng.randrange(max(1, (units + 1) // rounds)))
        lead = rng.uniform(0, 0.05)
        if i % 2:
            second = start("second", wait=False)
            time.sleep(lead)
            first = start("first")
        else:
            first = start("first")
            time.sleep(lead)
            second = start("second", wait=False)
        after_units(first, "first", k)
        time.sleep(rng.uniform(0, 0.05))
        if first.is_alive():
            os.kill(first.pid, signal.SIGINT)
        first.join()
        second.join()
        log = (logs / "second").read_text()
        assert second.exitcode == 0, f"round {i}: {log}"
        assert first.exitcode in (0, 130), (logs / "first").read_text()
        assert log.strip().splitlines()[-1] == url
        manifest = read_manifest(url)
        verify_shards(url, manifest, checksum=True)
        shards = {(s.name, s.sha256_tokens, s.sha256_docs) for s in manifest.shards}
        assert shards == expected, f"round {i}: {len(shards)} shards of {len(expected)}"
        debris = [p.name for p in Path(url).rglob("*") if p.name.startswith(".staging-")]
        debris += [p.name for p in Path(url).rglob("*.tmp")]
        assert debris == [], f"round {i}: {debris}"
        codes.append(first.exitcode)
    return codes


def test_two_prepares_of_one_dataset_one_interrupted_keep_it_whole(
    tmp_path: Path, tok_path: str
) -> None:
    """Two ``titan data prepare`` runs of one source at once, one of them interrupted with
    Ctrl-C at varied times, many rounds over; then the same with an increment. A prepare only
    ever removes what it wrote itself (its staging folder), so the survivor's dataset is whole."""
    src = tmp_path / "src"
    src.mkdir()
    texts = [topics[k] for k in sorted(topics)]
    for i in range(4):  # units of ~0.1 s: time for the other run to start and interrupts to land
        _jsonl(src / f"{i}.jsonl", texts[i::8] * 2)
    base = tmp_path / "base"  # the increment's base: the first 4 files, prepared
    prepare(_spec(base, tok_path, src), workers=1)
    for i in range(4, 8):
        _jsonl(src / f"{i}.jsonl", texts[i::8] * 2)
    codes = _race_rounds(src, tmp_path / "fresh", tok_path, None, rounds=6, seed=1)
    codes += _race_rounds(src, tmp_path / "grown", tok_path, base, rounds=6, seed=2)
    assert codes.count(130) >= len(codes) // 2, codes  # most rounds did interrupt a prepare


def test_lost_shards_are_prepared_again_not_called_cached(
    tmp_path: Path, tok_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A shard deleted (or cut short) by hand: the rerun says so and prepares that unit again,
    byte for byte; with its source gone too, one line says it cannot."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(2):
        _jsonl(src / f"{i}.jsonl", DOCS[i * 10 : i * 10 + 10])
    spec = _spec(tmp_path / "data", tok_path, src)
    first = prepare(spec, workers=1)
    before = {k: v[1] for k, v in _tree(tmp_path / "data").items()}
    manifest = read_manifest(first.url)
    tokens, _ = shard_urls(first.url, manifest.shards[0])
    other = next(s for s in manifest.shards if s.unit != manifest.shards[0].unit)
    os.remove(tokens)
    with open(shard_urls(first.url, other)[1], "r+b") as f:  # another unit's index cut short
        f.truncate(8)
    again = prepare(spec, workers=1)
    assert not again.cached and again.new_units == 2
    assert "lost shard files" in caplog.text
    assert {k: v[1] for k, v in _tree(tmp_path / "data").items()} == before
    verify_shards(first.url, read_manifest(first.url), checksum=True)
    assert prepare(spec, workers=1).cached
    os.remove(tokens)
    unit = manifest.shards[0].unit
    (src / next(f.url for f in manifest.files if f.unit == unit).rsplit("/", 1)[1]).unlink()
    with pytest.raises(DataError, match=r"are missing or cut short and its source is gone"):
        prepare(spec, workers=1)


def test_manifest_from_another_tokenizer_is_refused(
    tmp_path: Path, tok_path: str, tok: Tokenizer
) -> None:
    _jsonl(tmp_path / "a.jsonl", DOCS[:5])
    spec = _spec(tmp_path / "data", tok_path, tmp_path / "a.jsonl")
    url = prepare(spec, workers=1).url
    manifest = read_manifest(url)
    other = Tokenizer(train_bpe([topics[k] for k in sorted(topics)][40:60], 300, tmp_path / "o"))
    manifest.tokenizer = {**manifest.tokenizer, "fingerprint": other.fingerprint}
    write_manifest(url, manifest)
    before = _tree(tmp_path / "data")
    _jsonl(tmp_path / "b.jsonl", DOCS[5:10])  # even with new data to append
    with pytest.raises(DataError, match=r"manifest.json: prepared with another tokenizer"):
        prepare(spec, workers=1)
    assert _tree(tmp_path / "data") == before


# --------------------------------------------------------------------------- CLI


def _titan(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "titan_core.cli", "data", *args],
        capture_output=True, text=True, timeout=300, cwd=cwd, env=env,
    )  # fmt: skip


def test_cli_prepare_info_verify(tmp_path: Path, assets: Path) -> None:
    """`titan data prepare` on the bundled corpus with the bundled tokenizer (the defaults)."""
    source = bundled_corpus_dir() / "validation"
    proc = _titan("prepare", str(source), "--workers", "2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    url = proc.stdout.strip().splitlines()[-1]
    assert Path(url).parent == tmp_path / "outputs" / "data" and "tokens/s" in proc.stdout
    manifest = read_manifest(url)
    assert manifest.tokenizer["fingerprint"] == Tokenizer(default_tokenizer_path()).fingerprint
    again = _titan("prepare", str(source), cwd=tmp_path)
    assert again.returncode == 0 and "cached" in again.stdout
    assert again.stdout.strip().splitlines()[-1] == url
    info = _titan("info", url, cwd=tmp_path)
    docs = sum(s.num_docs for s in manifest.split_shards("train"))
    assert info.returncode == 0 and f"{docs:,} documents" in info.stdout
    assert _titan("verify", url, "--checksum", cwd=tmp_path).returncode == 0

    # A truncated shard: one line naming the file, exit 2, no traceback.
    tokens_path, _ = shard_urls(url, manifest.shards[0])
    data = Path(tokens_path).read_bytes()
    Path(tokens_path).write_bytes(data[:-2])
    bad = _titan("verify", url, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert bad.stderr.startswith(f"error: {tokens_path}: ") and "truncated" in bad.stderr
    # Same size, other bytes: only --checksum sees it.
    Path(tokens_path).write_bytes(bytes([data[0] ^ 1]) + data[1:])
    assert _titan("verify", url, cwd=tmp_path).returncode == 0
    bad = _titan("verify", url, "--checksum", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert bad.stderr.startswith(f"error: {tokens_path}: checksum mismatch")


def test_cli_prepare_on_a_read_only_or_full_disk(
    tmp_path: Path, assets: Path, disk: Disk, read_only: tuple[Path, str]
) -> None:
    """Read-only: refused before any source is read. A full disk: one line naming the dataset,
    and no shard, temp file or folder of this attempt stays."""
    source = str(bundled_corpus_dir() / "validation")
    folder, words = read_only
    proc = _titan("prepare", source, "--out", str(folder / "data"), cwd=tmp_path)
    assert one_line(proc) == f"error: --out: {folder / 'data'}: {words}"
    full = disk("64k", free=8192)
    line = one_line(_titan("prepare", source, "--out", str(full / "data"), cwd=tmp_path))
    assert line.startswith(f"error: {full / 'data'}/") and line.endswith(
        ": no space left on device"
    )
    assert files_under(full) == []


def test_cli_bad_input_is_one_line_exit_2(tmp_path: Path, tok_path: str) -> None:
    _jsonl(tmp_path / "a.jsonl", DOCS[:3], field="body")
    for args, expected in [
        (["prepare", str(tmp_path / "nope")], "nope: source not found"),
        (["prepare", str(tmp_path / "a.jsonl"), "--tokenizer", tok_path],
         "rows have no field 'text' (fields: body, id)"),
        (["prepare", str(tmp_path / "a.jsonl"), "--workers", "x"],
         "--workers: expected an int, got 'x'"),
        (["info", str(tmp_path)], "no manifest"),
    ]:  # fmt: skip
        proc = _titan(*args, cwd=tmp_path)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: "), proc.stderr
        assert expected in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "outputs").exists()


def test_cli_config_arguments(tmp_path: Path, tok_path: str, tok: Tokenizer) -> None:
    """Config arguments fill in what the flags leave out (in-process: the parser's logic)."""
    _jsonl(tmp_path / "a.jsonl", DOCS[:6], field="body")
    argv = ["prepare", "--data.sources", str(tmp_path / "a.jsonl"), "--data.text_field", "body",
            "--data.validation_every", "0", "--tokenizer.path", tok_path,
            "--job.dump_folder", str(tmp_path / "store")]  # fmt: skip
    assert data_cli.main(argv) == 0
    (url,) = [str(p) for p in (tmp_path / "store" / "data").iterdir()]
    assert _split_docs(url, "train") == _encoded(tok, DOCS[:6])
    parsed = data_cli.PREPARE.parse(["a", "--out", "o", "b", "--data.sources", "x", "y"])
    assert (parsed.options.sources, parsed.options.out) == (["a", "b"], "o")
    assert parsed.config.overrides == ("--data.sources", "x", "y")  # config values stay theirs


def test_cli_spec_from_config_is_the_one_default() -> None:
    """`titan data prepare`'s defaults are the config's (root <job.dump_folder>/data, the bundled
    tokenizer); the options given win."""
    from titan_core.config.job import JobConfig

    spec = spec_from_config(JobConfig(), sources=("a",))
    assert spec.root == os.path.abspath("outputs/data")  # PrepareSpec makes local paths absolute
    assert spec.tokenizer_path == str(default_tokenizer_path())
    assert (spec.text_field, spec.validation_every) == ("text", 100)
    spec = spec_from_config(JobConfig(), sources=("a",), root="r", validation_every=0)
    assert (spec.root, spec.validation_every) == (os.path.abspath("r"), 0)


# --------------------------------------------------------------------------- S3


def test_prepare_from_and_to_s3(
    tmp_path: Path, tok_path: str, s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        _jsonl(src / f"part-{i}.jsonl", DOCS[i * 10 : (i + 1) * 10])
    s3_server.set_env(monkeypatch)
    fs = s3_server.filesystem()
    prefix = f"{s3_server.bucket}/{tmp_path.name}"
    fs.put(str(src), f"{prefix}/src", recursive=True)
    spec = _spec(f"s3://{prefix}/data", tok_path, f"s3://{prefix}/src")

    result = prepare(spec, workers=2)  # pool workers read and write S3 too
    assert result.url.startswith(f"s3://{prefix}/data/") and not result.cached
    manifest = read_manifest(result.url)
    assert all(f.url.startswith("s3://") and f.version for f in manifest.files)  # ETags
    verify_shards(result.url, manifest, checksum=True)
    local = prepare(_spec(tmp_path / "data", tok_path, src), workers=1).manifest

    def content(m: Manifest) -> list[tuple[Any, ...]]:
        return [(s.split, s.num_docs, s.sha256_tokens, s.sha256_docs) for s in m.shards]

    assert content(manifest) == content(local)  # the same bytes as from local files
    assert prepare(spec, workers=2).cached
    assert data_cli.main(["verify", result.url, "--checksum"]) == 0

    # Credentials are enforced: a wrong secret is one clear line; a read-only identity cannot
    # write shards, and nothing is left behind.
    s3_server.set_env(monkeypatch, secret_key="not-the-secret")
    with pytest.raises(DataError, match=f"s3://{prefix}/src: access denied") as err:
        prepare(spec, workers=1)
    assert "\n" not in str(err.value)
    s3_server.set_env(monkeypatch, read_only=True)
    with pytest.raises(StorageError, match=rf"s3://{prefix}/data-ro/.*: access denied"):
        prepare(_spec(f"s3://{prefix}/data-ro", tok_path, f"s3://{prefix}/src"), workers=2)
    fs.invalidate_cache()
    assert not fs.find(f"{prefix}/data-ro")


def test_a_unit_checks_its_file_and_tokenizer(tmp_path: Path, tok_path: str) -> None:
    """A worker refuses a file changed since the plan, or a tokenizer file that differs."""
    _jsonl(tmp_path / "a.jsonl", DOCS[:3])
    plan = plan_prepare(_spec(tmp_path / "data", tok_path, tmp_path / "a.jsonl"))
    unit = plan.todo[0]
    assert isinstance(unit, Unit) and unit.source == str(tmp_path / "a.jsonl")
    with pytest.raises(DataError, match=r"tokenizer.path: .* the dataset was planned with 000000"):
        tokenize_unit(unit, **{**plan.unit_kwargs(), "fingerprint": "0" * 64})
    shards = tokenize_unit(unit, **plan.unit_kwargs())
    assert [s.name for s in shards] == [f"{unit.file.unit}-train"]  # no held-out doc of 3
    _jsonl(tmp_path / "a.jsonl", DOCS[:4])
    with pytest.raises(DataError, match=r"a.jsonl: changed while being prepared"):
        tokenize_unit(unit, **plan.unit_kwargs())


def test_symlinked_files_in_a_source_folder_are_read(
    tmp_path: Path, tok_path: str, tok: Tokenizer
) -> None:
    (tmp_path / "real").mkdir()
    _jsonl(tmp_path / "real" / "a.jsonl", DOCS[:4])
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "a.jsonl").symlink_to(tmp_path / "real" / "a.jsonl")
    result = prepare(_spec(tmp_path / "data", tok_path, tmp_path / "links"), workers=1)
    assert _split_docs(result.url, "train") == _encoded(tok, DOCS[:4])
    (file,) = result.manifest.files
    assert file.size == (tmp_path / "real" / "a.jsonl").stat().st_size  # the target's identity
