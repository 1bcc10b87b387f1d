"""``ConfigForm``: a typed partial of ``JobConfig`` for Prefect flow parameters (and their UI form).

One pydantic model per section, generated from the dataclasses of ``job.py``: every field is
optional with default ``None`` ("unset keeps the recipe's value"), typed as in the dataclass,
and described by its docstring plus the engine default. No field carries a schema ``default``:
the Prefect UI pre-fills and submits defaults, which would overwrite the recipe's values. The
engine default is in the description ("Default: 100.") and in ``examples``.
"""

from __future__ import annotations

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
from titan_core.config.schema import moved_hint, schema
from titan_core.errors import ConfigError

# Strict: "4" is no int and 1 no bool, as on the command line and in TOML (ints pass as floats).
_SECTION_CONFIG = ConfigDict(extra="forbid", strict=True)


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


def _section_form(section: str, cls: type) -> type[BaseModel]:
    """The form of one section: each field optional, titled by its key, described by its
    docstring and the engine default (also in ``examples``); a nested section (``launch.slurm``)
    is a nested form."""
    hints = typing.get_type_hints(cls)
    docs = attribute_docstrings(cls)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            fields[f.name] = _nested_form(f"{section}.{f.name}", hints[f.name], docs.get(f.name))
            continue
        default = _default(f)
        assert f.name in docs, f"{section}.{f.name} has no docstring"
        help_text = (
            f"{markdown_safe(docs[f.name])} Default: {json.dumps(default)} (empty: the recipe's "
            "value)."
        )
        field = Field(
            default=None,
            title=f.name,
            description=help_text,
            examples=[default],
            json_schema_extra=_plain_optional,
        )
        fields[f.name] = (hints[f.name] | None, field)
    config = ConfigDict(**_SECTION_CONFIG, title=section)
    return create_model(  # type: ignore[call-overload,no-any-return]
        f"{cls.__name__}Form", __config__=config, __doc__=cls.__doc__, **fields
    )


def _nested_form(section: str, cls: type, doc: str | None) -> tuple[type[BaseModel], Any]:
    """``(form, field)`` of section ``section`` (dotted) inside its parent's form."""
    form = _section_form(section, cls)
    description = markdown_safe(f"[{section}] {doc or ''}".strip())
    title = section.rpartition(".")[2]
    return form, Field(default_factory=form, title=title, description=description)


@functools.cache
def build_config_form(config_cls: type = JobConfig) -> type[BaseModel]:
    """The ``ConfigForm`` model of ``config_cls``: one optional nested form per section."""
    hints = typing.get_type_hints(config_cls)
    docs = attribute_docstrings(config_cls)
    sections = {
        f.name: _nested_form(f.name, hints[f.name], docs.get(f.name))
        for f in dataclasses.fields(config_cls)
    }
    return create_model(  # type: ignore[call-overload,no-any-return]
        "ConfigForm",
        __config__=ConfigDict(extra="forbid", title="job config"),
        __doc__="Settings of the job; a field left empty keeps the recipe's value.",
        __module__=__name__,
        **sections,
    )


ConfigForm = build_config_form()


def form_to_values(form: BaseModel | None) -> dict[str, Any]:
    """The dotted keys ``form`` sets (fields not ``None``), in schema order."""
    if form is None:
        return {}
    values: dict[str, Any] = {}
    for name in type(form).model_fields:
        value = getattr(form, name)
        if isinstance(value, BaseModel):
            values |= {f"{name}.{key}": v for key, v in form_to_values(value).items()}
        elif value is not None:
            values[name] = value
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
