"""Qwen3-MoE <-> Hugging Face ``Qwen3MoeForCausalLM``: Qwen3's conversion plus the experts.

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

from titan_core.errors import CheckpointError
from titan_core.models.common.hf import require_keys
from titan_core.models.common.moe import MoEArgs
from titan_core.models.qwen3 import state_dict_adapter as qwen3
from titan_core.models.qwen3_moe.model import Qwen3MoeModelArgs


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


def _refuse(config: dict[str, Any], source: str) -> dict[str, Any]:
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
    return qwen3.HF.refuse(config, source)


def _read(config: dict[str, Any], source: str) -> dict[str, Any]:
    moe = MoEArgs(
        num_experts=config["num_experts"],
        top_k=config["num_experts_per_tok"],
        hidden_dim=config["moe_intermediate_size"],
        route_norm=bool(config.get("norm_topk_prob", False)),
        aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)),
    )
    return {
        **qwen3.HF.read(config, source),
        "moe": moe,
        "decoder_sparse_step": int(config.get("decoder_sparse_step", 1)),
        "mlp_only_layers": tuple(config.get("mlp_only_layers") or ()),
    }


def _write(args: Qwen3MoeModelArgs) -> dict[str, Any]:
    moe = args.moe
    assert moe is not None  # to_hf_config refused it first
    return {
        **qwen3.HF.write(args),
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.hidden_dim,
        "norm_topk_prob": moe.route_norm,
        "decoder_sparse_step": args.decoder_sparse_step,
        "mlp_only_layers": list(args.mlp_only_layers),
        "router_aux_loss_coef": moe.aux_loss_coef,
        "output_router_logits": False,
    }


HF = dataclasses.replace(
    qwen3.HF,
    architectures=("Qwen3MoeForCausalLM",),
    model_type="qwen3_moe",
    name="Qwen3-MoE",
    args_cls=Qwen3MoeModelArgs,
    refuse=_refuse,
    read=_read,
    write=_write,
    refuse_export=_refuse_unexportable,
)
to_hf, from_hf = HF.to_hf, HF.from_hf
to_hf_config, from_hf_config = HF.to_hf_config, HF.from_hf_config
