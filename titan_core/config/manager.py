"""Resolve a ``JobConfig``: dataclass defaults < registry function < TOML file < CLI overrides.

``--module M --config F`` starts from recipe ``F`` of model family ``M`` (its spec's registry),
``--job.config_file PATH`` applies a TOML file onto it, and ``--section.field value`` overrides
win over both. tyro does the parsing and ``--help``; the argv is checked against the schema first
so that every user error is one line (a ``ConfigError``) instead of tyro's multi-line box.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import importlib
import inspect
import sys
import tomllib
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import fsspec
import tomli_w
import tyro

from titan_core.config.job import JobConfig
from titan_core.errors import ConfigError

Scalar = bool | int | float | str

_PROG = "python -m titan_core.config.manager"
_DESCRIPTION = """Resolve a training job config. Later layers win:
  1. dataclass defaults
  2. --module FAMILY --config RECIPE: a function of the family's config registry
     (titan_core.models.FAMILY.config_registry for the built-in families)
  3. --job.config-file PATH.toml
  4. the --section.field VALUE overrides below (hyphens or underscores)

Boolean options are flags: --section.field sets True, --section.no-field sets False.
Lists take several values or one comma-separated value."""
_WORDS = {"bool": "true or false", "int": "an int", "float": "a float", "str": "a string"}


@dataclass(frozen=True)
class _Spec:
    """What one config field accepts, derived from its type hint."""

    kind: Literal["bool", "int", "float", "str", "choice", "list"]
    choices: tuple[Any, ...] = ()
    item: _Spec | None = None

    def describe(self) -> str:
        """Human words for the accepted values, used in error messages."""
        if self.kind == "choice":
            return "one of " + ", ".join(repr(c) for c in self.choices)
        if self.kind == "list":
            assert self.item is not None
            return f"a list of values, each {self.item.describe()}"
        return _WORDS[self.kind]


def _spec(tp: Any) -> _Spec:
    if typing.get_origin(tp) is Literal:
        return _Spec("choice", choices=typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return _Spec("list", item=_spec(typing.get_args(tp)[0]))
    if tp in (bool, int, float, str):
        return _Spec(tp.__name__)
    raise AssertionError(f"config fields must be bool/int/float/str/Literal/list, not {tp!r}")


@functools.cache
def _schema(cls: type) -> dict[str, _Spec]:
    """Map the dotted key of every field of every section of ``cls`` to its spec:
    ``section.field``, and ``section.sub.field`` inside a nested section (``launch.slurm``)."""
    section_hints = typing.get_type_hints(cls)
    for section in dataclasses.fields(cls):
        assert dataclasses.is_dataclass(section_hints[section.name]), f"{section.name}: no section"
    return _fields(cls, "")


def _fields(cls: type, prefix: str) -> dict[str, _Spec]:
    out: dict[str, _Spec] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out |= _fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            out[prefix + f.name] = _spec(hints[f.name])
    return out


@functools.cache
def _sections(cls: type) -> frozenset[str]:
    """The dotted paths of the sections of ``cls``, nested ones included (``launch.slurm``)."""
    return frozenset(key.rpartition(".")[0] for key in _schema(cls))


def _flat_spellings(schema: dict[str, _Spec]) -> dict[str, str]:
    """Keys of nested sections as they were spelled before nesting (``launch.slurm_partition``,
    ``launch.no_slurm_flag``) mapped to the key now (``launch.slurm.partition``)."""
    out: dict[str, str] = {}
    for key, spec in schema.items():
        section, *path = key.split(".")
        if len(path) > 1:
            out[f"{section}.{'_'.join(path)}"] = key
            if spec.kind == "bool":
                out[f"{section}.no_{'_'.join(path)}"] = _negated(key)
    return out


# Keys renamed into another section, with why: the CLI, flow parameters and forms refuse the old
# spelling in one line naming the new key; an old TOML file is read with it as the new key.
RENAMED_KEYS = {"storage.root": ("job.dump_folder", "the one output root")}


def _moved(key: str, schema: dict[str, _Spec]) -> str | None:
    """The key that the old ``key`` is now: ``launch.slurm_partition`` is
    ``launch.slurm.partition`` (``_flat_spellings``), ``storage.root`` is ``job.dump_folder``
    (``RENAMED_KEYS``); None when ``key`` is no such old spelling."""
    if key in RENAMED_KEYS:
        return RENAMED_KEYS[key][0]
    return _flat_spellings(schema).get(key)


def _moved_hint(key: str, schema: dict[str, _Spec], prefix: str) -> str:
    """``"; it moved to {prefix}NEW"`` (and why, for a renamed key) when the old ``key`` moved,
    else ""."""
    moved = _moved(key, schema)
    if moved is None:
        return ""
    why = f" ({RENAMED_KEYS[key][1]})" if key in RENAMED_KEYS else ""
    return f"; it moved to {prefix}{moved}{why}"


def _negated(key: str) -> str:
    """``a.b.no_c`` for the bool key ``a.b.c`` (``no_c`` for a top-level ``c``)."""
    parent, dot, name = key.rpartition(".")
    return f"{parent}{dot}no_{name}"


def _get(obj: Any, key: str) -> Any:
    """The value at dotted ``key`` of a config (or section)."""
    for name in key.split("."):
        obj = getattr(obj, name)
    return obj


def _from_text(spec: _Spec, text: str) -> Any:
    """Convert one CLI token to the field's type; ValueError when it does not fit."""
    if spec.kind == "int":
        return int(text)
    if spec.kind == "float":
        return float(text)
    if spec.kind == "choice":
        return spec.choices[[str(c) for c in spec.choices].index(text)]  # ValueError if absent
    assert spec.kind == "str", spec
    return text


