"""Named Qwen3 dense sizes: the published shapes plus small debug models for tests."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from titan_core.models.qwen3.model import Qwen3ModelArgs

# The published models were trained to 40960 positions (config.json max_position_embeddings),
# but the table is sized to 8192 rows as for Llama 3: the trainer extends it to the training
# seq_len when that is longer, and a 40k-row complex table per rank is wasted memory for 8k runs.
_PUBLISHED_ROPE_ROWS = 8192

# A placeholder: the trainer replaces it with the tokenizer's vocabulary size.
_DEBUG_VOCAB = 2048


def _debug(**overrides: Any) -> Qwen3ModelArgs:
    # n_heads * head_dim (512) != dim (256): the explicit head size is exercised everywhere.
    base = Qwen3ModelArgs(
        dim=256,
        n_layers=6,
        n_heads=16,
        n_kv_heads=4,
        head_dim=32,
        hidden_dim=768,
        vocab_size=_DEBUG_VOCAB,
        max_seq_len=2048,
    )
    return replace(base, **overrides)


def _published(
    dim: int, n_layers: int, n_heads: int, hidden_dim: int, tied: bool
) -> Qwen3ModelArgs:
    """A published Qwen3 dense shape: 8 kv heads of 128 channels, vocabulary 151936."""
    return Qwen3ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        head_dim=128,
        hidden_dim=hidden_dim,
        vocab_size=151936,
        max_seq_len=_PUBLISHED_ROPE_ROWS,
        tie_word_embeddings=tied,
    )


qwen3_flavors: dict[str, Qwen3ModelArgs] = {
    "debugmodel": _debug(),
    "debugmodel_tied": _debug(tie_word_embeddings=True),
    "debugmodel_tiny": _debug(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=192),
    # Qwen/Qwen3-{0.6B,1.7B,4B,8B,14B,32B} config.json (the small three tie their embeddings).
    "0.6B": _published(1024, 28, 16, 3072, tied=True),
    "1.7B": _published(2048, 28, 16, 6144, tied=True),
    "4B": _published(2560, 36, 32, 9728, tied=True),
    "8B": _published(4096, 36, 32, 12288, tied=False),
    "14B": _published(5120, 40, 40, 17408, tied=False),
    "32B": _published(5120, 64, 64, 25600, tied=False),
}
