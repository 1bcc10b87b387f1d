"""The config schema as data: what each dotted key accepts, and values checked against it.

Every door into a ``JobConfig`` (CLI flags, TOML files, flow parameters and forms, sweeps) reads
keys through this module, so a bad key or value is the same one-line ``ConfigError`` whichever
door it came in. It knows no model, no checkpoint and no command: recipes and the resolver that
layers them sit above ``models/`` (``titan_core.resolve``).

- ``schema(JobConfig)``: every dotted key (``training.steps``, ``launch.slurm.partition``) to its
  ``Spec`` (bool, int, float, str, a choice of literals, or a list of one of those);
- ``typed_values`` / ``from_value`` / ``from_text``: values checked and converted;
- ``did_you_mean`` / ``moved_key``: suggestions, and the keys that moved (``RENAMED_KEYS``);
- ``with_values`` / ``apply_values`` / ``validate``: a config with values set, validated;
- ``to_dict`` / ``to_toml`` / ``flatten``: the config as tables, TOML text, dotted scalars.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import tomli_w

from titan_core.config.job import JobConfig, UsedIn
from titan_core.errors import ConfigError

Scalar = bool | int | float | str

# Floats must be finite: no setting means anything at inf or NaN (0 or -1 switch things off).
_WORDS = {"bool": "true or false", "int": "an int", "float": "a finite float", "str": "a string"}
# The largest finite and the smallest normal magnitude of each dtype a float setting may be used
# in (``UsedIn``): above the first it is inf there, below the second it may be flushed to 0 (an
# eps of 0 divides 0 by 0).
DTYPE_RANGE = {
    "float32": (3.4028234663852886e38, 1.1754943508222875e-38),
    "bfloat16": (3.3895313892515355e38, 1.1754943508222875e-38),
    "float16": (65504.0, 6.103515625e-05),
}


@dataclass(frozen=True)
class Spec:
    """What one config field accepts, derived from its type hint."""

    kind: Literal["bool", "int", "float", "str", "choice", "list"]
    choices: tuple[Any, ...] = ()
    item: Spec | None = None
    dtype: str = ""
    """A float's dtype on the device (``UsedIn``): its values must be ones that dtype holds."""

    def describe(self, value: Any = None) -> str:
        """Human words for the accepted values, used in error messages; for a finite number
        ``value`` that this float's dtype cannot hold, the words say why."""
        if self.dtype and _is_number(value) and math.isfinite(value):
            largest, smallest = DTYPE_RANGE[self.dtype]
            return (
                f"a float that {self.dtype} holds (0 or a magnitude from {smallest:.4g} to "
                f"{largest:.4g}: it is used in {self.dtype} arithmetic)"
            )
        if self.kind == "choice":
            return "one of " + ", ".join(repr(c) for c in self.choices)
        if self.kind == "list":
            assert self.item is not None
            return f"a list of values, each {self.item.describe()}"
        return _WORDS[self.kind]


