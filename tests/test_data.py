"""Document sources, packing, exact resume and the bundled corpus."""

import gzip
import hashlib
import json
import time
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

import fsspec
import pytest
import torch

from titan_core.config.job import Dataloader
from titan_core.data import assets as assets_mod
from titan_core.data.assets import ensure_assets, paragraph_groups, strip_gutenberg
from titan_core.data.datasets import (
    DatasetSpec,
    DocumentSource,
    build_document_source,
    is_local_dataset,
    register_dataset,
)
from titan_core.data.loader import ParallelAwareDataloader, build_dataloader
from titan_core.data.tokenizer import Tokenizer, train_bpe
from titan_core.errors import DataError

DOCS = [
    f"Document {i}: " + " ".join(f"word{i * 7 + j}" for j in range(3 + i % 9)) for i in range(23)
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok") / "t.tiktoken"
    return Tokenizer(train_bpe([topics[k] for k in sorted(topics)][:40], 400, path))


def _write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def _source(
    dataset: str, dp_rank: int = 0, dp_world_size: int = 1, **fields: Any
) -> DocumentSource:
    """The documents of ``Dataloader(dataset=dataset, **fields)`` for rank ``dp_rank``."""
    cfg = Dataloader(dataset=dataset, **fields)
    return build_document_source(cfg, dp_rank=dp_rank, dp_world_size=dp_world_size)


def _docs(dataset: str, **kwargs: Any) -> list[str]:
    return list(_source(dataset, **kwargs))


LOADER_ARGS = ("local_batch_size", "seq_len", "dp_rank", "dp_world_size", "infinite")


def _loader(tok: Tokenizer, dataset: str, **kwargs: Any) -> ParallelAwareDataloader:
    """The loader of ``Dataloader(dataset=dataset, ...)``: ``kwargs`` holds its fields and the
    loader's own arguments (``LOADER_ARGS``)."""
    args = {"local_batch_size": 3, "seq_len": 16, "infinite": True}
    args |= {k: kwargs.pop(k) for k in LOADER_ARGS if k in kwargs}
    loader = build_dataloader(Dataloader(dataset=dataset, **kwargs), tokenizer=tok, **args)
    assert isinstance(loader, ParallelAwareDataloader)
    return loader


def test_txt_documents_are_blank_line_blocks(tmp_path: Path) -> None:
    path = tmp_path / "a.txt"
    path.write_text("\n\nfirst line\nsecond line\n\n\n  \nthird\n \t\nlast\nlines")
    assert _docs(str(path)) == ["first line\nsecond line", "third", "last\nlines"]


def test_jsonl_json_and_folder_sources(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "b.jsonl", DOCS[:10])
    (tmp_path / "c.json").write_text(json.dumps([{"text": d} for d in DOCS[10:15]]))
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in DOCS[15:]))
    (tmp_path / "README.md").write_text("not data")
    assert _docs(str(tmp_path / "b.jsonl")) == DOCS[:10]
    assert _docs(str(tmp_path / "c.json")) == DOCS[10:15]
    assert _docs(str(tmp_path)) == DOCS  # sorted files, README ignored
    assert _docs("ignored-name", path=str(tmp_path)) == DOCS


def test_text_field_and_fsspec_url(tmp_path: Path) -> None:
    with fsspec.open("memory://titan-test/data.jsonl", "w") as f:
        f.write("".join(json.dumps({"body": d}) + "\n" for d in DOCS[:4]))
    assert _docs("memory://titan-test", text_field="body") == DOCS[:4]