def _from_value(spec: _Spec, value: Any) -> Any:
    """Check a typed value (from TOML or Python); ints are accepted for floats."""
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if spec.kind == "bool" and isinstance(value, bool):
        return value
    if spec.kind == "int" and is_number and isinstance(value, int):
        return value
    if spec.kind == "float" and is_number:
        return float(value)
    if spec.kind == "str" and isinstance(value, str):
        return value
    if spec.kind == "choice" and any(type(c) is type(value) and c == value for c in spec.choices):
        return value
    if spec.kind == "list" and isinstance(value, list):
        assert spec.item is not None
        return [_from_value(spec.item, v) for v in value]
    raise ValueError(value)


def _did_you_mean(key: str, schema: dict[str, _Spec], prefix: str) -> str:
    """Suggest known keys close to ``key``: its new spelling when a nested section took it over
    (``launch.slurm_partition`` is ``launch.slurm.partition``), else the same field name
    elsewhere or a near spelling."""
    moved = _moved_hint(key, schema, prefix)
    if moved:
        return moved
    pool = list(schema) + [_negated(k) for k, s in schema.items() if s.kind == "bool"]
    name = key.rsplit(".", 1)[-1]
    same_name = [k for k in schema if k.rsplit(".", 1)[-1] == name and k != key]
    matches = list(dict.fromkeys(same_name + difflib.get_close_matches(key, pool, n=3)))[:3]
    if not matches:
        return ""
    return "; did you mean " + " or ".join(prefix + m for m in matches) + "?"


def _apply(base: JobConfig, values: dict[str, Any]) -> JobConfig:
    """Return a copy of ``base`` with dotted-key ``values`` set; runs the sections' validation."""
    return _replace(copy.deepcopy(base), values)


def _replace(obj: Any, values: dict[str, Any]) -> Any:
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
    for key, spec in _schema(type(cfg)).items():
        value = _get(cfg, key)
        try:
            _from_value(spec, value)
        except ValueError:
            raise ConfigError(f"{key}: expected {spec.describe()}, got {value!r}") from None
    for obj in [*_section_objects(cfg), cfg]:
        post_init = getattr(obj, "__post_init__", None)
        if post_init is not None:
            post_init()


def _bool_refusal(shown: str, key: str) -> ConfigError:
    return ConfigError(
        f"{shown}: boolean options are flags; use --{_negated(key)} (or --{key} to enable)"
    )


def _lookup(name: str, schema: dict[str, _Spec]) -> tuple[str, bool]:
    """Resolve a CLI option name (hyphens or underscores) to ``(key, negated)``."""
    key = name.replace("-", "_")
    if key in schema:
        return key, False
    section, _, field_name = key.rpartition(".")
    positive = f"{section}.{field_name.removeprefix('no_')}".lstrip(".")
    if field_name.startswith("no_") and positive in schema and schema[positive].kind == "bool":
        return positive, True
    hint = _did_you_mean(key, schema, "--") or " (see --help for the options)"
    raise ConfigError(f"unknown option --{name}{hint}")


