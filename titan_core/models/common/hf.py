"""Helpers the families' Hugging Face adapters share: Llama-style tensor names (with
mixture-of-experts layers: the router, and routed experts stacked natively but one tensor per
expert in HF), RoPE layout permutations and config reading.

The engine's RoPE rotates interleaved channel pairs (Meta's layout); ``transformers`` rotates
halves (``rotate_half``). Query/key projection rows (and a QK-norm's scale) are permuted within
each head on the way out and back; nothing else changes.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from titan_core.errors import CheckpointError
from titan_core.models.common.rope import RopeScaling, YarnScaling


def to_rotate_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's rows from interleaved pairs (Meta) to halves (HF rotate_half).

    ``w`` is (n_heads * head_dim, ...) — a projection weight or a 1-D norm scale."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Exact inverse of ``to_rotate_half``."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *rest).transpose(1, 2).reshape(w.shape)


# Native -> HF names of a Llama-style decoder (Llama, Qwen3, ...); "{}" is the layer index.
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
_QK_NORM_KEYS = {  # only in families with ``qk_norm``
    "layers.{}.attention.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "layers.{}.attention.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
}
# Mixture-of-experts layers (Qwen2/3-MoE, OLMoE, DeepSeek names): the router, and the routed
# experts, stacked natively (E, ...) and one tensor per expert ("{e}") in HF.
_MOE_KEYS = {"layers.{}.moe.router.gate.weight": "model.layers.{}.mlp.gate.weight"}
_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT_KEYS = {
    f"layers.{{}}.moe.experts.{w}": f"model.layers.{{}}.mlp.experts.{{e}}.{proj}.weight"
    for w, proj in _EXPERT_PROJ.items()
}
_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$")
# transformers >= 5 fuses the experts in memory (what ``model.state_dict()`` gives): gate and up
# projections concatenated on dim 1, down stacked; read too, never written.
_FUSED_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
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


def _names(args: Any) -> tuple[dict[str, str], dict[str, int]]:
    """(native -> HF per-layer templates, native templates RoPE-permuted -> their head count).

    A QK-norm scale is one head's channels shared by all heads: permuted as a single head."""
    layer = {**_LAYER_KEYS, **(_QK_NORM_KEYS if args.qk_norm else {})}
    if getattr(args, "moe", None) is not None:
        layer.update(_MOE_KEYS)
    rope = {
        "layers.{}.attention.wq.weight": args.n_heads,
        "layers.{}.attention.wk.weight": args.num_kv_heads,
        "layers.{}.attention.q_norm.weight": 1,
        "layers.{}.attention.k_norm.weight": 1,
    }
    return layer, rope


def decoder_to_hf(
    state_dict: dict[str, torch.Tensor], args: Any, family: str
) -> dict[str, torch.Tensor]:
    """Native decoder state dict (whole or any subset) -> HF Llama-style names and RoPE layout
    (``lm_head`` left out when tied); ``family`` names the model in errors."""
    layer, rope = _names(args)
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key == "output.weight" and args.tie_word_embeddings:
            continue
        template, index = _template(key)
        if index is not None and template in _EXPERT_KEYS and getattr(args, "moe", None):
            out.update(experts_to_hf(value, _EXPERT_KEYS[template], index))
            continue
        hf_template = layer.get(template) if index is not None else _TOP_KEYS.get(key)
        if hf_template is None:
            raise CheckpointError(f"to_hf: unexpected {family} state dict key {key!r}")
        if template in rope:
            value = to_rotate_half(value, rope[template])
        out[hf_template.format(index)] = value
    return out


def decoder_from_hf(
    hf_state_dict: dict[str, torch.Tensor], args: Any, family: str
) -> dict[str, torch.Tensor]:
    """Inverse of ``decoder_to_hf``; a tied ``output.weight`` is the embedding tensor itself."""
    layer, rope = _names(args)
    from_layer = {hf: native for native, hf in layer.items()}
    from_top = {hf: native for native, hf in _TOP_KEYS.items()}
    out: dict[str, torch.Tensor] = {}
    if getattr(args, "moe", None) is not None:
        hf_state_dict, out = experts_from_hf(hf_state_dict, args.moe.num_experts, family)
    for key, value in hf_state_dict.items():
        # Older exports carry the rotary table; it is recomputed from the args here.
        if key.endswith("rotary_emb.inv_freq"):
            continue
        if key == "lm_head.weight" and args.tie_word_embeddings:
            continue
        template, index = _template(key)
        native = from_layer.get(template) if index is not None else from_top.get(key)
        if native is None:
            raise CheckpointError(f"from_hf: unexpected Hugging Face {family} key {key!r}")
        if native in rope:
            value = to_interleaved(value, rope[native])
        out[native.format(index)] = value
    # The native module registers the tied tensor under both names, so a strict load needs both.
    if args.tie_word_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def experts_to_hf(stacked: torch.Tensor, hf_template: str, layer: str) -> dict[str, torch.Tensor]:
    """A stacked (E, ...) expert weight as E per-expert HF tensors.

    Copies, not views: safetensors refuses to save tensors that share storage."""
    return {hf_template.format(layer, e=e): w.clone() for e, w in enumerate(stacked.unbind(0))}


