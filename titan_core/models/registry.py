"""Recipes: the functions of each family's config registry (``--module M --config C``).

A recipe is a plain function returning a ``JobConfig`` (``llama3_debugmodel``); its family's
``ModelSpec.config_registry`` names the module that holds it. Recipe names are unique across
families, so a name alone finds its family (``find_recipe``).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable

from titan_core.config.job import JobConfig
from titan_core.config.schema import validate
from titan_core.errors import ConfigError
from titan_core.models import family_names, get_model_spec

Recipe = Callable[[], JobConfig]


def recipes(family: str) -> tuple[str, dict[str, Recipe]]:
    """(registry module name, its public recipe functions) of a model family."""
    registry = importlib.import_module(get_model_spec(family).config_registry)
    functions = {
        name: fn
        for name, fn in inspect.getmembers(registry, inspect.isfunction)
        if fn.__module__ == registry.__name__ and not name.startswith("_")
    }
    return registry.__name__, functions


def _recipes_or_empty(family: str) -> dict[str, Recipe]:
    try:
        return recipes(family)[1]
    except (ConfigError, ImportError):
        return {}


def load_registry_config(module: str, config: str) -> JobConfig:
    """Call recipe ``config`` of model family ``module`` (its spec's ``config_registry``) and
    validate the result; one line naming ``--module``/``--config`` when either is unknown."""
    families = family_names()
    if module not in families:
        raise ConfigError(
            f"--module {module!r}: unknown model family; choices: {', '.join(families)}"
        )
    registry, functions = recipes(module)
    if config not in functions:
        owners = [f for f in families if f != module and config in _recipes_or_empty(f)]
        hint = f" ({config!r} is a recipe of --module {owners[0]})" if owners else ""
        raise ConfigError(
            f"--config {config!r}: not in {registry}{hint}; choices: {', '.join(sorted(functions))}"
        )
    cfg = functions[config]()
    assert isinstance(cfg, JobConfig), f"{module}.{config}() returned {type(cfg).__name__}"
    validate(cfg)
    return cfg


def recipe_names() -> dict[str, str]:
    """Every registry recipe of every model family, mapped to its family."""
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
