"""Convert DeepSeek-V3 weights between this engine's names and Hugging Face
``DeepseekV3ForCausalLM`` (DeepSeek-V3, Moonlight, Kimi K2 checkpoints).

Names: MLA's ``attention.{wq | wq_a, q_norm, wq_b}``, ``wkv_a``, ``kv_norm``, ``wkv_b``, ``wo``
are HF's ``self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}``, ``kv_a_proj_with_mqa``,
``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``; the router's ``gate.weight`` and the expert
bias are ``mlp.gate.weight`` / ``mlp.gate.e_score_correction_bias``; stacked experts are one
``mlp.experts.{e}.*`` tensor per expert (``models.common.hf``); shared experts are
``mlp.shared_experts.*``. The MTP blocks ``layers.<n_layers + d>`` keep the published names
(``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and a decoder layer's); the copies of
the embedding and output head the published MTP layer carries (``embed_tokens``,
``shared_head.head``) are the main model's own: read and dropped, not written.

RoPE: the engine rotates interleaved pairs, as HF does with ``rope_interleave`` (DeepSeek's
default), so nothing is permuted; with ``rope_interleave`` false the RoPE rows of the query
and of ``kv_a_proj_with_mqa`` are permuted to and from HF's halves. Checkpoints published in
FP8 with 128 x 128 block scales are dequantized on the way in (``models.common.hf_fp8``).

Checking a folder (``check_hf_weights``) accepts what ``from_hf`` reads beyond ``to_hf``'s
names (``_extra_tensors``: the scales, the MTP copies, layers past the MTP depth) and a folder
without its MTP layers (``_optional_part``): transformers saves none, though its config keeps
``num_nextn_predict_layers``; they then start from the model's initialization.

The ``config.json`` keys every decoder shares, ``architectures`` / ``model_type`` and YaRN are
``models.common.family``'s; ``HF`` adds the latent-attention, routing and MTP keys.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from titan_core.errors import CheckpointError
from titan_core.models.common.family import DecoderHF
from titan_core.models.common.hf import (
    experts_from_hf,
    experts_to_hf,
    require_keys,
    to_interleaved,
    to_rotate_half,
)
from titan_core.models.common.hf_fp8 import dequantize_fp8_blocks, scale_shapes
from titan_core.models.common.moe import MoEArgs
from titan_core.models.deepseek_v3.model import DeepseekV3ModelArgs

_FAMILY = "DeepSeek-V3"

# Native -> HF names inside ``layers.<i>`` / ``model.layers.<i>``.
_LAYER_KEYS = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "mtp_input.enorm.weight": "enorm.weight",
    "mtp_input.hnorm.weight": "hnorm.weight",
    "mtp_input.eh_proj.weight": "eh_proj.weight",
    "head_norm.weight": "shared_head.norm.weight",
}
_FROM_LAYER = {hf: native for native, hf in _LAYER_KEYS.items()}
_EXPERTS = {
    f"moe.experts.{w}": f"model.layers.{{}}.mlp.experts.{{e}}.{proj}.weight"
    for w, proj in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
}
_TOP_KEYS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_FROM_TOP = {hf: native for native, hf in _TOP_KEYS.items()}
# Copies of the embedding and head in a published MTP layer: the main model's, dropped.
_MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")
_NATIVE_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _permute_rope(
    w: torch.Tensor, rest: str, args: DeepseekV3ModelArgs, fn: Callable
) -> torch.Tensor:
    """``w`` with the RoPE rows of each head (queries) or of the shared key reordered by
    ``fn`` (``to_rotate_half`` / ``to_interleaved``); other tensors unchanged."""
    nope, rope = args.qk_nope_head_dim, args.qk_rope_head_dim
    if rest in ("attention.wq.weight", "attention.wq_b.weight"):
        heads = w.view(args.n_heads, nope + rope, *w.shape[1:])
        rotated = fn(heads[:, nope:].reshape(args.n_heads * rope, *w.shape[1:]), args.n_heads)
        rotated = rotated.view(args.n_heads, rope, *w.shape[1:])
        return torch.cat([heads[:, :nope], rotated], dim=1).reshape(w.shape)
    if rest == "attention.wkv_a.weight":
        return torch.cat([w[: args.kv_lora_rank], fn(w[args.kv_lora_rank :], 1)], dim=0)
    return w


def _tensors_to_hf(
    state_dict: dict[str, torch.Tensor], args: DeepseekV3ModelArgs
) -> dict[str, torch.Tensor]:
    """Native state dict (whole or any subset) -> HF ``DeepseekV3ForCausalLM`` state dict."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key == "output.weight" and args.tie_word_embeddings:
            continue
        match = _NATIVE_RE.match(key)
        if match is None:
            if key not in _TOP_KEYS:
                raise CheckpointError(f"to_hf: unexpected {_FAMILY} state dict key {key!r}")
            out[_TOP_KEYS[key]] = value
            continue
        layer, rest = match.groups()
        if rest in _EXPERTS:
            out.update(experts_to_hf(value, _EXPERTS[rest], layer))
        elif rest in _LAYER_KEYS:
            if not args.rope_interleave:
                value = _permute_rope(value, rest, args, to_rotate_half)
            out[f"model.layers.{layer}.{_LAYER_KEYS[rest]}"] = value
        else:
            raise CheckpointError(f"to_hf: unexpected {_FAMILY} state dict key {key!r}")
    return out