def experts_from_hf(
    hf_state_dict: dict[str, torch.Tensor], num_experts: int, family: str
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the keys that are not routed experts, the native stacked expert weights).

    Per-expert tensors (checkpoint files) are stacked, transformers' fused in-memory
    ``gate_up_proj`` / ``down_proj`` split. A layer's experts are stacked together, so each
    layer must come whole: CheckpointError naming the first expert missing otherwise."""
    from_proj = {proj: w for w, proj in _EXPERT_PROJ.items()}
    rest: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    stacked: dict[str, torch.Tensor] = {}
    for key, value in hf_state_dict.items():
        per_expert, fused = _EXPERT_RE.match(key), _FUSED_RE.match(key)
        if per_expert is not None and per_expert[3] in from_proj:
            layer, e, proj = per_expert.groups()
            if int(e) >= num_experts:
                raise CheckpointError(
                    f"from_hf: {key}: expert {e} of a {family} model of {num_experts} experts"
                )
            native = f"layers.{layer}.moe.experts.{from_proj[proj]}"
            parts.setdefault(native, {})[int(e)] = value
        elif fused is not None and fused[2] == "down_proj":
            stacked[f"layers.{fused[1]}.moe.experts.w2"] = value
        elif fused is not None:
            gate, up = value.chunk(2, dim=1)
            stacked[f"layers.{fused[1]}.moe.experts.w1"] = gate.contiguous()
            stacked[f"layers.{fused[1]}.moe.experts.w3"] = up.contiguous()
        else:
            rest[key] = value
    for native, experts in parts.items():
        missing = [e for e in range(num_experts) if e not in experts]
        if missing:
            raise CheckpointError(
                f"from_hf: {native}: expert {missing[0]} of {num_experts} missing "
                f"({len(missing)} in all); a {family} layer's experts convert together"
            )
        stacked[native] = torch.stack([experts[e] for e in range(num_experts)])
    return rest, stacked


def require_keys(config: dict[str, Any], source: str, keys: tuple[str, ...]) -> None:
    """CheckpointError naming the ``config.json`` keys that are missing."""
    missing = [k for k in keys if k not in config]
    if missing:
        raise CheckpointError(f"hf: {source} lacks {', '.join(missing)}")


def rope_from_config(
    config: dict[str, Any], source: str, types: tuple[str, ...] = ("default", "llama3")
) -> tuple[float, RopeScaling | YarnScaling | None]:
    """(theta, Llama 3.1 or YaRN scaling or None) from ``rope_parameters`` (transformers >= 5)
    or the 4.x ``rope_theta`` / ``rope_scaling`` keys; RoPE types not in ``types`` (those the
    family's model computes) are refused."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in types:
        raise CheckpointError(
            f"hf: {source}: rope_type {rope_type!r} is not supported ({', '.join(types)})"
        )
    if rope_type == "default":
        return theta, None
    if rope_type == "yarn":
        return theta, _yarn_from_config(rope, source)
    defaults = RopeScaling()
    return theta, RopeScaling(
        factor=float(rope.get("factor", defaults.factor)),
        low_freq_factor=float(rope.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(rope.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(
            rope.get("original_max_position_embeddings", defaults.original_max_position_embeddings)
        ),
    )


def _yarn_from_config(rope: dict[str, Any], source: str) -> YarnScaling:
    """YaRN as HF's ``_compute_yarn_parameters`` reads it (DeepSeek-V3's keys)."""
    if rope.get("attention_factor") is not None:
        raise CheckpointError(f"hf: {source}: yarn attention_factor is not supported")
    if rope.get("factor") is None or rope.get("original_max_position_embeddings") is None:
        raise CheckpointError(
            f"hf: {source}: yarn needs factor and original_max_position_embeddings"
        )
    return YarnScaling(
        factor=float(rope["factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        mscale=float(rope.get("mscale") or 0.0),  # absent: HF's mscale(factor) magnitude
        mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
        truncate=bool(rope.get("truncate", True)),
    )


def rope_parameters(theta: float, scaling: RopeScaling | YarnScaling | None) -> dict[str, Any]:
    """``rope_parameters`` for ``config.json`` (transformers >= 5 reads theta and scaling only
    from it; 4.x took ``rope_theta`` and ``rope_scaling`` at top level instead)."""
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    if isinstance(scaling, YarnScaling):
        return {"rope_type": "yarn", "rope_theta": theta, **dataclasses.asdict(scaling)}
    return {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
    }


def refuse_biases(config: dict[str, Any], source: str) -> None:
    """CheckpointError for projections with biases (no family here has them)."""
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise CheckpointError(f"hf: {source}: attention_bias / mlp_bias are not supported")