def _convert_cli(key: str, spec: _Spec, texts: list[str]) -> Any:
    """Convert the value tokens given for ``--key``; one-line ConfigError when they do not fit."""
    if spec.kind == "list":
        assert spec.item is not None
        items = [part for text in texts for part in text.split(",") if part]
        converted = []
        for item in items:
            try:
                converted.append(_from_text(spec.item, item))
            except ValueError:
                raise ConfigError(f"--{key}: expected {spec.describe()}, got {item!r}") from None
        return converted
    if not texts:
        raise ConfigError(f"--{key}: expected a value ({spec.describe()})")
    try:
        return _from_text(spec, texts[0])
    except ValueError:
        raise ConfigError(f"--{key}: expected {spec.describe()}, got {texts[0]!r}") from None


def _take_values(argv: list[str], i: int, spec: _Spec) -> tuple[list[str], int]:
    """The value tokens from ``argv[i]``: up to the next option for lists, else one."""
    end = i
    limit = len(argv) if spec.kind == "list" else min(i + 1, len(argv))
    while end < limit and not argv[end].startswith("--"):
        end += 1
    return argv[i:end], end


def _scan_cli(argv: list[str], schema: dict[str, _Spec]) -> tuple[dict[str, Any], list[str]]:
    """Check overrides against the schema; return typed values and a normalized argv for tyro."""
    values: dict[str, Any] = {}
    tyro_argv: list[str] = []
    i, last = 0, ""
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("--"):
            after = f" after {last}" if last else ""
            raise ConfigError(
                f"unexpected argument {token!r}{after}: overrides look like --section.field value"
            )
        last = token
        name, has_inline, inline = token[2:].partition("=")
        key, negated = _lookup(name, schema)
        spec = schema[key]
        flag = "--" + key.replace("_", "-")
        if spec.kind == "bool":
            if has_inline or (i < len(argv) and not argv[i].startswith("--")):
                raise _bool_refusal(token if has_inline else f"{token} {argv[i]}", key)
            values[key] = not negated
            tyro_argv.append("--" + _negated(key).replace("_", "-") if negated else flag)
            continue
        if has_inline:
            texts = [inline]
        else:
            texts, i = _take_values(argv, i, spec)
        values[key] = _convert_cli(key, spec, texts)
        if spec.kind == "list":
            tyro_argv += [flag, *(str(v) for v in values[key])]
        else:
            tyro_argv.append(f"{flag}={texts[0]}")
    return values, tyro_argv


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with fsspec.open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory, not a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: invalid TOML: the file is not UTF-8 text") from None


def load_toml(path: str | Path, base: JobConfig) -> JobConfig:
    """Apply the TOML file at ``path`` (local path or fsspec URL) onto ``base``, type-checked."""
    return _apply(base, _toml_values(str(path), base))


def _toml_values(path: str, base: JobConfig) -> dict[str, Any]:
    """The dotted-key values the TOML file at ``path`` sets, type-checked against ``base``."""
    schema = _schema(type(base))
    sections = {key.split(".")[0] for key in schema}
    values: dict[str, Any] = {}
    moved: dict[str, tuple[str, Any]] = {}
    for section, table in _read_toml(path).items():
        section_key = section.replace("-", "_")
        if not isinstance(table, dict) and section_key in sections:
            raise ConfigError(f"{path}: {section} must be a [{section}] table, got {table!r}")
        if not isinstance(table, dict):
            hint = _did_you_mean(section_key, schema, "")
            raise ConfigError(f"{path}: key {section!r} is outside any [section] table{hint}")
        if section_key not in sections:
            raise _unknown_section(path, section, section_key, sections)
        found, old = _table_values(path, section, section_key, table, type(base))
        values |= found
        moved |= old
    return values | _moved_values(path, moved, values, schema)


def _moved_values(
    path: str, moved: dict[str, tuple[str, Any]], values: dict[str, Any], schema: dict[str, _Spec]
) -> dict[str, Any]:
    """The values a TOML file gives under old keys (``moved``: new key -> (old key, value)), as
    their new keys. A file saved before a key moved lists it (every saved config.toml lists every
    key), so old runs still load, retrain and export. The new key wins when the file sets both
    (an old run's saved storage.root is ignored: its job.dump_folder is the run's folder)."""
    out: dict[str, Any] = {}
    read, ignored = [], []
    for key, (old, value) in moved.items():
        if key in values:
            ignored.append(old)
        else:
            out[key] = _toml_value(path, key, schema[key], value)
            read.append(f"{old} as {key}")
    from titan_core.logging import logger

    if read:
        logger.warning("%s: old keys read as their new names: %s", path, ", ".join(read))
    if ignored:
        logger.warning(
            "%s: old keys ignored, the file sets their new names: %s", path, ", ".join(ignored)
        )
    return out


