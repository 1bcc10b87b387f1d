"""``ConfigForm``: a typed partial of ``JobConfig`` for Prefect flow parameters (and their UI form).

One pydantic model per section, generated from the dataclasses of ``job.py``: every field is
optional with default ``None`` ("unset keeps the recipe's value"), typed as in the dataclass,
and described by its docstring plus the engine default. No field carries a schema ``default``:
the Prefect UI pre-fills and submits defaults, which would overwrite the recipe's values. The
engine default is in the description ("Default: 100.") and in ``examples``.

The form opens with ``run``, the few settings most runs change (``RUN_FIELDS``: steps, batch,
learning rate, dataset, processes, experiment); every section after it is folded (``None``
until a user opens it, so an untouched section submits nothing). ``job.config_file`` is left
out: the flows' own ``config_file`` parameter sets it. ``recipe_schema`` rewrites a deployed
schema for the recipe its deployment runs (``titan pipeline deploy``): each help text gives
the recipe's value, and booleans become plain switches that start at the recipe's value (a
switch has no empty state, so an untouched one submits what it shows).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import re
import typing
from collections.abc import Mapping
from typing import Any

import docstring_parser
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from titan_core.config.job import JobConfig
from titan_core.config.schema import get_value, moved_hint, schema
from titan_core.errors import ConfigError

# Strict: "4" is no int and 1 no bool, as on the command line and in TOML (ints pass as floats).
_SECTION_CONFIG = ConfigDict(extra="forbid", strict=True)
RUN_FIELDS: dict[str, str] = {
    "steps": "training.steps",
    "local_batch_size": "training.local_batch_size",
    "lr": "optimizer.lr",
    "dataset": "dataloader.dataset",
    "nproc_per_node": "launch.nproc_per_node",
    "experiment": "job.experiment",
}
"""The ``run`` group at the top of the form: its fields and the keys they set."""
FORM_HIDDEN = frozenset({"job.config_file"})
"""Keys the form leaves out: the flows' own ``config_file`` parameter sets the config file."""
_DEFAULT_RE = re.compile(r" Default: (.*) \(empty: the recipe's value\)\.$")


def attribute_docstrings(cls: type) -> dict[str, str]:
    """The docstrings under the fields of dataclass ``cls`` (the string literal after each
    annotated field), whitespace collapsed to single spaces."""
    params = docstring_parser.parse_from_object(cls).params
    return {p.arg_name: " ".join((p.description or "").split()) for p in params}


def _default(f: dataclasses.Field[Any]) -> Any:
    """The engine default of a dataclass field."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


_PLACEHOLDER_RE = re.compile(r"(\S*<[^<>\s]+>\S*?)([.,;:)]?(?:\s|$))")


def markdown_safe(text: str) -> str:
    """``text`` for a UI that renders help as markdown: words holding ``<placeholder>``s are put
    in backticks (a bare ``<experiment>`` reads as an HTML tag and disappears)."""
    return _PLACEHOLDER_RE.sub(lambda m: f"`{m.group(1)}`{m.group(2)}", text)


def _plain_optional(schema: dict[str, Any]) -> None:
    """JSON schema of an optional form field as its plain type, with no default: a form shows an
    empty input of that type (not a type switch with null selected), and an empty field is left
    out of the submitted value, which keeps the recipe's setting. Booleans stay nullable."""
    if any(s.get("type") == "boolean" for s in schema.get("anyOf", [])):
        # A switch has no empty state: a form would submit an untouched one as false. A boolean
        # keeps its None choice (and its null default), so untouched means the recipe's value.
        return
    kinds = [s for s in schema.pop("anyOf", []) if s.get("type") != "null"]
    if len(kinds) == 1:
        schema.update(kinds[0])
    elif kinds:
        schema["anyOf"] = kinds
    schema.pop("default", None)


