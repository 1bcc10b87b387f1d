"""Tokenizer: tiktoken export of a trained BPE matches HF tokenizers; Llama 3 specials; errors."""

from pathlib import Path
from pydoc_data.topics import topics

import pytest
from tokenizers import pre_tokenizers, trainers

from titan_core.data.tokenizer import (
    SPECIAL_TOKENS,
    Tokenizer,
    build_hf_bpe_tokenizer,
    bytes_to_unicode,
    parse_ranks,
    train_bpe,
)
from titan_core.errors import DataError

VOCAB = 700
UNICODE_TEXT = (
    "Grüße aus Köln — naïve café, 日本語のテキスト, emoji 🤗🚀, Ελληνικά, עברית,\n"
    "combining e\u0301, tabs\tand  double  spaces,\r\nwindows lines,   trailing   \n\n\n"
    "numbers 1234567 3.14159 and contractions: don't, WE'LL, they'Re."
)


def _texts() -> list[str]:
    return [topics[k] for k in sorted(topics)][:60]


def _held_out() -> str:
    return "\n\n".join(topics[k] for k in sorted(topics)[60:70]) + UNICODE_TEXT


@pytest.fixture(scope="module")
def ranks_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "small.tiktoken"
    assert train_bpe(_texts(), VOCAB, path) == str(path)
    return path


@pytest.fixture(scope="module")
def tok(ranks_file: Path) -> Tokenizer:
    return Tokenizer(str(ranks_file))


def test_ids_match_hf_tokenizers(tok: Tokenizer) -> None:
    hf = build_hf_bpe_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    hf.train_from_iterator(_texts(), trainer=trainer)
    char_to_byte = {c: b for b, c in bytes_to_unicode().items()}
    ranks = tok.model._mergeable_ranks
    hf_to_rank = {i: ranks[bytes(char_to_byte[c] for c in t)] for t, i in hf.get_vocab().items()}
    text = _held_out()
    hf_ids = [hf_to_rank[i] for i in hf.encode(text).ids]
    ids = tok.encode(text, bos=False, eos=False)
    assert len(ids) > 1000
    assert ids == hf_ids


def test_ranks_layout_and_determinism(ranks_file: Path, tmp_path: Path) -> None:
    ranks = parse_ranks(ranks_file.read_bytes(), str(ranks_file))
    assert len(ranks) == VOCAB
    assert all(ranks[bytes([b])] == b for b in range(256))
    again = train_bpe(_texts(), VOCAB, tmp_path / "again.tiktoken")
    assert Path(again).read_bytes() == ranks_file.read_bytes()


def test_round_trip_and_bos_eos(tok: Tokenizer) -> None:
    for text in (UNICODE_TEXT, _held_out(), "", " ", "\n\n"):
        assert tok.decode(tok.encode(text, bos=False, eos=False)) == text
    ids = tok.encode("hello world", bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.bos_id not in ids[1:-1] and tok.eos_id not in ids[1:-1]
    assert tok.encode("hello world", bos=False, eos=False) == ids[1:-1]
    assert tok.decode(ids) == "<|begin_of_text|>hello world<|end_of_text|>"


def test_special_token_strings_are_plain_text(tok: Tokenizer) -> None:
    text = "x <|begin_of_text|> y <|eot_id|><|end_of_text|>"
    ids = tok.encode(text, bos=False, eos=False)
    assert max(ids) < VOCAB  # only mergeable ranks, never a special id
    assert tok.decode(ids) == text


def test_llama3_special_tokens(tok: Tokenizer) -> None:
    assert tok.n_words == VOCAB + 256
    assert len(tok.special_tokens) == len(SPECIAL_TOKENS) == 256
    assert list(tok.special_tokens) == list(SPECIAL_TOKENS)
    assert list(tok.special_tokens.values()) == list(range(VOCAB, VOCAB + 256))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (VOCAB, VOCAB + 1, VOCAB + 4)
    assert tok.special_tokens["<|eot_id|>"] == VOCAB + 9
    assert SPECIAL_TOKENS[11] == "<|reserved_special_token_2|>"
    assert SPECIAL_TOKENS[-1] == "<|reserved_special_token_246|>"


def test_missing_file_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.tiktoken"
    with pytest.raises(DataError, match=r"tokenizer\.path: file not found: .*nope\.tiktoken") as e:
        Tokenizer(str(missing))
    assert "python -m titan_core.data.assets" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"this is not a ranks file\n", "line 1: expected 'base64"),
        (b"QQ== 0\nQg== 0\n", "unique ranks"),
        (b"QQ== 0\n", "all 256 single bytes"),
    ],
)
def test_invalid_ranks_file(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "bad.tiktoken"
    path.write_bytes(content)
    with pytest.raises(DataError, match=match):
        Tokenizer(str(path))


def test_rewritten_file_is_reloaded(tmp_path: Path, ranks_file: Path) -> None:
    # tiktoken's own loader caches by path name; a retrained file must not load stale ranks.
    path = tmp_path / "t.tiktoken"
    path.write_bytes(ranks_file.read_bytes())
    assert Tokenizer(str(path)).n_words == VOCAB + 256
    train_bpe(_texts(), 300, path)
    assert Tokenizer(str(path)).n_words == 300 + 256


def test_vocab_size_too_small(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"train_bpe\.vocab_size"):
        train_bpe(["abc"], 256, tmp_path / "x.tiktoken")
