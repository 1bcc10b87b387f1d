"""What a Llama-like decoder family registers, less what all of them share.

A family gives its Hugging Face differences as a ``DecoderHF`` (class names, the config.json keys
and refusals it adds, the args fields it reads) and gets its ``HFAdapter`` from it; the tensor
names and RoPE permutations are ``models.common.hf``'s, chosen by the args (QK-norm, experts),
unless the family maps its own (DeepSeek-V3's latent attention).
``decoder_family`` then makes the ``ModelSpec`` of a family package from its model, flavors and
``DecoderHF``, so a family's ``__init__`` is one call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from titan_core.errors import CheckpointError
from titan_core.models.common.hf import (
    decoder_from_hf,
    decoder_to_hf,
    refuse_biases,
    require_keys,
    rope_from_config,
    rope_parameters,
)
from titan_core.models.protocol import (
    HFAdapter,
    ModelSpec,
    Shapes,
    StateDict,
    decoder_spec,
    no_extra_tensors,
    no_optional_part,
)

Config = dict[str, Any]
TensorMap = Callable[[StateDict, Any], StateDict]

# config.json keys every family needs, in the order a missing one is named; ``head_dim`` only
# where the args hold it as a field (Llama derives it, and then checks it).
_REQUIRED = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "vocab_size",
)


def decoder_config(args: Any) -> Config:
    """The ``config.json`` keys every Llama-like decoder writes, from its ``DecoderArgs``."""
    return {
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
    }


def _keep(config: Config, source: str) -> Config:
    return config


def _nothing(*_: Any) -> Config:
    return {}


@dataclass(frozen=True)
class DecoderHF:
    """A decoder family's Hugging Face conversion: what it adds to the shared one.

    Reading a ``config.json`` checks ``architectures`` and ``model_type``, calls ``refuse``,
    refuses biases, requires the shared keys (``head_dim`` too where it is an args field; a
    derived one must agree), reads RoPE, calls ``read`` (whose fields win over the shared ones)
    and builds ``args_cls``: each refusal one CheckpointError line naming the file."""

    architectures: tuple[str, ...]
    """``config.json`` ``architectures`` values this family reads (and writes)."""
    model_type: str
    """``config.json`` ``model_type``."""
    name: str
    """The family in conversion errors (``unexpected Qwen3 state dict key``)."""
    args_cls: type
    """The model args a ``config.json`` becomes."""
    defaults: Mapping[str, Any]
    """``rms_norm_eps`` and ``max_position_embeddings`` when ``config.json`` lacks them."""
    hf_name: str | None = None
    """The model as Hugging Face names it, in errors about HF keys; ``name`` when None."""
    refuse: Callable[[Config, str], Config] = _keep
    """Refuses what the family cannot compute before any key is read; gives back the config
    to read (aliases resolved)."""
    read: Callable[[Config, str], Config] = _nothing
    """The family's own args fields from a ``config.json`` that has the shared keys."""
    write: Callable[[Any], Config] = _nothing
    """The family's own ``config.json`` keys, written after the shared ones."""
    refuse_export: Callable[[Any, str], object] | None = None
    """Refuses args that the HF class cannot hold (``what``: to_hf or to_hf_config)."""
    rope_types: tuple[str, ...] = ("default", "llama3")
    """The ``rope_type`` values the model computes (``common.hf.rope_from_config``)."""
    tensors: tuple[TensorMap, TensorMap] | None = None
    """The family's own (to_hf, from_hf) tensor maps, where its names are not Llama's; None:
    ``common.hf.decoder_to_hf`` / ``decoder_from_hf``."""
    extra_tensors: Callable[[Shapes, Shapes, Any], dict[str, tuple[int, ...]]] = no_extra_tensors
    """``HFAdapter.extra_tensors``: what a folder may hold beyond ``to_hf``'s names."""
    optional_part: Callable[[str, Any], str | None] = no_optional_part
    """``HFAdapter.optional_part``: the parts of the model a folder may lack whole."""

    def to_hf(self, state_dict: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
        """Native state dict (whole or any subset) -> HF one (``lm_head`` left out when tied)."""
        if self.refuse_export is not None:
            self.refuse_export(args, "to_hf")
        if self.tensors is not None:
            return self.tensors[0](state_dict, args)
        return decoder_to_hf(state_dict, args, self.name)

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
        """HF state dict -> native one, with ``output.weight`` shared when tied."""
        if self.tensors is not None:
            return self.tensors[1](hf_state_dict, args)
        return decoder_from_hf(hf_state_dict, args, self.hf_name or self.name)

    def to_hf_config(self, args: Any) -> Config:
        """``config.json`` content describing the model of ``args``."""
        if self.refuse_export is not None:
            self.refuse_export(args, "to_hf_config")
        return {
            "architectures": list(self.architectures),
            "model_type": self.model_type,
            **decoder_config(args),
            **self.write(args),
        }

    def from_hf_config(self, config: Config, source: str) -> Any:
        """The model args describing the model of an HF ``config.json``."""
        found = config.get("architectures") or []
        if found and not set(found) & set(self.architectures):
            raise CheckpointError(
                f"hf: {source}: architectures {found} is not {self.architectures[0]} ({self.name})"
            )
        if config.get("model_type", self.model_type) != self.model_type:
            raise CheckpointError(
                f"hf: {source}: model_type {config['model_type']!r}, expected {self.model_type!r}"
            )
        config = self.refuse(config, source)
        refuse_biases(config, source)
        own_head_dim = "head_dim" in {f.name for f in dataclasses.fields(self.args_cls)}
        require_keys(config, source, tuple(k for k in _REQUIRED if own_head_dim or k != "head_dim"))
        n_heads = config["num_attention_heads"]
        theta, scaling = rope_from_config(config, source, self.rope_types)
        fields = {
            "dim": config["hidden_size"],
            "n_layers": config["num_hidden_layers"],
            "n_heads": n_heads,
            "n_kv_heads": config.get("num_key_value_heads", n_heads),
            "vocab_size": config["vocab_size"],
            "norm_eps": float(config.get("rms_norm_eps", self.defaults["rms_norm_eps"])),
            "rope_theta": theta,
            "rope_scaling": scaling,
            "max_seq_len": int(
                config.get("max_position_embeddings", self.defaults["max_position_embeddings"])
            ),
            "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
            **({"head_dim": config["head_dim"]} if own_head_dim else {}),
            **self.read(config, source),
        }
        args = self.args_cls(**fields)
        if not own_head_dim and config.get("head_dim", args.head_dim) != args.head_dim:
            raise CheckpointError(
                f"hf: {source}: head_dim {config['head_dim']} is not the model's "
                f"({args.head_dim}: hidden_size / num_attention_heads, or as the family derives it)"
            )
        return args

    def adapter(self) -> HFAdapter:
        """The ``HFAdapter`` the family's ``ModelSpec`` carries."""
        return HFAdapter(
            architectures=self.architectures,
            model_type=self.model_type,
            to_hf=self.to_hf,
            from_hf=self.from_hf,
            to_hf_config=self.to_hf_config,
            from_hf_config=self.from_hf_config,
            extra_tensors=self.extra_tensors,
            optional_part=self.optional_part,
        )


def decoder_family(
    package: str,
    model_cls: type[nn.Module],
    flavors: Mapping[str, Any],
    hf: DecoderHF,
    description: str,
    *,
    tp_plan: Callable[..., Any] | None = None,
    check: Callable[..., None] | None = None,
) -> ModelSpec:
    """The spec of the decoder family in ``package`` (its ``__name__``): named after the package,
    recipes in its ``config_registry`` module, args ``hf.args_cls``. ``tp_plan`` replaces the
    shared TP plan, ``check`` the shared decoder checks (a family refusing what it has no plan
    for)."""
    spec = decoder_spec(
        name=package.rpartition(".")[2],
        model_cls=model_cls,
        args_cls=hf.args_cls,
        flavors=flavors,
        hf=hf.adapter(),
        config_registry=f"{package}.config_registry",
        description=description,
        tp_plan=tp_plan,
    )
    return spec if check is None else dataclasses.replace(spec, check=check)