def _form_field(cls: type, name: str, title: str, docs: dict[str, str], note: str = "") -> Any:
    """``(type, Field)`` of field ``name`` of section dataclass ``cls``: optional, titled
    ``title``, described by its docstring (plus ``note``) and its engine default."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    default = _default(f)
    assert name in docs, f"{cls.__name__}.{name} has no docstring"
    help_text = (
        f"{markdown_safe(docs[name])}{note} Default: {json.dumps(default)} (empty: the recipe's "
        "value)."
    )
    field = Field(
        default=None,
        title=title,
        description=help_text,
        examples=[default],
        json_schema_extra=_plain_optional,
    )
    return typing.get_type_hints(cls)[name] | None, field


def _section_form(section: str, cls: type) -> type[BaseModel]:
    """The form of one section: each field optional, titled by its key, described by its
    docstring and the engine default (also in ``examples``); a nested section (``launch.slurm``)
    is a nested form. Keys of ``FORM_HIDDEN`` are left out."""
    hints = typing.get_type_hints(cls)
    docs = attribute_docstrings(cls)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f"{section}.{f.name}" in FORM_HIDDEN:
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            fields[f.name] = _nested_form(f"{section}.{f.name}", hints[f.name], docs.get(f.name))
            continue
        fields[f.name] = _form_field(cls, f.name, f.name, docs)
    config = ConfigDict(**_SECTION_CONFIG, title=section)
    return create_model(  # type: ignore[call-overload,no-any-return]
        f"{cls.__name__}Form", __config__=config, __doc__=cls.__doc__, **fields
    )


def _section_class(section: str, config_cls: type = JobConfig) -> type:
    """The dataclass of dotted ``section`` (``launch.slurm``) of ``config_cls``."""
    cls = config_cls
    for part in section.split("."):
        cls = typing.get_type_hints(cls)[part]
    return cls


def _run_form() -> type[BaseModel]:
    """The ``run`` group: the settings most runs change (``RUN_FIELDS``), titled by the key
    each one sets."""
    fields: dict[str, Any] = {}
    for name, key in RUN_FIELDS.items():
        section, _, attr = key.rpartition(".")
        cls = _section_class(section)
        fields[name] = _form_field(cls, attr, key, attribute_docstrings(cls), f" Sets {key}.")
    config = ConfigDict(**_SECTION_CONFIG, title="run")
    doc = "The settings most runs change; the sections below hold every other one."
    return create_model(  # type: ignore[call-overload,no-any-return]
        "RunForm", __config__=config, __doc__=doc, **fields
    )


def _nested_form(section: str, cls: type, doc: str | None) -> tuple[type[BaseModel], Any]:
    """``(form, field)`` of section ``section`` (dotted) inside its parent's form."""
    form = _section_form(section, cls)
    description = markdown_safe(f"[{section}] {doc or ''}".strip())
    title = section.rpartition(".")[2]
    return form, Field(default_factory=form, title=title, description=description)


@functools.cache
def build_config_form(config_cls: type = JobConfig) -> type[BaseModel]:
    """The ``ConfigForm`` model of ``config_cls``: the ``run`` group, then one optional form per
    section, folded (``None``) until opened."""
    hints = typing.get_type_hints(config_cls)
    docs = attribute_docstrings(config_cls)
    run_form = _run_form()
    run_help = "Per run: the settings most runs change (each sets the key in its title)."
    sections: dict[str, Any] = {
        "run": (run_form, Field(default_factory=run_form, title="run", description=run_help))
    }
    for f in dataclasses.fields(config_cls):
        form = _section_form(f.name, hints[f.name])
        description = markdown_safe(f"[{f.name}] {docs.get(f.name) or ''}".strip())
        description += f" Switch to {f.name} to change its settings; None keeps them all."
        sections[f.name] = (form | None, Field(default=None, title=f.name, description=description))
    return create_model(  # type: ignore[call-overload,no-any-return]
        "ConfigForm",
        __config__=ConfigDict(extra="forbid", title="job config"),
        __doc__="Settings of the job; a field left empty keeps the recipe's value.",
        __module__=__name__,
        **sections,
    )


ConfigForm = build_config_form()


def form_to_values(form: BaseModel | None) -> dict[str, Any]:
    """The dotted keys ``form`` sets (fields not ``None``), in schema order; the ``run`` group's
    fields under the keys they stand for (one also set in its section must agree)."""
    if form is None:
        return {}
    values: dict[str, Any] = {}
    run: dict[str, tuple[str, Any]] = {}
    for name in type(form).model_fields:
        value = getattr(form, name)
        if name == "run" and isinstance(form, ConfigForm):
            run = {RUN_FIELDS[k]: (k, v) for k, v in form_to_values(value).items()}
        elif isinstance(value, BaseModel):
            values |= {f"{name}.{key}": v for key, v in form_to_values(value).items()}
        elif value is not None:
            values[name] = value
    for key, (name, value) in run.items():
        if key in values and values[key] != value:
            raise ConfigError(
                f"config.run.{name} ({value!r}) and config.{key} ({values[key]!r}) disagree; "
                "set one of them"
            )
        values[key] = value
    return values