def _tensors_from_hf(
    hf_state_dict: dict[str, torch.Tensor], args: DeepseekV3ModelArgs
) -> dict[str, torch.Tensor]:
    """HF ``DeepseekV3ForCausalLM`` state dict (per-expert tensors or transformers' fused
    in-memory ones, FP8 block-scaled or not) -> native one; each MoE layer's experts must all
    be present. Layers past the model's MTP depth are ignored, as transformers ignores them."""
    hf_state_dict = dequantize_fp8_blocks(hf_state_dict, _FAMILY)
    blocks = args.n_layers + args.mtp_layers
    kept = {}
    for key, value in hf_state_dict.items():
        match = _HF_RE.match(key)
        if match is not None and (
            int(match[1]) >= blocks or (int(match[1]) >= args.n_layers and match[2] in _MTP_SHARED)
        ):
            continue
        kept[key] = value
    num_experts = args.moe.num_experts if args.moe is not None else 0
    rest, out = experts_from_hf(kept, num_experts, _FAMILY) if num_experts else (kept, {})
    for key, value in rest.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue
        if key == "lm_head.weight" and args.tie_word_embeddings:
            continue
        match = _HF_RE.match(key)
        if match is None:
            if key not in _FROM_TOP:
                raise CheckpointError(f"from_hf: unexpected Hugging Face {_FAMILY} key {key!r}")
            out[_FROM_TOP[key]] = value
            continue
        layer, hf_rest = match.groups()
        native = _FROM_LAYER.get(hf_rest)
        if native is None:
            raise CheckpointError(f"from_hf: unexpected Hugging Face {_FAMILY} key {key!r}")
        if not args.rope_interleave:
            value = _permute_rope(value, native, args, to_interleaved)
        out[f"layers.{layer}.{native}"] = value
    if args.tie_word_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def _refuse_unexportable(args: DeepseekV3ModelArgs, what: str) -> MoEArgs:
    """The model's MoEArgs; CheckpointError naming what ``DeepseekV3ForCausalLM`` cannot hold."""
    moe = args.moe
    if moe is None:
        raise CheckpointError(f"{what}: a {_FAMILY} model without experts (model.moe None)")
    unsupported = [
        name
        for name, present in (
            (f"{moe.score_func} router scores", moe.score_func != "sigmoid"),
            ("no shared expert", moe.num_shared_experts < 1),
            ("a router without the expert bias", not moe.load_balance_bias),
            (
                "a shared-expert width apart from num_shared_experts x hidden_dim",
                moe.shared_hidden_dim not in (0, moe.num_shared_experts * moe.hidden_dim),
            ),
        )
        if present
    ]
    if unsupported:
        raise CheckpointError(
            f"{what}: DeepseekV3ForCausalLM cannot represent {', '.join(unsupported)}"
        )
    return moe


def _extra_tensors(
    found: Mapping[str, tuple[int, ...]],
    expected: Mapping[str, tuple[int, ...]],
    args: DeepseekV3ModelArgs,
) -> dict[str, tuple[int, ...]]:
    """What ``from_hf`` reads beyond ``to_hf``'s names, with the shape each must have: the
    published MTP layers' copies of the embedding and head and the layers past the model's MTP
    depth (dropped), and the FP8 block scales of any of these (dequantized)."""
    dropped: dict[str, tuple[int, ...]] = {}
    for name, shape in found.items():
        match = _HF_RE.match(name)
        if match is None or name in expected:
            continue
        if int(match[1]) >= args.n_layers + args.mtp_layers:
            dropped[name] = shape  # transformers ignores them too
        elif int(match[1]) >= args.n_layers and match[2] in _MTP_SHARED:
            dropped[name] = (args.vocab_size, args.dim)
    return {**dropped, **scale_shapes(found, {**expected, **dropped})}


def _optional_part(name: str, args: DeepseekV3ModelArgs) -> str | None:
    """An MTP layer: ``save_pretrained`` drops it (``DeepseekV3ForCausalLM`` has no MTP)."""
    match = _HF_RE.match(name)
    if match is None or int(match[1]) < args.n_layers:
        return None
    return f"multi-token prediction layer model.layers.{match[1]} (transformers saves none)"


