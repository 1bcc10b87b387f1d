"""Named Llama 3 sizes: Meta's published shapes plus small debug models for tests."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from titan_core.models.llama3.model import RopeScaling, TransformerModelArgs

# The published models were trained to 131072 positions, but the table is sized to 8192 rows:
# the trainer extends it to the training seq_len when that is longer, and a 128k-row complex table
# per rank is wasted memory for the usual 8k runs.
_PUBLISHED_ROPE_ROWS = 8192
_LLAMA3_VOCAB = 128256

# A placeholder: the trainer replaces it with the tokenizer's vocabulary size.
_DEBUG_VOCAB = 2048


def _debug(**overrides: Any) -> TransformerModelArgs:
    base = TransformerModelArgs(
        dim=256,
        n_layers=6,
        n_heads=16,
        n_kv_heads=4,
        vocab_size=_DEBUG_VOCAB,
        multiple_of=256,
        rope_theta=500000.0,
        # Scales frequencies whose wavelength passes 64/4 = 16 tokens, so even short test
        # sequences exercise all three branches of the Llama 3.1 rule (kept, smoothed, divided).
        rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=64),
        max_seq_len=2048,
    )
    return replace(base, **overrides)


llama3_flavors: dict[str, TransformerModelArgs] = {
    "debugmodel": _debug(),
    "debugmodel_tied": _debug(tie_word_embeddings=True),
    "debugmodel_tiny": _debug(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=64),
    # Llama 3.2 1B / 3B (tied embeddings, rope factor 32).
    "1B": TransformerModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=_LLAMA3_VOCAB,
        multiple_of=256,
        ffn_dim_multiplier=1.5,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=32.0),
        max_seq_len=_PUBLISHED_ROPE_ROWS,
        tie_word_embeddings=True,
    ),
    "3B": TransformerModelArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        vocab_size=_LLAMA3_VOCAB,
        multiple_of=256,
        ffn_dim_multiplier=1.0,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=32.0),
        max_seq_len=_PUBLISHED_ROPE_ROWS,
        tie_word_embeddings=True,
    ),
    # Llama 3.1 8B / 70B / 405B (rope factor 8).
    "8B": TransformerModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=_LLAMA3_VOCAB,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=8.0),
        max_seq_len=_PUBLISHED_ROPE_ROWS,
    ),
    "70B": TransformerModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=_LLAMA3_VOCAB,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=8.0),
        max_seq_len=_PUBLISHED_ROPE_ROWS,
    ),
    "405B": TransformerModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=_LLAMA3_VOCAB,
        multiple_of=4096,
        ffn_dim_multiplier=1.2,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=8.0),
        max_seq_len=_PUBLISHED_ROPE_ROWS,
    ),
}
