"""Model registry: a model family's name maps to its module class, flavors and converters."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from titan_core.errors import ConfigError
from titan_core.models import llama3

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ModelSpec:
    """Everything the trainer needs to build, size and convert one model family."""

    name: str
    model_cls: type[nn.Module]
    args_cls: type
    flavors: dict[str, Any]
    to_hf: Callable[[StateDict, Any], StateDict]
    from_hf: Callable[[StateDict, Any], StateDict]
    to_hf_config: Callable[[Any], dict[str, Any]]


_MODEL_SPECS: dict[str, ModelSpec] = {}


def register_model_spec(spec: ModelSpec) -> None:
    """Add ``spec`` to the registry under ``spec.name``; names must be unique."""
    if spec.name in _MODEL_SPECS:
        raise ValueError(f"model {spec.name!r} is already registered")
    _MODEL_SPECS[spec.name] = spec


def get_model_spec(name: str) -> ModelSpec:
    """The registered spec called ``name``; ConfigError naming ``model.name`` otherwise."""
    if name not in _MODEL_SPECS:
        raise ConfigError(f"model.name: expected one of {sorted(_MODEL_SPECS)}, got {name!r}")
    return _MODEL_SPECS[name]


def get_flavor(name: str, flavor: str) -> Any:
    """A private copy of the model args of ``flavor`` (callers may override fields freely)."""
    flavors = get_model_spec(name).flavors
    if flavor not in flavors:
        raise ConfigError(f"model.flavor: expected one of {list(flavors)}, got {flavor!r}")
    return copy.deepcopy(flavors[flavor])


register_model_spec(
    ModelSpec(
        name="llama3",
        model_cls=llama3.Transformer,
        args_cls=llama3.TransformerModelArgs,
        flavors=llama3.llama3_flavors,
        to_hf=llama3.to_hf,
        from_hf=llama3.from_hf,
        to_hf_config=llama3.to_hf_config,
    )
)

__all__ = ["ModelSpec", "get_flavor", "get_model_spec", "register_model_spec"]
