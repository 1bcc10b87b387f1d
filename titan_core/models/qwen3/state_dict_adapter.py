"""Convert Qwen3 weights between this engine's names and Hugging Face ``Qwen3ForCausalLM``.

The names are Llama's plus ``self_attn.{q,k}_norm``; the query/key rows and the QK-norm scales
are permuted between the engine's interleaved RoPE layout and HF's ``rotate_half``
(``models.common.hf``).
"""

from __future__ import annotations

from typing import Any

import torch

from titan_core.errors import CheckpointError
from titan_core.models.common.hf import (
    decoder_from_hf,
    decoder_to_hf,
    refuse_biases,
    require_keys,
    rope_from_config,
    rope_parameters,
)
from titan_core.models.qwen3.model import Qwen3ModelArgs

HF_ARCHITECTURES = ("Qwen3ForCausalLM",)
HF_MODEL_TYPE = "qwen3"


def to_hf(state_dict: dict[str, torch.Tensor], args: Qwen3ModelArgs) -> dict[str, torch.Tensor]:
    """Native state dict -> HF ``Qwen3ForCausalLM`` state dict (``lm_head`` left out when tied)."""
    return decoder_to_hf(state_dict, args, "Qwen3")


def from_hf(
    hf_state_dict: dict[str, torch.Tensor], args: Qwen3ModelArgs
) -> dict[str, torch.Tensor]:
    """HF ``Qwen3ForCausalLM`` state dict -> native one, with ``output.weight`` shared when tied."""
    return decoder_from_hf(hf_state_dict, args, "Qwen3")


def to_hf_config(args: Qwen3ModelArgs) -> dict[str, Any]:
    """``config.json`` content (``transformers.Qwen3Config``) describing the same model."""
    return {
        "architectures": list(HF_ARCHITECTURES),
        "model_type": HF_MODEL_TYPE,
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": rope_parameters(args.rope_theta, args.rope_scaling),
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
    }


def _refuse_unsupported(config: dict[str, Any], source: str) -> None:
    """One CheckpointError line for what the engine's Qwen3 does not compute."""
    if config.get("model_type", HF_MODEL_TYPE) != HF_MODEL_TYPE:
        raise CheckpointError(
            f"hf: {source}: model_type {config['model_type']!r}, expected {HF_MODEL_TYPE!r}"
        )
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
    refuse_biases(config, source)


def from_hf_config(config: dict[str, Any], source: str) -> Qwen3ModelArgs:
    """Qwen3 model args describing the model of an HF ``config.json``."""
    _refuse_unsupported(config, source)
    require_keys(
        config,
        source,
        (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "head_dim",
            "vocab_size",
        ),
    )
    theta, scaling = rope_from_config(config, source)
    n_heads = config["num_attention_heads"]
    return Qwen3ModelArgs(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads", n_heads),
        head_dim=config["head_dim"],
        hidden_dim=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=int(config.get("max_position_embeddings", 40960)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
