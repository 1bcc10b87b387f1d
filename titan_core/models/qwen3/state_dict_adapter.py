"""Qwen3 <-> Hugging Face ``Qwen3ForCausalLM``: the shared decoder conversion
(``models.common.family``) with an explicit FFN width and no sliding-window attention.

The names are Llama's plus ``self_attn.{q,k}_norm``; the query/key rows and the QK-norm scales
are permuted between the engine's interleaved RoPE layout and HF's ``rotate_half``
(``models.common.hf``).
"""

from __future__ import annotations

from typing import Any

from titan_core.errors import CheckpointError
from titan_core.models.common.family import DecoderHF
from titan_core.models.qwen3.model import Qwen3ModelArgs


def _refuse(config: dict[str, Any], source: str) -> dict[str, Any]:
    """One CheckpointError line for what the engine's Qwen3 does not compute."""
    layer_types = set(config.get("layer_types") or ["full_attention"])
    if config.get("use_sliding_window") or layer_types != {"full_attention"}:
        raise CheckpointError(
            f"hf: {source}: sliding-window attention (use_sliding_window / layer_types) "
            "is not supported"
        )
    if config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(
            f"hf: {source}: hidden_act {config['hidden_act']!r} is not supported (silu)"
        )
    return config


def _read(config: dict[str, Any], source: str) -> dict[str, Any]:
    """Qwen3's own args fields: the FFN width is given, not derived from ``dim``."""
    return {"hidden_dim": config["intermediate_size"]}


def _write(args: Qwen3ModelArgs) -> dict[str, Any]:
    """Qwen3's own ``config.json`` keys: full attention in every layer."""
    return {"use_sliding_window": False, "sliding_window": None}


HF = DecoderHF(
    architectures=("Qwen3ForCausalLM",),
    model_type="qwen3",
    name="Qwen3",
    args_cls=Qwen3ModelArgs,
    defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 40960},
    refuse=_refuse,
    read=_read,
    write=_write,
)
to_hf, from_hf = HF.to_hf, HF.from_hf
to_hf_config, from_hf_config = HF.to_hf_config, HF.from_hf_config
