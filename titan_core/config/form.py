"""``ConfigForm``: a typed partial of ``JobConfig`` for Prefect flow parameters (and their UI form).

One pydantic model per section, generated from the dataclasses of ``job.py``: every field is
optional with default ``None`` ("unset keeps the recipe's value"), typed as in the dataclass,
and described by its docstring plus the engine default. No field carries a schema ``default``
and none is nullable: the Prefect UI pre-fills and submits defaults (which would overwrite the
chosen recipe's values) and shows a nullable field as an ``X | None`` switch. An empty field is
left out of the submitted value; a switch (a boolean) submits nothing until it is touched.

The form opens with ``run``, the few settings most runs change (``RUN_FIELDS``: steps, batch,
learning rate, dataset, processes, experiment); every section after it is folded: a choice of
two tabs, "recipe's values" (submits nothing) and "change" (the section's fields), so an
untouched section is left out of the submitted value. ``job.config_file`` is left out: the
flows' own ``config_file`` parameter sets it. ``FormParameter`` gives a flow parameter the same
shape (no ``None`` choice), and ``recipe_schema`` adds to a deployed schema's help the values of
the recipe its deployment runs (``titan pipeline deploy``), while saying the chosen recipe's
value is what an empty field keeps.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import re
import typing
from collections.abc import Mapping
from typing import Any, Final

import docstring_parser
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    ValidationError,
    create_model,
    field_validator,
)

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
KEEP_TAB = "recipe's values"
"""Title of a folded section's first tab: it submits nothing, so the section keeps the chosen
recipe's values."""
CHANGE_TAB = "change"
"""Title of a folded section's second tab: the section's fields."""
NO_VALUES: Final[Mapping[str, Any]] = {}
"""Default of the flows' optional mapping parameters (``config``, ``overrides``, a sweep's
``grid``): nothing set. ``None`` would be a null default, which the Prefect UI submits (and
shows as an ``X | None`` switch). Never mutated."""
_ENGINE_DEFAULT_RE = re.compile(r" \(engine default: (.*)\)\.$")


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
    empty input of that type (not a type switch with null selected), and an empty field (or an
    untouched switch) is left out of the submitted value, which keeps the recipe's setting."""
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
    hint = typing.get_type_hints(cls)[name]
    # Not "Default: X": the recipe a user picks in the same form decides the value.
    keeps = (
        "Left untouched, it keeps the chosen recipe's value, whatever the switch shows"
        if hint is bool
        else "Empty keeps the chosen recipe's value"
    )
    help_text = (
        f"{markdown_safe(docs[name])}{note} {keeps} (engine default: {json.dumps(default)})."
    )
    field = Field(
        default=None,
        title=title,
        description=help_text,
        examples=[default],
        json_schema_extra=_plain_optional,
    )
    return hint | None, field


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


def fold(
    schema: dict[str, Any], *, keep: str = KEEP_TAB, keep_help: str = "", title: str = ""
) -> None:
    """Fold ``schema``, a ``$ref`` to a form, behind two tabs (a JSON schema ``anyOf``): ``keep``,
    an empty object that submits nothing and shows ``keep_help``, then ``CHANGE_TAB``, the form.
    The Prefect UI opens on the first; no choice is null, which it would show as ``X | None``
    (and as 'Property is type "None"' while selected)."""
    nothing = {"title": keep, "description": keep_help, "type": "object", "properties": {}}
    nothing["additionalProperties"] = False  # only {}: a mistyped field is still refused
    schema["anyOf"] = [nothing, {"$ref": schema.pop("$ref"), "title": CHANGE_TAB}]
    if title:
        schema["title"] = title


@dataclasses.dataclass(frozen=True)
class FormParameter:
    """``Annotated`` marker of an optional flow parameter (a form or mapping, or ``None``; default
    ``NO_VALUES``): its JSON schema, which the Prefect UI shows as a form, is that of its first
    type alone, with no ``None`` choice; with ``keep`` (a form) it is folded (``fold``)."""

    keep: str = ""
    """Title of the tab that keeps the defaults; empty: not folded."""
    keep_help: str = ""
    """What that tab keeps."""

    def __get_pydantic_json_schema__(
        self, core_schema: Any, handler: GetJsonSchemaHandler
    ) -> dict[str, Any]:
        """The first choice of the type's schema, folded with ``keep``."""
        shown = handler(core_schema)
        shown = dict(shown["anyOf"][0]) if "anyOf" in shown else shown
        if self.keep:
            fold(shown, keep=self.keep, keep_help=self.keep_help)
        return shown


def _untouched(cls: type, value: Any) -> Any:
    """A section given as ``None`` (what run forms before folded tabs submitted) is untouched."""
    return {} if value is None else value


@functools.cache
def build_config_form(config_cls: type = JobConfig) -> type[BaseModel]:
    """The ``ConfigForm`` model of ``config_cls``: the ``run`` group, then one form per section,
    folded (``fold``): it submits nothing until its change tab is opened."""
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
        keep_help = (
            f"Every {f.name} setting keeps the chosen recipe's value; {CHANGE_TAB} sets some."
        )
        folded = functools.partial(fold, keep_help=keep_help, title=f.name)
        field = Field(default_factory=form, description=description, json_schema_extra=folded)
        sections[f.name] = (form, field)
    return create_model(  # type: ignore[call-overload,no-any-return]
        "ConfigForm",
        __config__=ConfigDict(extra="forbid", title="job config"),
        __doc__="Settings of the job; a field left empty keeps the chosen recipe's value.",
        __module__=__name__,
        __validators__={"untouched": field_validator("*", mode="before")(_untouched)},
        **sections,
    )


ConfigForm = build_config_form()
ConfigParameter = typing.Annotated[ConfigForm | Mapping[str, Any] | None, FormParameter()]
"""Type of the flows' ``config`` parameter (default ``NO_VALUES``): the form (a deployment's runs
pass a mapping); its schema is the form's alone."""
ValuesParameter = typing.Annotated[Mapping[str, Any] | None, FormParameter()]
"""Type of a flow's mapping parameter (``overrides``; default ``NO_VALUES``): an object in the
form, with no ``None`` choice."""


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
    """Add ``label``'s value to one field's help (and ``examples``), after what an empty field
    keeps: the chosen recipe's value, which a user may pick in the same form."""
    shown = json.dumps(value)
    match = _ENGINE_DEFAULT_RE.search(prop.get("description", ""))
    if match:
        prop["description"] = (
            prop["description"][: match.start()] + f" (as deployed, {label}: {shown})."
        )
    prop["examples"] = [value]


def recipe_schema(
    parameter_schema: Mapping[str, Any], cfg: JobConfig, label: str
) -> dict[str, Any]:
    """A flow's parameter schema (its ``config`` form) with the values of ``cfg`` (the config a
    deployment's runs start from, named ``label``) in each field's help and ``examples``, named
    as the deployed values: an empty field keeps the recipe the user picks in the form, which
    may be another. Nothing gets a default (the form would submit it)."""
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