def spec_of(tp: Any) -> Spec:
    """The ``Spec`` of a field's type hint (``Annotated[float, UsedIn(dtype)]``: a float
    checked against ``dtype``)."""
    if typing.get_origin(tp) is typing.Annotated:
        base, *marks = typing.get_args(tp)
        used_in = [m.dtype for m in marks if isinstance(m, UsedIn)]
        spec = spec_of(base)
        assert spec.kind == "float" or not used_in, f"UsedIn marks floats, not {base!r}"
        return dataclasses.replace(spec, dtype=used_in[0]) if used_in else spec
    if typing.get_origin(tp) is Literal:
        return Spec("choice", choices=typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return Spec("list", item=spec_of(typing.get_args(tp)[0]))
    if tp in (bool, int, float, str):
        return Spec(tp.__name__)
    raise AssertionError(f"config fields must be bool/int/float/str/Literal/list, not {tp!r}")


@functools.cache
def schema(cls: type = JobConfig) -> dict[str, Spec]:
    """Map the dotted key of every field of every section of ``cls`` to its spec:
    ``section.field``, and ``section.sub.field`` inside a nested section (``launch.slurm``)."""
    section_hints = typing.get_type_hints(cls)
    for section in dataclasses.fields(cls):
        assert dataclasses.is_dataclass(section_hints[section.name]), f"{section.name}: no section"
    return field_specs(cls)


def field_specs(cls: type, prefix: str = "") -> dict[str, Spec]:
    """The spec of every field of the dataclass ``cls`` by (dotted, ``prefix``-ed) name; the
    fields of a nested dataclass as ``name.field``. Also describes a command's own options."""
    out: dict[str, Spec] = {}
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out |= field_specs(hints[f.name], f"{prefix}{f.name}.")
        else:
            out[prefix + f.name] = spec_of(hints[f.name])
    return out


@functools.cache
def sections(cls: type = JobConfig) -> frozenset[str]:
    """The dotted paths of the sections of ``cls``, nested ones included (``launch.slurm``)."""
    return frozenset(key.rpartition(".")[0] for key in schema(cls))


# Keys renamed into another section, with why: the CLI, flow parameters and forms refuse the old
# spelling in one line naming the new key; an old TOML file is read with it as the new key.
_DATALOADER = "data-loader settings have their own [dataloader] section"
RENAMED_KEYS = {
    "storage.root": ("job.dump_folder", "the one output root"),
    "training.dataset": ("dataloader.dataset", _DATALOADER),
    "training.dataset_path": ("dataloader.path", _DATALOADER),
    "training.dataset_split": ("dataloader.split", _DATALOADER),
    "training.dataset_text_field": ("dataloader.text_field", _DATALOADER),
    "training.dataset_streaming": ("dataloader.streaming", _DATALOADER),
    "training.data_streams": ("dataloader.streams", _DATALOADER),
    "training.dataset_mix": ("dataloader.mix", _DATALOADER),
    "training.dataset_shuffle": ("dataloader.shuffle", _DATALOADER),
    "training.dataset_seed": ("dataloader.seed", _DATALOADER),
    "training.dataset_verify": ("dataloader.verify", _DATALOADER),
    "training.dataset_prefetch": ("dataloader.prefetch", _DATALOADER),
    "training.dataset_cache_mb": ("dataloader.cache_mb", _DATALOADER),
    "training.document_masking": ("dataloader.document_masking", _DATALOADER),
}


def _flat_spellings(specs: dict[str, Spec]) -> dict[str, str]:
    """Keys of nested sections as they were spelled before nesting (``launch.slurm_partition``,
    ``launch.no_slurm_flag``) mapped to the key now (``launch.slurm.partition``)."""
    out: dict[str, str] = {}
    for key, spec in specs.items():
        section, *path = key.split(".")
        if len(path) > 1:
            out[f"{section}.{'_'.join(path)}"] = key
            if spec.kind == "bool":
                out[f"{section}.no_{'_'.join(path)}"] = negated(key)
    return out


def moved_key(key: str, specs: dict[str, Spec]) -> str | None:
    """The key that the old ``key`` is now: ``launch.slurm_partition`` is
    ``launch.slurm.partition`` (a nested section took it over), ``storage.root`` is
    ``job.dump_folder`` (``RENAMED_KEYS``); None when ``key`` is no such old spelling."""
    if key in RENAMED_KEYS:
        return RENAMED_KEYS[key][0]
    return _flat_spellings(specs).get(key)


def moved_hint(key: str, specs: dict[str, Spec], prefix: str) -> str:
    """``"; it moved to {prefix}NEW"`` (and why, for a renamed key) when the old ``key`` moved,
    else "". A renamed bool's ``no_`` flag names the new one (``dataloader.no_streaming``)."""
    moved = moved_key(key, specs)
    why = f" ({RENAMED_KEYS[key][1]})" if key in RENAMED_KEYS else ""
    if moved is None and (renamed := _renamed_negation(key, specs)) is not None:
        moved, why = renamed[0], f" ({renamed[1]})"
    if moved is None:
        return ""
    return f"; it moved to {prefix}{moved}{why}"


def _renamed_negation(key: str, specs: dict[str, Spec]) -> tuple[str, str] | None:
    """(the new key's ``no_`` spelling, why) when ``key`` is the ``no_`` spelling of a renamed
    bool key (``training.no_dataset_streaming``); else None. A flag only: no TOML key."""
    parent, dot, name = key.rpartition(".")
    old = f"{parent}{dot}{name.removeprefix('no_')}"
    if not name.startswith("no_") or old not in RENAMED_KEYS:
        return None
    new, why = RENAMED_KEYS[old]
    spec = specs.get(new)
    return (negated(new), why) if spec is not None and spec.kind == "bool" else None


def negated(key: str) -> str:
    """``a.b.no_c`` for the bool key ``a.b.c`` (``no_c`` for a top-level ``c``)."""
    parent, dot, name = key.rpartition(".")
    return f"{parent}{dot}no_{name}"


def get_value(obj: Any, key: str) -> Any:
    """The value at dotted ``key`` of a config (or section)."""
    for name in key.split("."):
        obj = getattr(obj, name)
    return obj


def from_text(spec: Spec, text: str) -> Any:
    """Convert one command-line token to a scalar field's type; ValueError when it does not
    fit (bools are flags, see ``titan_core.config.argv``)."""
    if spec.kind == "int":
        return int(text)
    if spec.kind == "float":
        return _finite(float(text), spec.dtype)
    if spec.kind == "choice":
        return spec.choices[[str(c) for c in spec.choices].index(text)]  # ValueError if absent
    assert spec.kind == "str", spec
    return text


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _finite(value: float, dtype: str = "") -> float:
    """``value`` when it is finite (and, for a float used in ``dtype``, one that dtype holds:
    neither inf there nor a nonzero that may become 0); else ValueError."""
    if not math.isfinite(value):
        raise ValueError(value)
    if dtype:
        largest, smallest = DTYPE_RANGE[dtype]
        if abs(value) > largest or 0 < abs(value) < smallest:
            raise ValueError(value)
    return value


def from_value(spec: Spec, value: Any) -> Any:
    """Check a typed value (from TOML or Python); ints are accepted for floats."""
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if spec.kind == "bool" and isinstance(value, bool):
        return value
    if spec.kind == "int" and is_number and isinstance(value, int):
        return value
    if spec.kind == "float" and is_number:
        return _finite(float(value), spec.dtype)
    if spec.kind == "str" and isinstance(value, str):
        return value
    if spec.kind == "choice" and any(type(c) is type(value) and c == value for c in spec.choices):
        return value
    if spec.kind == "list" and isinstance(value, list):
        assert spec.item is not None
        return [from_value(spec.item, v) for v in value]
    raise ValueError(value)


def did_you_mean(key: str, specs: dict[str, Spec], prefix: str) -> str:
    """Suggest known keys close to ``key``: its new spelling when it moved (``moved_hint``),
    else the same field name elsewhere or a near spelling; "" when nothing is close."""
    moved = moved_hint(key, specs, prefix)
    if moved:
        return moved
    pool = list(specs) + [negated(k) for k, s in specs.items() if s.kind == "bool"]
    name = key.rsplit(".", 1)[-1]
    same_name = [k for k in specs if k.rsplit(".", 1)[-1] == name and k != key]
    matches = list(dict.fromkeys(same_name + difflib.get_close_matches(key, pool, n=3)))[:3]
    if not matches:
        return ""
    return "; did you mean " + " or ".join(prefix + m for m in matches) + "?"


def typed_values(values: Mapping[str, Any], config_cls: type = JobConfig) -> dict[str, Any]:
    """``values`` checked against the schema (dotted keys; hyphens or underscores), ints
    accepted for floats; a one-line ``ConfigError`` names the first bad key or value."""
    specs = schema(config_cls)
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if name not in specs:
            raise ConfigError(f"{key}: unknown config key{did_you_mean(name, specs, '')}")
        try:
            out[name] = from_value(specs[name], value)
        except ValueError:
            expected = specs[name].describe(value)
            raise ConfigError(f"{name}: expected {expected}, got {value!r}") from None
    return out


def with_values(base: JobConfig, values: Mapping[str, Any]) -> JobConfig:
    """A copy of ``base`` with the (already checked) dotted-key ``values`` set; each changed
    section's ``__post_init__`` runs on its new values."""
    return _replace(copy.deepcopy(base), values)


def apply_values(cfg: JobConfig, values: Mapping[str, Any]) -> JobConfig:
    """A copy of ``cfg`` with the dotted-key ``values`` set, checked (``typed_values``) and
    validated (e.g. ``{"evaluate.batches": 2}``)."""
    cfg = with_values(cfg, typed_values(values, type(cfg)))
    validate(cfg)
    return cfg


def _replace(obj: Any, values: Mapping[str, Any]) -> Any:
    """``dataclasses.replace`` of ``obj`` with dotted keys relative to it (nested sections are
    replaced first, so each section's ``__post_init__`` sees its new values)."""
    changes: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        name, dot, rest = key.partition(".")
        if dot:
            nested.setdefault(name, {})[rest] = value
        else:
            changes[name] = value
    for name, sub in nested.items():
        changes[name] = _replace(getattr(obj, name), sub)
    return dataclasses.replace(obj, **changes)


def _section_objects(obj: Any) -> list[Any]:
    """The sections of a config (or section), nested ones after their parent."""
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out += [value, *_section_objects(value)]
    return out


def validate(cfg: JobConfig) -> None:
    """Type-check every field and re-run every section's ``__post_init__`` on ``cfg``."""
    for key, spec in schema(type(cfg)).items():
        value = get_value(cfg, key)
        try:
            from_value(spec, value)
        except ValueError:
            raise ConfigError(f"{key}: expected {spec.describe(value)}, got {value!r}") from None
    for obj in [*_section_objects(cfg), cfg]:
        post_init = getattr(obj, "__post_init__", None)
        if post_init is not None:
            post_init()


def to_dict(cfg: JobConfig) -> dict[str, Any]:
    """The config as nested plain dicts, one per section (and one per nested section)."""
    return dataclasses.asdict(cfg)


def to_toml(cfg: JobConfig) -> str:
    """The config as TOML text; loading it back with ``--job.config_file`` gives the same config."""
    return tomli_w.dumps(to_dict(cfg))


def flatten(cfg: JobConfig) -> dict[str, Scalar]:
    """Dotted keys to scalars (lists as JSON), e.g. for MLflow params."""
    return flatten_tables(to_dict(cfg))


def flatten_tables(tables: dict[str, Any], prefix: str = "") -> dict[str, Scalar]:
    """Nested tables (``to_dict``, or a config's TOML) as dotted keys to scalars, lists as JSON
    (an item may hold a comma: ``["To be, or not to be,"]``):
    ``{"launch": {"slurm": {"partition": "gpu"}}}`` -> ``launch.slurm.partition``."""
    out: dict[str, Scalar] = {}
    for name, value in tables.items():
        if isinstance(value, dict):
            out |= flatten_tables(value, f"{prefix}{name}.")
        else:
            out[prefix + name] = json.dumps(value) if isinstance(value, list) else value
    return out
