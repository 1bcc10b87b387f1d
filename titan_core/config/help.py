"""``--help`` of the job config: every key with its docstring and a given config's values as
defaults, rendered by tyro (which only ever prints help here: parsing is ``config.argv``'s)."""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any

import tyro

from titan_core.config.job import JobConfig

DESCRIPTION = """Resolve a training job config. Later layers win:
  1. dataclass defaults
  2. --module FAMILY --config RECIPE: a function of the family's config registry
     (titan_core.models.FAMILY.config_registry for the built-in families)
  3. --job.config-file PATH.toml
  4. the --section.field VALUE overrides below (hyphens or underscores)

Boolean options are flags: --section.field sets True, --section.no-field sets False.
Lists take several values or one comma-separated value."""


def print_help(base: JobConfig, prog: str | None = None) -> None:
    """Print every key with ``base``'s values as defaults and raise ``SystemExit(0)``; each
    field's docstring is one paragraph (see ``_help_class``)."""
    cls = _help_class(type(base))
    default = _help_copy(cls, base)
    tyro.cli(cls, default=default, args=["--help"], prog=prog, description=DESCRIPTION)


@functools.cache
def _help_class(cls: type) -> type:
    """``cls`` for ``--help`` only: the same fields and sections, each field's docstring given
    as its help with the line breaks of its paragraphs removed. (tyro keeps a break before
    every indented line of an attribute docstring: one line per source line.)"""
    import docstring_parser

    hints = typing.get_type_hints(cls, include_extras=True)
    docs = {p.arg_name: p.description for p in docstring_parser.parse_from_object(cls).params}
    fields = []
    for f in dataclasses.fields(cls):
        tp = (
            _help_class(hints[f.name]) if dataclasses.is_dataclass(hints[f.name]) else hints[f.name]
        )
        text = docs.get(f.name) or ""
        help_text = "\n\n".join(" ".join(p.split()) for p in text.split("\n\n"))
        fields.append((f.name, tp, dataclasses.field(metadata={"help": help_text or None})))
    return dataclasses.make_dataclass(cls.__name__, fields, namespace={"__doc__": cls.__doc__})


def _help_copy(cls: type, obj: Any) -> Any:
    """``obj`` (a config or section) as an instance of its ``_help_class`` ``cls``."""
    hints = typing.get_type_hints(cls)
    return cls(
        **{
            f.name: _help_copy(hints[f.name], getattr(obj, f.name))
            if dataclasses.is_dataclass(hints[f.name])
            else getattr(obj, f.name)
            for f in dataclasses.fields(cls)
        }
    )