def _unknown_section(path: str, shown: str, key: str, sections: Iterable[str]) -> ConfigError:
    close = difflib.get_close_matches(key, sorted(sections), n=3)
    hint = "; did you mean " + " or ".join(f"[{c}]" for c in close) + "?" if close else ""
    return ConfigError(f"{path}: unknown section [{shown}]{hint}")


def _table_values(
    path: str, shown: str, section: str, table: dict[str, Any], cls: type
) -> tuple[dict[str, Any], dict[str, tuple[str, Any]]]:
    """The dotted-key values of TOML table ``[shown]`` (section ``section``), nested tables
    (``[launch.slurm]``) included, type-checked; and the values it gives under old keys, as
    new key -> (old key, value) (read by ``_moved_values``)."""
    schema, sections = _schema(cls), _sections(cls)
    values: dict[str, Any] = {}
    moved: dict[str, tuple[str, Any]] = {}
    for name, value in table.items():
        key, where = f"{section}.{name.replace('-', '_')}", f"{shown}.{name}"
        if key in sections:
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: {where} must be a [{where}] table, got {value!r}")
            found, old = _table_values(path, where, key, value, cls)
            values |= found
            moved |= old
            continue
        if isinstance(value, dict) and key not in schema:
            nested = [s for s in sections if s.startswith(section + ".")]
            raise _unknown_section(path, where, key, nested)
        new_key = None if key in schema else _moved(key, schema)
        if new_key is not None:
            moved[new_key] = (key, value)
            continue
        if key not in schema:
            hint = _did_you_mean(key, schema, "")
            raise ConfigError(f"{path}: unknown key {where}{hint}")
        values[key] = _toml_value(path, key, schema[key], value)
    return values, moved


def _toml_value(path: str, key: str, spec: _Spec, value: Any) -> Any:
    """A TOML value checked against the field's spec; one-line ConfigError otherwise."""
    try:
        return _from_value(spec, value)
    except ValueError:
        raise ConfigError(f"{path}: {key}: expected {spec.describe()}, got {value!r}") from None


def _recipes(family: str) -> tuple[str, dict[str, Any]]:
    """(registry module name, its public recipe functions) of a model family."""
    from titan_core.models import get_model_spec

    registry = importlib.import_module(get_model_spec(family).config_registry)
    functions = {
        name: fn
        for name, fn in inspect.getmembers(registry, inspect.isfunction)
        if fn.__module__ == registry.__name__ and not name.startswith("_")
    }
    return registry.__name__, functions


def load_registry_config(module: str, config: str) -> JobConfig:
    """Call recipe ``config`` of model family ``module`` (its spec's ``config_registry``) and
    validate the result."""
    from titan_core.models import family_names

    families = family_names()
    if module not in families:
        raise ConfigError(
            f"--module {module!r}: unknown model family; choices: {', '.join(families)}"
        )
    registry, functions = _recipes(module)
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


def _recipes_or_empty(family: str) -> dict[str, Any]:
    try:
        return _recipes(family)[1]
    except (ConfigError, ImportError):
        return {}


def _pop_option(argv: list[str], option: str) -> tuple[str | None, list[str]]:
    """Remove ``--option VALUE`` / ``--option=VALUE`` from ``argv``; the last one wins."""
    value, rest, i = None, [], 0
    while i < len(argv):
        token = argv[i]
        if token == option:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError(f"{option} expects a value")
            value, i = argv[i + 1], i + 2
            continue
        if token.startswith(option + "="):
            value = token.partition("=")[2]
        else:
            rest.append(token)
        i += 1
    return value, rest


def model_from_initial_checkpoint(cfg: JobConfig) -> JobConfig:
    """``cfg`` building the model that ``checkpoint.initial_load_path`` describes, when it names
    a self-describing DCP checkpoint: ``model.name`` its family, ``model.flavor`` the reserved
    ``checkpoint`` (see ``build.flavor_args``). Otherwise ``cfg`` unchanged. Applied when the
    user named no recipe (``--module``) and no ``model.name``/``model.flavor``."""
    from titan_core.checkpoint.manager import checkpoint_model
    from titan_core.models import CHECKPOINT_FLAVOR

    path = cfg.checkpoint.initial_load_path
    found = None if not path or cfg.checkpoint.initial_load_in_hf else checkpoint_model(path)
    if found is None:
        return cfg
    model = dataclasses.replace(cfg.model, name=found[0], flavor=CHECKPOINT_FLAVOR)
    return dataclasses.replace(cfg, model=model)