def test_rows_without_the_text_field_name_the_field_and_what_they_have(tmp_path: Path) -> None:
    """A wrong ``dataloader.text_field`` is one line naming the field and the fields the
    rows have, not "no documents" after every row was skipped as empty."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    with pytest.raises(DataError) as e:
        _source(str(path), text_field="text").check_nonempty()
    message = str(e.value)
    assert "\n" not in message and "no field 'text'" in message
    assert "'body', 'id'" in message and "dataloader.text_field" in message
    path.write_text(json.dumps({"text": "", "id": 0}) + "\n" + json.dumps({"text": "a"}) + "\n")
    assert _docs(str(path)) == ["a"]  # an empty text is still a skipped row, not an error


def test_rank_split_is_round_robin_disjoint_and_covering(tmp_path: Path) -> None:
    for i in range(3):
        _write_jsonl(tmp_path / f"part-{i}.jsonl", DOCS[i * 8 : (i + 1) * 8])
    shares = [_docs(str(tmp_path), dp_rank=r, dp_world_size=3) for r in range(3)]
    assert shares == [DOCS[r::3] for r in range(3)]
    assert sorted(d for share in shares for d in share) == sorted(DOCS)


def test_bad_rows_are_skipped_and_counted(tmp_path: Path) -> None:
    rows = [
        b'{"text": "good one"}',
        b'{"text": ""}',
        b'{"text": "  \\n\\t "}',
        b'{"other": "no text field"}',
        b'{"text": null}',
        b"[1, 2]",
        b'{"text": "broken',
        b'{"text": "bad \xff\xfe bytes"}',
        b"",
        b'{"text": "good two"}',
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(rows) + b"\n")
    source = _source(str(path))
    assert list(source) == ["good one", "good two"]
    assert source.stats == {"skipped_empty": 5, "skipped_undecodable": 2}
    # A number or list where the text should be is no empty row: the wrong field, or a broken
    # export. One line naming the file and row, as when the data is prepared.
    path.write_bytes(b"\n".join([*rows[:2], b'{"text": [1, 2]}', *rows[2:]]) + b"\n")
    with pytest.raises(DataError) as info:
        list(_source(str(path)))
    assert str(info.value) == f"{path}: row 3: field 'text' holds list [1, 2], expected a string"
    txt = tmp_path / "mixed.txt"
    txt.write_bytes(b"fine\n\nbad \xff bytes\n\nalso fine\n")
    source = _source(str(txt))
    assert list(source) == ["fine", "also fine"]
    assert source.stats == {"skipped_empty": 0, "skipped_undecodable": 1}


def test_loader_reports_skip_counts(tmp_path: Path, tok: Tokenizer) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": ""}\n' + "".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    loader = _loader(tok, str(path), infinite=False)
    list(loader)
    assert loader.stats == {"skipped_empty": 1, "skipped_undecodable": 0}


def test_empty_or_missing_datasets_fail_before_training(tmp_path: Path, tok: Tokenizer) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text('{"text": " "}\n{"x": 1}\n')
    _write_jsonl(tmp_path / "two.jsonl", DOCS[:2])
    cases = [
        ({"dataset": str(tmp_path / "empty.jsonl")}, "no documents"),
        ({"dataset": str(tmp_path / "blank.jsonl")}, "no documents"),
        ({"dataset": str(tmp_path / "missing.jsonl")}, "path not found: .*missing.jsonl"),
        ({"dataset": str(tmp_path / "two.jsonl"), "dp_rank": 2, "dp_world_size": 3}, "rank 2/3"),
        ({"dataset": str(tmp_path / "two.jsonl"), "split": "validation"}, "no 'validation' split"),
        ({"dataset": "titan_corpus", "split": "test"}, "unknown split"),
        ({"dataset": "json"}, "needs dataloader.path"),
    ]
    for kwargs, match in cases:
        with pytest.raises(DataError, match=match) as e:
            _loader(tok, **kwargs)  # type: ignore[arg-type]
        assert "\n" not in str(e.value)


def test_validation_split_of_local_data(tmp_path: Path) -> None:
    for split, docs in (("train", DOCS[:20]), ("validation", DOCS[20:])):
        (tmp_path / split).mkdir()
        _write_jsonl(tmp_path / split / "part-0000.jsonl", docs)
    assert _docs(str(tmp_path), split="validation") == DOCS[20:]
    assert _docs("titan_corpus", path=str(tmp_path), split="validation") == DOCS[20:]
    # a file given explicitly as path serves whichever split asks for it
    val_file = str(tmp_path / "validation" / "part-0000.jsonl")
    assert _docs("mine", path=val_file, split="validation") == DOCS[20:]
    assert _docs(val_file, path=val_file, split="validation") == DOCS[20:]
    assert is_local_dataset(val_file) and not is_local_dataset("allenai/c4")
    register_dataset(
        "tiny_test", DatasetSpec(description="t", local_root=lambda: tmp_path), overwrite=True
    )
    assert _docs("tiny_test", split="train") == DOCS[:20]


def _stream(tok: Tokenizer, docs: list[str]) -> list[int]:
    return [t for d in docs for t in tok.encode(d, bos=True, eos=True)]


def test_packing_reproduces_the_token_stream(tmp_path: Path, tok: Tokenizer) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", DOCS)
    seq_len, bs = 16, 3
    batches = list(_loader(tok, str(path), infinite=False, seq_len=seq_len, local_batch_size=bs))
    stream = _stream(tok, DOCS)
    num_chunks = len(stream) // (seq_len + 1)
    assert num_chunks > 3 * bs and num_chunks % bs != 0  # exercises the last, smaller batch
    assert [x.shape[0] for x, _ in batches] == [bs] * (num_chunks // bs) + [num_chunks % bs]
    chunks = []
    for x, y in batches:
        assert x.dtype == y.dtype == torch.int64 and x.shape[1] == y.shape[1] == seq_len
        assert torch.equal(x[:, 1:], y[:, :-1])  # labels are inputs shifted by one
        chunks += [torch.cat([x[i], y[i, -1:]]) for i in range(x.shape[0])]
    assert torch.cat(chunks).tolist() == stream[: num_chunks * (seq_len + 1)]


def test_finite_loader_repeats_each_pass(tmp_path: Path, tok: Tokenizer) -> None:
    loader = _loader(tok, str(_write_jsonl(tmp_path / "d.jsonl", DOCS)), infinite=False)
    first = next(iter(loader))[0]
    full = [x for x, _ in loader]
    assert torch.equal(full[0], first)
    assert all(torch.equal(a, b) for a, b in zip(full, [x for x, _ in loader], strict=True))


def _take(loader: ParallelAwareDataloader, n: int) -> list[torch.Tensor]:
    it = iter(loader)
    return [torch.cat(next(it)) for _ in range(n)]


@pytest.mark.parametrize("dataset", ["local", "hf_json"])
def test_resume_is_exact(tmp_path: Path, tok: Tokenizer, dataset: str) -> None:
    path = str(_write_jsonl(tmp_path / "d.jsonl", DOCS))
    kwargs = {"dataset": path} if dataset == "local" else {"dataset": "json", "path": path}
    kwargs |= {"dp_rank": 1, "dp_world_size": 2}
    total = 30
    reference = _take(_loader(tok, **kwargs), total)  # type: ignore[arg-type]
    epochs_seen = []
    for k in (0, 1, 4, 9, 13, 17, 25):
        loader = _loader(tok, **kwargs)  # type: ignore[arg-type]
        _take(loader, k)
        state = loader.state_dict()
        assert set(state) == {"dp_rank_1"}
        # Plain int64 tensors only (DCP stores them without pickling), O(1) in the data seen.
        assert all(t.dtype == torch.int64 and t.dim() == 0 for t in state["dp_rank_1"].values())
        epochs_seen.append(int(state["dp_rank_1"]["epoch"]))
        resumed = _loader(tok, **kwargs)  # type: ignore[arg-type]
        resumed.load_state_dict(state)
        rest = _take(resumed, total - k)
        assert all(torch.equal(a, b) for a, b in zip(rest, reference[k:], strict=True)), k
    assert epochs_seen[0] == 0 and max(epochs_seen) >= 2  # resumed across epoch boundaries


def test_state_of_another_rank_is_ignored(tmp_path: Path, tok: Tokenizer) -> None:
    path = str(_write_jsonl(tmp_path / "d.jsonl", DOCS))
    loader = _loader(tok, path)
    _take(loader, 3)
    fresh = _loader(tok, path, dp_rank=1, dp_world_size=2)
    fresh.load_state_dict(loader.state_dict())  # holds dp_rank_0 only (and world size 1)
    expected = _take(_loader(tok, path, dp_rank=1, dp_world_size=2), 2)
    assert all(torch.equal(a, b) for a, b in zip(_take(fresh, 2), expected, strict=True))


def test_hf_json_matches_local_and_splits_ranks(tmp_path: Path) -> None:
    path = str(_write_jsonl(tmp_path / "d.jsonl", DOCS))
    assert _docs("json", path=path) == DOCS
    shares = [_docs("json", path=path, dp_rank=r, dp_world_size=2) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(DOCS) and not set(shares[0]) & set(shares[1])
    source = _source("json", path=path, dp_rank=1, dp_world_size=2)
    assert list(source.iter_from(5)) == shares[1][5:]


def test_hf_non_streaming_skip_and_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in ["", *DOCS[:6]]))
    source = _source("json", path=str(path), streaming=False)
    assert list(source.iter_from(3)) == DOCS[2:6]
    assert list(source) == DOCS[:6]
    assert source.stats["skipped_empty"] == 1


# --- bundled assets -----------------------------------------------------------------------------


def test_paragraph_groups_and_gutenberg_stripping() -> None:
    text = "\n\n".join(f"Paragraph {i} " + "x" * (50 + 37 * i % 400) for i in range(200))
    groups = paragraph_groups(text)
    assert "\n\n".join(groups) == text.strip()
    assert all(200 <= len(g) <= 3000 for g in groups)
    wrapped = "header\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\nbody\n*** END OF THE PROJECT"
    assert strip_gutenberg(wrapped + " GUTENBERG EBOOK X ***\nlicense") == "body"


def _read_split(corpus: Path, split: str) -> list[str]:
    return [json.loads(line)["text"] for f in sorted((corpus / split).glob("*.jsonl"))
            for line in f.read_text().splitlines()]  # fmt: skip


def test_bundled_assets(assets: Path) -> None:
    corpus = assets / "corpus"
    manifest = json.loads((corpus / "manifest.json").read_text())
    assert (corpus / "SOURCES.md").read_text().count("licen") >= 1
    for split in ("train", "validation"):
        for name, meta in manifest[split]["files"].items():
            data = (corpus / split / name).read_bytes()
            assert hashlib.sha256(data).hexdigest() == meta["sha256"]
    train, val = _read_split(corpus, "train"), _read_split(corpus, "validation")
    assert len(train) == manifest["train"]["docs"] and len(val) == manifest["validation"]["docs"]
    assert 0.01 < len(val) / (len(train) + len(val)) < 0.03
    assert not set(train) & set(val)
    assert len(manifest["train"]["files"]) == 8
    tok = Tokenizer(str(assets / "tokenizer" / "titan_bpe.tiktoken"))
    assert tok.n_words == 2048 + 256
    sample = "\n\n".join(val[:20])
    ids = tok.encode(sample, bos=False, eos=False)
    assert tok.decode(ids) == sample
    assert len(sample.encode()) / len(ids) > 2.5  # a real BPE compresses English well
    assert _docs("titan_corpus", path=str(corpus), split="validation") == val


def test_bundled_assets_rebuild_is_a_noop(assets: Path) -> None:
    done = (assets / "DONE").stat().st_mtime_ns
    started = time.perf_counter()
    assert ensure_assets(assets) == assets
    assert time.perf_counter() - started < 0.5
    assert (assets / "DONE").stat().st_mtime_ns == done


def test_forced_build_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Fast sources (no stdlib scan, no download) exercise the build/replace logic only.
    monkeypatch.setattr(assets_mod, "stdlib_docstring_docs", lambda: [])
    monkeypatch.setattr(assets_mod, "shakespeare_docs", lambda workdir: [])
    root = tmp_path / "assets"
    assert ensure_assets(root) == root.resolve()
    done = (root / "DONE").stat().st_mtime_ns
    ensure_assets(root, force=True)
    assert (root / "DONE").stat().st_mtime_ns != done
    assert Tokenizer(str(root / "tokenizer" / "titan_bpe.tiktoken")).n_words == 2304

    def broken() -> list[str]:
        raise RuntimeError("source failed")

    monkeypatch.setattr(assets_mod, "python_reference_docs", broken)
    with pytest.raises(RuntimeError):
        ensure_assets(root, force=True)
    assert (root / "DONE").exists()  # the previous complete build is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["assets"]  # no temp folder, no lock file
