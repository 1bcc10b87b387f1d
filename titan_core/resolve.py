"""The one resolver of a job config: recipe < TOML file < values < initial checkpoint, validated.

Every door uses it: the command line (``parse_args``: ``--module M --config C``,
``--job.config_file PATH``, ``--section.field value``), the flows, sweeps and ``titan pipeline``
(``resolve_job`` with typed dotted-key values) and the tests. The layers are applied by
``_layered`` alone, so a config resolves the same whichever door it came in.

It sits above ``models/`` (recipes are functions of a family's config registry) and
``checkpoint/`` (a self-describing checkpoint names its model); ``titan_core.config`` below it
knows neither.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

from titan_core.checkpoint.manager import checkpoint_model
from titan_core.config.argv import cli_values, pop_option
from titan_core.config.help import print_help
from titan_core.config.job import JobConfig
from titan_core.config.schema import typed_values, validate, with_values
from titan_core.config.toml import toml_values
from titan_core.errors import ConfigError
from titan_core.models import CHECKPOINT_FLAVOR
from titan_core.models.registry import find_recipe, load_recipe, load_registry_config

_MODEL_KEYS = frozenset({"model.name", "model.flavor"})


def resolve_job(
    recipe: str = "", config_file: str = "", values: Mapping[str, Any] | None = None
) -> JobConfig:
    """The config of ``recipe`` (``name`` or ``family/name``; empty: the defaults), with the TOML
    ``config_file`` (or the ``job.config_file`` value) applied, then the dotted-key ``values``
    (checked against the schema); validated.

    Without a recipe and without ``model.name``/``model.flavor`` a self-describing
    ``checkpoint.initial_load_path`` picks the model, as on the command line.
    """
    checked = typed_values(values or {})
    base = load_recipe(recipe) if recipe else JobConfig()
    return _layered(base, bool(recipe), config_file, checked)


def parse_args(
    argv: list[str] | None = None, prog: str | None = None, config_cls: type[JobConfig] = JobConfig
) -> JobConfig:
    """The config of a command line (default ``sys.argv[1:]``): ``--module``/``--config`` (a
    recipe; ``--config`` alone finds its family), ``--job.config_file``, then the
    ``--section.field value`` overrides. ``-h``/``--help`` prints every key with the recipe's
    values as defaults and raises ``SystemExit(0)``. ``config_cls``: a ``JobConfig`` subclass
    with sections of its own (a recipe is still a ``JobConfig``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    module, argv = pop_option(argv, "--module")
    config, argv = pop_option(argv, "--config")
    recipe = _command_line_recipe(module, config)
    base = config_cls() if recipe is None else recipe
    if "-h" in argv or "--help" in argv:
        print_help(base, prog)
    values = cli_values(argv, config_cls)
    return _layered(base, recipe is not None, "", values)


def _command_line_recipe(module: str | None, config: str | None) -> JobConfig | None:
    """The recipe ``--module``/``--config`` name (None when neither is given)."""
    if module is not None and config is None:
        raise ConfigError(
            f"--module {module}: names the family of a --config recipe (e.g. --module llama3 "
            "--config llama3_debugmodel)"
        )
    if config is None:
        return None
    if module is None:  # recipe names are unique: find the family
        module, config = find_recipe(config)
    return load_registry_config(module, config)


def _layered(
    base: JobConfig, from_recipe: bool, config_file: str, values: dict[str, Any]
) -> JobConfig:
    """``base`` with the TOML file (``config_file``, else ``values["job.config_file"]``) and then
    the checked ``values`` applied; the initial checkpoint's model when nothing named one;
    validated."""
    given = set(values)
    config_file = config_file or values.get("job.config_file", "")
    if config_file:
        from_file = toml_values(config_file, base) | {"job.config_file": config_file}
        given |= set(from_file)
        base = with_values(base, from_file)
    cfg = with_values(base, values)
    if not from_recipe and not given & _MODEL_KEYS:
        cfg = model_from_initial_checkpoint(cfg)
    validate(cfg)
    return cfg


def model_from_initial_checkpoint(cfg: JobConfig) -> JobConfig:
    """``cfg`` building the model that ``checkpoint.initial_load_path`` describes, when it names
    a self-describing DCP checkpoint: ``model.name`` its family, ``model.flavor`` the reserved
    ``checkpoint`` (see ``build.flavor_args``). Otherwise ``cfg`` unchanged. Applied when the
    user named no recipe (``--module``) and no ``model.name``/``model.flavor``."""
    path = cfg.checkpoint.initial_load_path
    found = None if not path or cfg.checkpoint.initial_load_in_hf else checkpoint_model(path)
    if found is None:
        return cfg
    model = dataclasses.replace(cfg.model, name=found[0], flavor=CHECKPOINT_FLAVOR)
    return dataclasses.replace(cfg, model=model)


class ConfigManager:
    """Resolves a ``JobConfig`` from defaults, a registry function, a TOML file and CLI flags
    (torchtitan's name for ``parse_args``). ``prog`` names the program in ``--help``."""

    def __init__(self, config_cls: type[JobConfig] = JobConfig, prog: str | None = None) -> None:
        self.config_cls = config_cls
        self.prog = prog

    def parse_args(self, argv: list[str] | None = None) -> JobConfig:
        """Resolve the config from ``argv`` (default ``sys.argv[1:]``); ``--help`` exits."""
        return parse_args(argv, self.prog, self.config_cls)