def as_form(config: Any) -> BaseModel | None:
    """``config`` as a ``ConfigForm`` (a mapping is validated); one-line ``ConfigError`` naming
    the first bad field."""
    if config is None or isinstance(config, ConfigForm):
        return config
    if isinstance(config, str):
        raise ConfigError(
            "config: expected the job's settings by section (e.g. {'training': {'steps': 20}}), "
            f"got {config!r}; a recipe name goes in the recipe parameter"
        )
    try:
        return ConfigForm.model_validate(config)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in ("config", *first["loc"]))
        if first["type"] == "extra_forbidden":
            key = ".".join(str(part) for part in first["loc"])
            hint = moved_hint(key, schema(JobConfig), "config.")
            if key in FORM_HIDDEN:
                hint = "; the flow's config_file parameter sets it"
            raise ConfigError(
                f"{where}: no such section or field of the job config{hint}"
            ) from None
        message = first["msg"][:1].lower() + first["msg"][1:]
        raise ConfigError(f"{where}: {message}, got {first['input']!r}") from None


def flow_values(config: Any, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """The dotted-key values a flow's ``config`` form and ``overrides`` mapping set (overrides
    win); lists of CLI tokens (the old ``overrides`` shape) are refused in one line."""
    if overrides is not None and not isinstance(overrides, Mapping):
        raise ConfigError(
            "overrides: expected a mapping of dotted config keys to values "
            f'(e.g. {{"training.steps": 20}}), got {overrides!r}'
        )
    return form_to_values(as_form(config)) | dict(overrides or {})


def _ref(prop: Mapping[str, Any]) -> str | None:
    """The definition a schema property points to (directly or as an ``anyOf`` choice)."""
    refs = [prop.get("$ref")] + [choice.get("$ref") for choice in prop.get("anyOf", [])]
    ref = next((r for r in refs if r), None)
    return ref.rsplit("/", 1)[-1] if ref else None


def _with_recipe_value(prop: dict[str, Any], value: Any, label: str) -> None:
    """Point one field's help (and ``examples``) at ``label``'s value; a boolean becomes a plain
    switch that starts at it."""
    shown = json.dumps(value)
    match = _DEFAULT_RE.search(prop.get("description", ""))
    if match:
        engine = "" if match.group(1) == shown else f"; engine default {match.group(1)}"
        prop["description"] = (
            prop["description"][: match.start()]
            + f" Default: {shown}, from {label}{engine} (empty keeps it)."
        )
    prop["examples"] = [value]
    if {"type": "boolean"} in prop.get("anyOf", []):
        prop.pop("anyOf")
        prop.update(type="boolean", default=value)


def recipe_schema(
    parameter_schema: Mapping[str, Any], cfg: JobConfig, label: str
) -> dict[str, Any]:
    """A flow's parameter schema (its ``config`` form) with the values of ``cfg`` (the config a
    deployment's runs start from, named ``label``) as each field's default: in the help text,
    and as the starting state of the boolean switches. Empty fields still keep the recipe's
    value; a deployment whose ``recipe`` parameter a user changes keeps these defaults, which
    the help text names."""
    new = copy.deepcopy(dict(parameter_schema))
    defs = new.get("definitions") or new.get("$defs") or {}
    form = _ref(new.get("properties", {}).get("config", {}))
    if form is None or form not in defs:
        return new

    def walk(name: str, prefix: str, keys: Mapping[str, str] | None = None) -> None:
        for field, prop in defs[name]["properties"].items():
            if (sub := _ref(prop)) is not None:
                run = not prefix and field == "run"
                walk(sub, "" if run else f"{prefix}{field}.", RUN_FIELDS if run else None)
                continue
            key = keys[field] if keys else f"{prefix}{field}"
            _with_recipe_value(prop, get_value(cfg, key), label)

    walk(form, "")
    return new
