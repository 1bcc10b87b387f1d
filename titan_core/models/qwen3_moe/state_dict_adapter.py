"""Convert Qwen3-MoE weights between this engine's names and Hugging Face ``Qwen3MoeForCausalLM``.

Attention, norms, embeddings and the dense layers (``decoder_sparse_step``, ``mlp_only_layers``)
convert exactly as Qwen3 dense (``models.common.hf``: the q/k rows and QK-norm scales permuted
between RoPE layouts). A MoE layer's router ``moe.router.gate.weight`` is HF's
``mlp.gate.weight``; its stacked experts ``moe.experts.w1`` / ``w3`` (E, hidden, dim) and ``w2``
(E, dim, hidden) are one ``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` tensor per
expert, as the published checkpoints store them (transformers >= 5 fuses them when loading).

``to_hf`` maps any subset of keys to the matching subset (one stacked tensor to its E expert
tensors); ``from_hf`` stacks a layer's experts, so it needs all E of them
(CheckpointError otherwise). Routing the HF model cannot express (shared experts, sigmoid
scores, the loss-free bias, a route scale) is refused in one line.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from titan_core.errors import CheckpointError
from titan_core.models.common.hf import decoder_from_hf, decoder_to_hf, require_keys
from titan_core.models.common.moe import MoEArgs
from titan_core.models.qwen3 import state_dict_adapter as qwen3
from titan_core.models.qwen3_moe.model import Qwen3MoeModelArgs

HF_ARCHITECTURES = ("Qwen3MoeForCausalLM",)
HF_MODEL_TYPE = "qwen3_moe"
_FAMILY = "Qwen3-MoE"


def _refuse_unexportable(args: Qwen3MoeModelArgs, what: str) -> MoEArgs:
    """The model's MoEArgs; CheckpointError naming what ``Qwen3MoeForCausalLM`` cannot hold."""
    moe = args.moe
    if moe is None:
        raise CheckpointError(f"{what}: a Qwen3-MoE model without experts (model.moe None)")
    unsupported = [
        name
        for name, present in (
            (f"{moe.num_shared_experts} shared expert(s)", moe.num_shared_experts > 0),
            (f"{moe.score_func} router scores", moe.score_func != "softmax"),
            ("the loss-free load-balance bias", moe.load_balance_bias),
            (f"route_scale {moe.route_scale}", moe.route_scale != 1.0),
        )
        if present
    ]
    if unsupported:
        raise CheckpointError(
            f"{what}: Qwen3MoeForCausalLM cannot represent {', '.join(unsupported)} "
            "(softmax top-k routing, no shared experts)"
        )
    return moe


def to_hf(state_dict: dict[str, torch.Tensor], args: Qwen3MoeModelArgs) -> dict[str, torch.Tensor]:
    """Native state dict (whole or any subset) -> HF ``Qwen3MoeForCausalLM`` state dict."""
    _refuse_unexportable(args, "to_hf")
    return decoder_to_hf(state_dict, args, _FAMILY)


def from_hf(
    hf_state_dict: dict[str, torch.Tensor], args: Qwen3MoeModelArgs
) -> dict[str, torch.Tensor]:
    """HF ``Qwen3MoeForCausalLM`` state dict (per-expert tensors, or transformers' fused
    in-memory ones) -> native one; each MoE layer's experts must all be present."""
    return decoder_from_hf(hf_state_dict, args, _FAMILY)


def to_hf_config(args: Qwen3MoeModelArgs) -> dict[str, Any]:
    """``config.json`` content (``transformers.Qwen3MoeConfig``) describing the same model."""
    moe = _refuse_unexportable(args, "to_hf_config")
    return {
        **qwen3.to_hf_config(args),
        "architectures": list(HF_ARCHITECTURES),
        "model_type": HF_MODEL_TYPE,
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.hidden_dim,
        "norm_topk_prob": moe.route_norm,
        "decoder_sparse_step": args.decoder_sparse_step,
        "mlp_only_layers": list(args.mlp_only_layers),
        "router_aux_loss_coef": moe.aux_loss_coef,
        "output_router_logits": False,
    }


def from_hf_config(config: dict[str, Any], source: str) -> Qwen3MoeModelArgs:
    """Qwen3-MoE model args describing the model of an HF ``config.json``."""
    if config.get("model_type", HF_MODEL_TYPE) != HF_MODEL_TYPE:
        raise CheckpointError(
            f"hf: {source}: model_type {config['model_type']!r}, expected {HF_MODEL_TYPE!r}"
        )
    # transformers 5 writes num_experts as num_local_experts (an attribute alias).
    if "num_experts" not in config and "num_local_experts" in config:
        config = {**config, "num_experts": config["num_local_experts"]}
    require_keys(config, source, ("num_experts", "num_experts_per_tok", "moe_intermediate_size"))
    experts, top_k = config["num_experts"], config["num_experts_per_tok"]
    if not 1 <= top_k <= experts:
        raise CheckpointError(
            f"hf: {source}: num_experts_per_tok {top_k} must be between 1 and num_experts "
            f"({experts})"
        )
    # The attention/dense part is a Qwen3 config: read (and refused) as Qwen3 dense.
    dense = qwen3.from_hf_config({**config, "model_type": qwen3.HF_MODEL_TYPE}, source)
    moe = MoEArgs(
        num_experts=experts,
        top_k=top_k,
        hidden_dim=config["moe_intermediate_size"],
        route_norm=bool(config.get("norm_topk_prob", False)),
        aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)),
    )
    return Qwen3MoeModelArgs(
        **{f.name: getattr(dense, f.name) for f in dataclasses.fields(dense) if f.name != "moe"},
        moe=moe,
        decoder_sparse_step=int(config.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(config.get("mlp_only_layers") or ()),
    )
