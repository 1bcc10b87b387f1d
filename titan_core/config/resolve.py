"""Resolve a ``JobConfig`` from typed values: recipe < TOML file < dotted-key values.

The library door used by the flows, ``titan pipeline run`` and sweeps; the CLI door
(``manager.parse_args``) reads the same layers from argv. Both check values against the same
schema, so a bad key or value is the same one-line ``ConfigError`` whichever door it came in.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from titan_core.config.job import JobConfig
from titan_core.config.manager import (
    _apply,
    _did_you_mean,
    _from_value,
    _recipes_or_empty,
    _scan_cli,
    _schema,
    _toml_values,
    load_registry_config,
    model_from_initial_checkpoint,
    validate,
)
from titan_core.errors import ConfigError


def recipe_names() -> dict[str, str]:
    """Every registry recipe of every model family, mapped to its family."""
    from titan_core.models import family_names

    return {name: family for family in family_names() for name in _recipes_or_empty(family)}


def find_recipe(recipe: str) -> tuple[str, str]:
    """``(family, recipe)`` of a recipe name (``llama3_debugmodel``) or ``family/recipe``."""
    family, _, name = recipe.rpartition("/")
    known = recipe_names()
    if family and name in _recipes_or_empty(family):
        return family, name
    if not family and name in known:
        return known[name], name
    pool = sorted(f"{known[r]}/{r}" for r in known) if family else sorted(known)
    close = difflib.get_close_matches(recipe, pool, n=3, cutoff=0.5)
    hint = "did you mean " + " or ".join(close) + "?" if close else "recipes: " + ", ".join(pool)
    raise ConfigError(f"recipe {recipe!r}: no such registry recipe; {hint}")


def load_recipe(recipe: str) -> JobConfig:
    """The validated config of a registry recipe (``name`` or ``family/name``)."""
    return load_registry_config(*find_recipe(recipe))


def typed_values(values: Mapping[str, Any], config_cls: type = JobConfig) -> dict[str, Any]:
    """``values`` checked against the schema (dotted keys; hyphens or underscores), ints
    accepted for floats; a one-line ``ConfigError`` names the first bad key or value."""
    schema = _schema(config_cls)
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if name not in schema:
            raise ConfigError(f"{key}: unknown config key{_did_you_mean(name, schema, '')}")
        try:
            out[name] = _from_value(schema[name], value)
        except ValueError:
            expected = schema[name].describe()
            raise ConfigError(f"{name}: expected {expected}, got {value!r}") from None
    return out


def cli_values(argv: list[str], config_cls: type = JobConfig) -> dict[str, Any]:
    """Typed dotted-key values of ``--section.field value`` tokens (as ``titan train`` reads
    them: ``--section.no_field`` for False, lists as several or comma-separated values)."""
    return _scan_cli(list(argv), _schema(config_cls))[0]


def apply_values(cfg: JobConfig, values: Mapping[str, Any]) -> JobConfig:
    """A copy of ``cfg`` with the dotted-key ``values`` set, checked as ``resolve_job`` checks
    them (e.g. ``{"evaluate.batches": 2}``); validated."""
    cfg = _apply(cfg, typed_values(values))
    validate(cfg)
    return cfg


def resolve_job(
    recipe: str = "", config_file: str = "", values: Mapping[str, Any] | None = None
) -> JobConfig:
    """The config of ``recipe`` (empty: the defaults), with the TOML ``config_file`` (or the
    ``job.config_file`` value) applied, then the dotted-key ``values``; validated.

    Without a recipe and without ``model.name``/``model.flavor`` a self-describing
    ``checkpoint.initial_load_path`` picks the model, as on the command line.
    """
    checked = typed_values(values or {})
    cfg = load_recipe(recipe) if recipe else JobConfig()
    given = set(checked)
    config_file = config_file or checked.get("job.config_file", "")
    if config_file:
        from_file = _toml_values(config_file, cfg) | {"job.config_file": config_file}
        given |= set(from_file)
        cfg = _apply(cfg, from_file)
    cfg = _apply(cfg, checked)
    if not recipe and not given & {"model.name", "model.flavor"}:
        cfg = model_from_initial_checkpoint(cfg)
    validate(cfg)
    return cfg
