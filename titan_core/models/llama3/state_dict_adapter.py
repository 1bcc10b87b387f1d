"""Convert Llama 3 weights between this engine's (Meta) names and Hugging Face ``transformers``."""

from __future__ import annotations

import re
from typing import Any

import torch

from titan_core.errors import CheckpointError
from titan_core.models.llama3.model import TransformerModelArgs

# Per-layer names, native -> HF; "{}" is the layer index.
_LAYER_KEYS = {
    "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
}
_TOP_KEYS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^(model\.)?layers\.(\d+)\.(.+)$")


def _template(key: str) -> tuple[str, str | None]:
    """Split a per-layer key into its index-free template and the index."""
    match = _LAYER_RE.match(key)
    if match is None:
        return key, None
    prefix, index, rest = match.groups()
    return f"{prefix or ''}layers.{{}}.{rest}", index


def _to_rotate_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's output rows from interleaved pairs (Meta) to halves (HF rotate_half)."""
    dim1, dim2 = w.shape
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def _to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Exact inverse of ``_to_rotate_half``."""
    dim1, dim2 = w.shape
    return w.view(n_heads, 2, dim1 // n_heads // 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def to_hf(
    state_dict: dict[str, torch.Tensor], args: TransformerModelArgs
) -> dict[str, torch.Tensor]:
    """Native state dict -> HF ``LlamaForCausalLM`` state dict (``lm_head`` left out when tied)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key == "output.weight" and args.tie_word_embeddings:
            continue
        template, index = _template(key)
        hf_template = _LAYER_KEYS.get(template) if index is not None else _TOP_KEYS.get(key)
        if hf_template is None:
            raise CheckpointError(f"to_hf: unexpected Llama 3 state dict key {key!r}")
        if template.endswith("attention.wq.weight"):
            value = _to_rotate_half(value, args.n_heads)
        elif template.endswith("attention.wk.weight"):
            value = _to_rotate_half(value, args.num_kv_heads)
        out[hf_template.format(index)] = value
    return out


_FROM_LAYER = {hf: native for native, hf in _LAYER_KEYS.items()}
_FROM_TOP = {hf: native for native, hf in _TOP_KEYS.items()}


def from_hf(
    hf_state_dict: dict[str, torch.Tensor], args: TransformerModelArgs
) -> dict[str, torch.Tensor]:
    """HF ``LlamaForCausalLM`` state dict -> native one, with ``output.weight`` shared when tied."""
    out: dict[str, torch.Tensor] = {}
    for key, value in hf_state_dict.items():
        # Older exports carry the rotary table; it is recomputed from the args here.
        if key.endswith("rotary_emb.inv_freq"):
            continue
        if key == "lm_head.weight" and args.tie_word_embeddings:
            continue
        template, index = _template(key)
        native = _FROM_LAYER.get(template) if index is not None else _FROM_TOP.get(key)
        if native is None:
            raise CheckpointError(f"from_hf: unexpected Hugging Face Llama key {key!r}")
        if template.endswith("self_attn.q_proj.weight"):
            value = _to_interleaved(value, args.n_heads)
        elif template.endswith("self_attn.k_proj.weight"):
            value = _to_interleaved(value, args.num_kv_heads)
        out[native.format(index)] = value
    # The native module registers the tied tensor under both names, so a strict load needs both.
    if args.tie_word_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def to_hf_config(args: TransformerModelArgs) -> dict[str, Any]:
    """Keyword arguments for ``transformers.LlamaConfig`` describing the same model."""
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling is not None:
        scaling = args.rope_scaling
        rope_parameters = {
            "rope_type": "llama3",
            "rope_theta": args.rope_theta,
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        # transformers >= 5 reads theta and scaling only from `rope_parameters`; 4.x took
        # `rope_theta` and `rope_scaling` at top level instead.
        "rope_parameters": rope_parameters,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }
