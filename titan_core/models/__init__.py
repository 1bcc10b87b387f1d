"""Model registry: a family's name maps to its ``ModelSpec`` (``models.protocol``).

Built-in families are imported on first use from the table below; other packages register
theirs with ``register_model_spec(spec)`` in-process, or for every process (torchrun ranks
included) through an entry point in the ``titan.models`` group whose object is a ``ModelSpec``
or a module exposing ``MODEL_SPEC``. Nothing here imports a family at import time.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import types
import typing
from importlib.metadata import entry_points
from types import ModuleType
from typing import Any

from titan_core.errors import CheckpointError, ConfigError
from titan_core.models.protocol import (
    HFAdapter,
    ModelSpec,
    StateDict,
    decoder_spec,
    labels_ahead_depth,
)

ENTRY_POINT_GROUP = "titan.models"
CHECKPOINT_FLAVOR = "checkpoint"
"""Reserved ``model.flavor``: the exact model that ``checkpoint.initial_load_path`` describes."""
_BUILTIN = {
    "llama3": "titan_core.models.llama3",
    "qwen3": "titan_core.models.qwen3",
    "qwen3_moe": "titan_core.models.qwen3_moe",
    "deepseek_v3": "titan_core.models.deepseek_v3",
}
_MODEL_SPECS: dict[str, ModelSpec] = {}


def register_model_spec(spec: ModelSpec) -> None:
    """Add ``spec`` to the registry under ``spec.name``; names must be unique."""
    if spec.name in _MODEL_SPECS and _MODEL_SPECS[spec.name] is not spec:
        raise ValueError(f"model {spec.name!r} is already registered")
    if CHECKPOINT_FLAVOR in spec.flavors:
        raise ValueError(f"model {spec.name!r}: flavor name {CHECKPOINT_FLAVOR!r} is reserved")
    _MODEL_SPECS[spec.name] = spec


def unregister_model_spec(name: str) -> None:
    """Forget a spec added with ``register_model_spec`` (tests, notebooks); a built-in or
    entry-point family is simply loaded again on next use."""
    _MODEL_SPECS.pop(name, None)


def _plugins() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def family_names() -> list[str]:
    """Every family this process can build: built in, registered, or installed as a plugin."""
    return sorted({*_BUILTIN, *_MODEL_SPECS, *_plugins()})


def _spec_of(obj: Any, where: str) -> ModelSpec:
    spec = getattr(obj, "MODEL_SPEC", None) if isinstance(obj, ModuleType) else obj
    if not isinstance(spec, ModelSpec):
        raise ConfigError(f"model.name: {where} provides no ModelSpec (MODEL_SPEC)")
    return spec


def get_model_spec(name: str) -> ModelSpec:
    """The spec of family ``name``; ConfigError naming ``model.name`` otherwise."""
    if name not in _MODEL_SPECS:
        if name in _BUILTIN:
            spec = _spec_of(importlib.import_module(_BUILTIN[name]), _BUILTIN[name])
        elif name in (plugins := _plugins()):
            spec = _spec_of(plugins[name].load(), f"entry point {plugins[name].value}")
        else:
            raise ConfigError(f"model.name: expected one of {family_names()}, got {name!r}")
        register_model_spec(spec)
    return _MODEL_SPECS[name]


def get_flavor(name: str, flavor: str) -> Any:
    """A private copy of the model args of ``flavor`` (callers may override fields freely)."""
    flavors = get_model_spec(name).flavors
    if flavor not in flavors:
        owners = [f for f in family_names() if f != name and flavor in _flavors_or_empty(f)]
        where = f" ({flavor!r} is a flavor of {', '.join(owners)})" if owners else ""
        raise ConfigError(
            f"model.flavor: expected one of {list(flavors)} for model.name {name!r}, "
            f"got {flavor!r}{where}"
        )
    return copy.deepcopy(flavors[flavor])


def _flavors_or_empty(name: str) -> Any:
    spec = _spec_or_none(name)
    return spec.flavors if spec is not None else {}


def spec_for_args(model_args: Any) -> ModelSpec:
    """The family whose ``args_cls`` is exactly the type of ``model_args``."""
    specs = [s for n in family_names() if (s := _spec_or_none(n)) is not None]
    found = [s for s in specs if type(model_args) is s.args_cls]
    if len(found) != 1:
        what = "no family" if not found else f"families {[s.name for s in found]}"
        raise ConfigError(
            f"model.name: {what} use model args of type {type(model_args).__name__}; "
            "name the family explicitly"
        )
    return found[0]


def _spec_or_none(name: str) -> ModelSpec | None:
    try:
        return get_model_spec(name)
    except (ConfigError, ImportError):
        return None


def spec_for_hf_config(config: dict[str, Any], source: str) -> ModelSpec:
    """The family that reads an HF ``config.json`` (by ``architectures``, else ``model_type``);
    CheckpointError naming what was found and what is supported."""
    specs = [s for n in family_names() if (s := _spec_or_none(n)) is not None]
    found = config.get("architectures") or []
    for spec in specs:
        if any(a in spec.hf.architectures for a in found):
            return spec
    if not found:
        for spec in specs:
            if config.get("model_type") == spec.hf.model_type:
                return spec
    supported = ", ".join(f"{a} ({s.name})" for s in specs for a in s.hf.architectures)
    what = f"architectures {found}" if found else f"model_type {config.get('model_type')!r}"
    raise CheckpointError(f"hf: {source}: {what} is not supported; supported: {supported}")


def describe_model(name: str, args: Any) -> dict[str, Any]:
    """A JSON-able description of a model: its family and exact args (checkpoint markers)."""
    return {"name": name, "args": dataclasses.asdict(args)}


def model_from_description(description: Any, source: str) -> tuple[str, Any]:
    """(family, args) of a ``describe_model`` result; CheckpointError naming ``source`` when it
    names no known family or has fields the family's args do not."""
    if not isinstance(description, dict) or not isinstance(description.get("args"), dict):
        raise CheckpointError(f"{source}: the model description is not a {{name, args}} object")
    name = description.get("name")
    try:
        spec = get_model_spec(str(name))
    except (ConfigError, ImportError) as e:
        raise CheckpointError(f"{source}: model family {name!r} is not available ({e})") from None
    return spec.name, _dataclass_from(spec.args_cls, description["args"], source)


