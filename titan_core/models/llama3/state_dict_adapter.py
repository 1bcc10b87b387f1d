"""Convert Llama 3 weights between this engine's (Meta) names and Hugging Face ``transformers``."""

from __future__ import annotations

from typing import Any

import torch

from titan_core.errors import CheckpointError
from titan_core.models.common import ffn_hidden_dim
from titan_core.models.common.hf import (
    decoder_from_hf,
    decoder_to_hf,
    refuse_biases,
    require_keys,
    rope_from_config,
    rope_parameters,
    to_interleaved,
    to_rotate_half,
)
from titan_core.models.llama3.model import TransformerModelArgs

HF_ARCHITECTURES = ("LlamaForCausalLM",)
HF_MODEL_TYPE = "llama"

_to_rotate_half = to_rotate_half  # the names tests and benches use
_to_interleaved = to_interleaved


def to_hf(
    state_dict: dict[str, torch.Tensor], args: TransformerModelArgs
) -> dict[str, torch.Tensor]:
    """Native state dict -> HF ``LlamaForCausalLM`` state dict (``lm_head`` left out when tied)."""
    return decoder_to_hf(state_dict, args, "Llama 3")


def from_hf(
    hf_state_dict: dict[str, torch.Tensor], args: TransformerModelArgs
) -> dict[str, torch.Tensor]:
    """HF ``LlamaForCausalLM`` state dict -> native one, with ``output.weight`` shared when tied."""
    return decoder_from_hf(hf_state_dict, args, "Llama")


def to_hf_config(args: TransformerModelArgs) -> dict[str, Any]:
    """``config.json`` content (``transformers.LlamaConfig``) describing the same model."""
    return {
        "architectures": list(HF_ARCHITECTURES),
        "model_type": HF_MODEL_TYPE,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
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
        "mlp_bias": False,
    }


def _ffn_sizing(dim: int, intermediate: int) -> tuple[int, float | None]:
    """(multiple_of, ffn_dim_multiplier) giving ``intermediate``; a known flavor's if one fits."""
    from titan_core.models.llama3.flavors import llama3_flavors

    candidates = [
        (f.multiple_of, f.ffn_dim_multiplier) for f in llama3_flavors.values() if f.dim == dim
    ]
    candidates += [(2**k, None) for k in range(12, -1, -1)]
    for multiple_of, multiplier in candidates:
        if ffn_hidden_dim(dim, multiple_of, multiplier) == intermediate:
            return multiple_of, multiplier
    # Any size is reachable with multiple_of=1; +0.5 keeps int() from rounding down.
    multiplier = (intermediate + 0.5) / int(2 * (4 * dim) / 3)
    assert ffn_hidden_dim(dim, 1, multiplier) == intermediate
    return 1, multiplier


def from_hf_config(config: dict[str, Any], source: str) -> TransformerModelArgs:
    """Llama 3 model args describing the model of an HF ``config.json``."""
    if config.get("model_type", HF_MODEL_TYPE) != HF_MODEL_TYPE:
        raise CheckpointError(
            f"hf: {source}: model_type {config['model_type']!r}, expected {HF_MODEL_TYPE!r}"
        )
    require_keys(
        config,
        source,
        (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "vocab_size",
        ),
    )
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("head_dim", dim // n_heads) != dim // n_heads:
        raise CheckpointError(f"hf: {source}: head_dim != hidden_size / num_attention_heads")
    refuse_biases(config, source)
    theta, scaling = rope_from_config(config, source)
    multiple_of, multiplier = _ffn_sizing(dim, config["intermediate_size"])
    return TransformerModelArgs(
        dim=dim,
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads", n_heads),
        vocab_size=config["vocab_size"],
        multiple_of=multiple_of,
        ffn_dim_multiplier=multiplier,
        norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=int(config.get("max_position_embeddings", 8192)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