class ConfigManager:
    """Resolves a ``JobConfig`` from defaults, a registry function, a TOML file and CLI flags.

    ``prog`` names the program in ``--help`` (default: taken from ``sys.argv[0]`` by tyro).
    """

    def __init__(self, config_cls: type[JobConfig] = JobConfig, prog: str | None = None) -> None:
        self.config_cls = config_cls
        self.prog = prog

    def parse_args(self, argv: list[str] | None = None) -> JobConfig:
        """Resolve the config from ``argv`` (default ``sys.argv[1:]``); ``--help`` exits."""
        argv = list(sys.argv[1:] if argv is None else argv)
        module, argv = _pop_option(argv, "--module")
        config, argv = _pop_option(argv, "--config")
        if module is not None and config is None:
            raise ConfigError(
                f"--module {module}: names the family of a --config recipe (e.g. --module llama3 "
                "--config llama3_debugmodel)"
            )
        if config is not None and module is None:  # recipe names are unique: find the family
            from titan_core.config.resolve import find_recipe

            module, config = find_recipe(config)
        base = self.config_cls() if module is None else load_registry_config(module, config or "")
        if "-h" in argv or "--help" in argv:
            self._help(base)
        values, tyro_argv = _scan_cli(argv, _schema(self.config_cls))
        given = set(values)
        if values.get("job.config_file"):
            toml_values = _toml_values(values["job.config_file"], base)
            given |= set(toml_values)
            base = _apply(base, toml_values)
        # Validate the overridden values here: tyro would turn a __post_init__ ConfigError
        # into its own multi-line error box and exit.
        _apply(base, values)
        cfg = self._tyro(base, tyro_argv)
        if module is None and not given & {"model.name", "model.flavor"}:
            cfg = model_from_initial_checkpoint(cfg)
        validate(cfg)
        return cfg

    def _tyro(self, base: JobConfig, args: list[str]) -> JobConfig:
        return tyro.cli(
            self.config_cls, default=base, args=args, prog=self.prog, description=_DESCRIPTION
        )

    def _help(self, base: JobConfig) -> None:
        """Print every key with ``base``'s values as defaults and raise ``SystemExit(0)``; each
        field's docstring is one paragraph (see ``_help_class``)."""
        cls = _help_class(self.config_cls)
        default = _help_copy(cls, base)
        tyro.cli(cls, default=default, args=["--help"], prog=self.prog, description=_DESCRIPTION)


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


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """Resolve a ``JobConfig`` from ``argv`` (see ``ConfigManager.parse_args``)."""
    return ConfigManager().parse_args(argv)


def to_dict(cfg: JobConfig) -> dict[str, Any]:
    """The config as nested plain dicts, one per section (and one per nested section)."""
    return dataclasses.asdict(cfg)


def to_toml(cfg: JobConfig) -> str:
    """The config as TOML text; loading it back with ``--job.config_file`` gives the same config."""
    return tomli_w.dumps(to_dict(cfg))


def flatten(cfg: JobConfig) -> dict[str, Scalar]:
    """Dotted keys to scalars (lists joined with commas), e.g. for MLflow params."""
    return flatten_tables(to_dict(cfg))


def flatten_tables(tables: dict[str, Any], prefix: str = "") -> dict[str, Scalar]:
    """Nested tables (``to_dict``, or a config's TOML) as dotted keys to scalars, lists joined
    with commas: ``{"launch": {"slurm": {"partition": "gpu"}}}`` -> ``launch.slurm.partition``."""
    out: dict[str, Scalar] = {}
    for name, value in tables.items():
        if isinstance(value, dict):
            out |= flatten_tables(value, f"{prefix}{name}.")
        else:
            out[prefix + name] = ",".join(map(str, value)) if isinstance(value, list) else value
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the resolved config as TOML; on a user error print one line to stderr, return 2."""
    try:
        cfg = ConfigManager(prog=_PROG).parse_args(argv)
    except ConfigError as e:
        print("error: " + str(e).replace("\n", " "), file=sys.stderr)
        return 2
    sys.stdout.write(to_toml(cfg))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