def _dataclass_from(cls: type, values: dict[str, Any], source: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise CheckpointError(
            f"{source}: the model description has {unknown[0]!r}, not a field of "
            f"{cls.__name__} (written by a newer or different model family?)"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {k: _value_of(hints[k], v, source) for k, v in values.items() if fields[k].init}
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: the model description does not fit: {e}") from None
    for k, v in values.items():
        if not fields[k].init:
            setattr(obj, k, _value_of(hints[k], v, source))
    return obj


def _value_of(tp: Any, value: Any, source: str) -> Any:
    """``value`` (JSON) as type ``tp``: nested dataclasses rebuilt, lists back to tuples."""
    is_union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    options = typing.get_args(tp) if is_union else (tp,)
    if isinstance(value, dict):
        for option in options:
            if dataclasses.is_dataclass(option):
                return _dataclass_from(option, value, source)  # type: ignore[arg-type]
    if isinstance(value, list) and any(typing.get_origin(o) is tuple for o in options):
        return tuple(value)
    return value


__all__ = [
    "CHECKPOINT_FLAVOR",
    "ENTRY_POINT_GROUP",
    "HFAdapter",
    "ModelSpec",
    "StateDict",
    "decoder_spec",
    "describe_model",
    "family_names",
    "get_flavor",
    "get_model_spec",
    "labels_ahead_depth",
    "model_from_description",
    "register_model_spec",
    "spec_for_args",
    "spec_for_hf_config",
    "unregister_model_spec",
]
