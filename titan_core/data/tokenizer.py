"""Llama-3-style tiktoken tokenizer over a local ranks file, and an offline BPE trainer for it."""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import fsspec
import tiktoken

from titan_core import storage
from titan_core.errors import DataError

# Llama 3's pre-tokenizer regex: training (HF tokenizers) and encoding (tiktoken) must split alike.
LLAMA3_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_SPECIAL_TOKENS = 256
_NAMED_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
)
SPECIAL_TOKENS: tuple[str, ...] = _NAMED_SPECIAL_TOKENS + tuple(
    f"<|reserved_special_token_{2 + i}|>"
    for i in range(NUM_SPECIAL_TOKENS - len(_NAMED_SPECIAL_TOKENS))
)
_BUILD_HINT = "build the bundled tokenizer with `python -m titan_core.data.assets`"


def parse_ranks(data: bytes, path: str) -> dict[bytes, int]:
    """Parse tiktoken's `base64(token) rank` lines; DataError unless dense and all bytes present."""
    ranks: dict[bytes, int] = {}
    for line_no, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
        except (ValueError, binascii.Error):
            raise DataError(
                f"tokenizer.path: {path} line {line_no}: expected 'base64(token) rank'"
            ) from None
    # tiktoken needs dense ranks and every single byte, or encoding can fail on unseen bytes.
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise DataError(f"tokenizer.path: {path}: expected unique ranks 0..n-1, got gaps/repeats")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise DataError(
            f"tokenizer.path: {path}: expected all 256 single bytes, {len(missing)} lack"
        )
    return ranks


def _read_bytes(path: str) -> bytes:
    try:
        with fsspec.open(path, "rb") as f:
            return f.read()
    except (FileNotFoundError, IsADirectoryError):
        raise DataError(f"tokenizer.path: file not found: {path} ({_BUILD_HINT})") from None


class Tokenizer:
    """Byte-level BPE (tiktoken) with Llama 3's 256 special tokens placed after the ranks."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        # Not tiktoken.load.load_tiktoken_bpe: it caches every path (local ones too) in
        # /tmp/data-gym-cache by path name, so a rebuilt file would load stale ranks; and it
        # cannot read fsspec URLs. parse_ranks reads the very same format.
        data = _read_bytes(self.path)
        ranks = parse_ranks(data, self.path)
        # Identifies the encoding, not the file's location: a prepared dataset records it, and a
        # job may only train on data prepared with the same ranks, split regex and specials.
        self.fingerprint: str = hashlib.sha256(
            b"\0".join([data, LLAMA3_PAT_STR.encode(), "\n".join(SPECIAL_TOKENS).encode()])
        ).hexdigest()
        self.special_tokens: dict[str, int] = {
            token: len(ranks) + i for i, token in enumerate(SPECIAL_TOKENS)
        }
        self.model = tiktoken.Encoding(
            name=Path(self.path).stem,
            pat_str=LLAMA3_PAT_STR,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self.n_words: int = self.model.n_vocab
        self.bos_id: int = self.special_tokens["<|begin_of_text|>"]
        self.eos_id: int = self.special_tokens["<|end_of_text|>"]
        self.pad_id: int = self.special_tokens["<|finetune_right_pad_id|>"]

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        """Token ids of text; special-token strings in text are encoded as plain text."""
        ids = self.model.encode_ordinary(text)
        if bos:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids (invalid UTF-8 from partial tokens becomes U+FFFD)."""
        return self.model.decode(list(ids))

    def token_byte_counts(self) -> list[int]:
        """UTF-8 bytes each token id stands for (bits per byte divides by them); special
        tokens count 0."""
        specials = set(self.special_tokens.values())
        return [
            0 if i in specials else len(self.model.decode_single_token_bytes(i))
            for i in range(self.n_words)
        ]

    def __repr__(self) -> str:
        return f"Tokenizer(path={self.path!r}, n_words={self.n_words})"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-char map that HF's ByteLevel pre-tokenizer uses for tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_hf_bpe_tokenizer(model: object | None = None) -> object:
    """An HF `tokenizers.Tokenizer` splitting and byte-mapping exactly as Tokenizer does."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer(model if model is not None else models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    return hf


def train_bpe(texts: Iterable[str], vocab_size: int, out_path: str | os.PathLike[str]) -> str:
    """Train a byte-level BPE of vocab_size tokens (256 bytes included); write tiktoken ranks."""
    from tokenizers import pre_tokenizers, trainers

    if vocab_size <= 256:
        raise DataError(
            f"train_bpe.vocab_size: expected > 256 (the single bytes), got {vocab_size}"
        )
    hf = build_hf_bpe_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    ranks = hf_vocab_to_ranks(hf.get_vocab())
    out = os.fspath(out_path)
    lines = b"".join(
        base64.b64encode(token) + b" " + str(rank).encode() + b"\n" for token, rank in ranks.items()
    )
    _write_atomic(out, lines)
    return out


def hf_vocab_to_ranks(vocab: dict[str, int]) -> dict[bytes, int]:
    """Ranks 0..255 are the bytes in byte order; merged tokens follow in HF id (= merge) order."""
    char_to_byte = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for token, _ in sorted(vocab.items(), key=lambda item: item[1]):
        token_bytes = bytes(char_to_byte[c] for c in token)
        if len(token_bytes) > 1:
            assert token_bytes not in ranks, f"duplicate token {token_bytes!r}"
            ranks[token_bytes] = len(ranks)
    return ranks


def _write_atomic(path: str, data: bytes) -> None:
    storage.write_bytes(path, data)