def _write(args: DeepseekV3ModelArgs) -> dict[str, Any]:
    """``DeepseekV3Config``'s own keys: latent attention, routing, MTP depth."""
    moe = args.moe
    assert moe is not None  # to_hf_config refused it first
    return {
        "moe_intermediate_size": moe.hidden_dim,
        "n_shared_experts": moe.num_shared_experts,
        "n_routed_experts": moe.num_experts,
        "routed_scaling_factor": moe.route_scale,
        "kv_lora_rank": args.kv_lora_rank,
        "q_lora_rank": args.q_lora_rank or None,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "v_head_dim": args.v_head_dim,
        "n_group": moe.num_groups,
        "topk_group": moe.top_groups,
        "num_experts_per_tok": moe.top_k,
        "first_k_dense_replace": args.first_k_dense_replace,
        "norm_topk_prob": moe.route_norm,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "rope_interleave": args.rope_interleave,
        "num_nextn_predict_layers": args.mtp_layers,
    }


def _refuse(config: dict[str, Any], source: str) -> dict[str, Any]:
    """One CheckpointError line for what is not computed here; aliases resolved."""
    if "n_routed_experts" not in config and "num_local_experts" in config:
        config = {**config, "n_routed_experts": config["num_local_experts"]}
    if "num_nextn_predict_layers" not in config and "num_mtp_layers" in config:
        config = {**config, "num_nextn_predict_layers": config["num_mtp_layers"]}
    require_keys(
        config,
        source,
        ("moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "kv_lora_rank",
         "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
    )  # fmt: skip
    for key, expected in (("hidden_act", "silu"), ("scoring_func", "sigmoid"),
                          ("topk_method", "noaux_tc")):  # fmt: skip
        if config.get(key, expected) != expected:
            raise CheckpointError(
                f"hf: {source}: {key} {config[key]!r} is not supported ({expected})"
            )
    if config.get("moe_layer_freq", 1) != 1:
        raise CheckpointError(f"hf: {source}: moe_layer_freq {config['moe_layer_freq']} (1)")
    heads = config.get("num_attention_heads")
    if heads is not None and config.get("num_key_value_heads", heads) != heads:
        raise CheckpointError(
            f"hf: {source}: num_key_value_heads {config['num_key_value_heads']} differs from "
            f"num_attention_heads {heads} (MLA has no kv groups)"
        )
    experts, groups = config["n_routed_experts"], config.get("n_group") or 1
    top_groups, top_k = config.get("topk_group") or 1, config["num_experts_per_tok"]
    if not 1 <= top_groups <= groups:
        raise CheckpointError(
            f"hf: {source}: topk_group {top_groups} must be between 1 and n_group {groups}"
        )
    if experts % groups:
        raise CheckpointError(
            f"hf: {source}: n_routed_experts {experts} is not divisible by n_group {groups}"
        )
    if not 1 <= top_k <= experts // groups * top_groups:
        raise CheckpointError(
            f"hf: {source}: num_experts_per_tok {top_k} must be between 1 and the "
            f"{experts // groups * top_groups} experts of topk_group {top_groups} groups"
        )
    return config


def _read(config: dict[str, Any], source: str) -> dict[str, Any]:
    """DeepSeek-V3's own args fields (the shared ones are ``DecoderHF``'s)."""
    moe = MoEArgs(
        num_experts=config["n_routed_experts"],
        top_k=config["num_experts_per_tok"],
        hidden_dim=config["moe_intermediate_size"],
        score_func="sigmoid",
        route_norm=bool(config.get("norm_topk_prob", True)),
        route_scale=float(config.get("routed_scaling_factor", 1.0)),
        num_shared_experts=int(config.get("n_shared_experts") or 1),
        aux_loss_coef=0.0,
        load_balance_bias=True,
        num_groups=int(config.get("n_group") or 1),
        top_groups=int(config.get("topk_group") or 1),
    )
    return {
        "n_kv_heads": None,  # MLA: every head has its keys and values
        "moe": moe,
        "hidden_dim": config["intermediate_size"],
        "q_lora_rank": int(config.get("q_lora_rank") or 0),
        "kv_lora_rank": config["kv_lora_rank"],
        "qk_nope_head_dim": config["qk_nope_head_dim"],
        "qk_rope_head_dim": config["qk_rope_head_dim"],
        "v_head_dim": config["v_head_dim"],
        "first_k_dense_replace": int(config.get("first_k_dense_replace") or 0),
        "mtp_layers": int(config.get("num_nextn_predict_layers") or 0),
        "rope_interleave": bool(config.get("rope_interleave", True)),
    }


HF = DecoderHF(
    architectures=("DeepseekV3ForCausalLM",),
    model_type="deepseek_v3",
    name=_FAMILY,
    args_cls=DeepseekV3ModelArgs,
    defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 4096},
    refuse=_refuse,
    read=_read,
    write=_write,
    refuse_export=_refuse_unexportable,
    rope_types=("default", "yarn"),
    tensors=(_tensors_to_hf, _tensors_from_hf),
    extra_tensors=_extra_tensors,
    optional_part=_optional_part,
)
to_hf, from_hf = HF.to_hf, HF.from_hf
to_hf_config, from_hf_config = HF.to_hf_config, HF.from_hf_config
