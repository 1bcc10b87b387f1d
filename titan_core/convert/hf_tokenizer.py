"""Export the project's tiktoken BPE as a Hugging Face tokenizer with identical token ids.

The files (``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``) load with
``AutoTokenizer.from_pretrained``. Two choices match how the engine tokenizes training data:

* BOS is added automatically (``tokenizer(text)`` == ``Tokenizer.encode(text, bos=True,
  eos=False)``), because every training document starts with ``<|begin_of_text|>``;
  ``add_special_tokens=False`` gives the bare ids.
* Special-token strings inside text are encoded as plain text (``split_special_tokens``), as
  ``Tokenizer.encode`` does; special ids are only ever inserted by id.
"""

from __future__ import annotations

import json
import os
from typing import Any

import fsspec

from titan_core import storage
from titan_core.data.tokenizer import (
    SPECIAL_TOKENS,
    Tokenizer,
    build_hf_bpe_tokenizer,
    bytes_to_unicode,
    parse_ranks,
)
from titan_core.errors import DataError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_BOS, _EOS, _PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>"


def _read_ranks(path: str) -> dict[bytes, int]:
    try:
        with fsspec.open(path, "rb") as f:
            data = f.read()
    except (FileNotFoundError, IsADirectoryError):
        raise DataError(f"tokenizer.path: file not found: {path}") from None
    return parse_ranks(data, path)


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """BPE merges whose priority order reproduces tiktoken's rank order.

    Every split of a token into two known pieces is a merge producing it, ordered by the rank of
    the result (then the pieces'): tiktoken merges the lowest-ranked pair first, and a merge's
    position in the list is its priority in HF's BPE.
    """
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def build_tokenizer_json(ranks: dict[bytes, int]) -> Any:
    """An HF ``tokenizers.Tokenizer``: byte-level BPE over ``ranks`` + the Llama 3 specials."""
    from tokenizers import AddedToken, processors
    from tokenizers.models import BPE

    to_char = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(to_char[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = [(text(a), text(b)) for a, b in merges_from_ranks(ranks)]
    # ignore_merges: a pre-token that is itself in the vocabulary maps straight to its id, which
    # is what tiktoken does before it tries any merge.
    hf: Any = build_hf_bpe_tokenizer(BPE(vocab=vocab, merges=merges, ignore_merges=True))
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    bos_id = len(ranks)
    hf.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{_BOS}:0 $A:0",
                pair=f"{_BOS}:0 $A:0 {_BOS}:1 $B:1",
                special_tokens=[(_BOS, bos_id)],
            ),
        ]
    )
    return hf


def tokenizer_config(tok: Tokenizer, model_max_length: int) -> dict[str, Any]:
    """``tokenizer_config.json``: the fast tokenizer class, specials and our two choices."""
    added = {
        str(i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token, i in tok.special_tokens.items()
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _BOS,
        "eos_token": _EOS,
        "pad_token": _PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length,
        "added_tokens_decoder": added,
    }


def export_hf_tokenizer(tokenizer_path: str, out_dir: str, *, model_max_length: int) -> Tokenizer:
    """Write the HF tokenizer files for the tiktoken ranks at ``tokenizer_path`` into ``out_dir``.

    ``out_dir`` is a local directory; returns the project tokenizer it mirrors.
    """
    tok = Tokenizer(tokenizer_path)
    ranks = _read_ranks(tokenizer_path)
    hf = build_tokenizer_json(ranks)
    ids = {t: hf.token_to_id(t) for t in SPECIAL_TOKENS}
    assert ids == tok.special_tokens, "special token ids differ between HF and tiktoken"
    with storage.output_path(os.path.join(out_dir, "tokenizer.json")) as tmp:
        hf.save(tmp)
    specials = {"bos_token": _BOS, "eos_token": _EOS, "pad_token": _PAD}
    files = {
        "tokenizer_config.json": tokenizer_config(tok, model_max_length),
        "special_tokens_map.json": specials,
    }
    for name, content in files.items():
        text = json.dumps(content, indent=2, ensure_ascii=False) + "\n"
        storage.write_text(os.path.join(out_dir, name), text)
    return tok
