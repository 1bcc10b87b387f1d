"""Config values from a TOML file: ``[section]`` tables (``[launch.slurm]`` nested) checked
against the schema, old keys read as their new names.

A local path or any fsspec URL. Every error is one ``ConfigError`` line naming the file and the
key: an unknown section or key (with suggestions), a value of the wrong type, a file that is
missing, a folder, not UTF-8 or not TOML.
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import fsspec

from titan_core.config.job import JobConfig
from titan_core.config.schema import (
    Spec,
    did_you_mean,
    from_value,
    moved_key,
    schema,
    sections,
    with_values,
)
from titan_core.errors import ConfigError
from titan_core.logging import logger


def read_toml(path: str) -> dict[str, Any]:
    """The tables of the TOML file at ``path``; one-line ``ConfigError`` when it can't be read."""
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
    return with_values(base, toml_values(str(path), base))


def toml_values(path: str, base: JobConfig) -> dict[str, Any]:
    """The dotted-key values the TOML file at ``path`` sets, type-checked against ``base``."""
    specs = schema(type(base))
    top = {key.split(".")[0] for key in specs}
    values: dict[str, Any] = {}
    moved: dict[str, tuple[str, Any]] = {}
    for section, table in read_toml(path).items():
        section_key = section.replace("-", "_")
        if not isinstance(table, dict) and section_key in top:
            raise ConfigError(f"{path}: {section} must be a [{section}] table, got {table!r}")
        if not isinstance(table, dict):
            hint = did_you_mean(section_key, specs, "")
            raise ConfigError(f"{path}: key {section!r} is outside any [section] table{hint}")
        if section_key not in top:
            raise _unknown_section(path, section, section_key, top)
        found, old = _table_values(path, section, section_key, table, type(base))
        values |= found
        moved |= old
    return values | _moved_values(path, moved, values, specs)


def _moved_values(
    path: str, moved: dict[str, tuple[str, Any]], values: dict[str, Any], specs: dict[str, Spec]
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
            out[key] = _toml_value(path, key, specs[key], value)
            read.append(f"{old} as {key}")
    if read:
        logger.warning("%s: old keys read as their new names: %s", path, ", ".join(read))
    if ignored:
        logger.warning(
            "%s: old keys ignored, the file sets their new names: %s", path, ", ".join(ignored)
        )
    return out


def _unknown_section(path: str, shown: str, key: str, known: Iterable[str]) -> ConfigError:
    close = difflib.get_close_matches(key, sorted(known), n=3)
    hint = "; did you mean " + " or ".join(f"[{c}]" for c in close) + "?" if close else ""
    return ConfigError(f"{path}: unknown section [{shown}]{hint}")


def _table_values(
    path: str, shown: str, section: str, table: dict[str, Any], cls: type
) -> tuple[dict[str, Any], dict[str, tuple[str, Any]]]:
    """The dotted-key values of TOML table ``[shown]`` (section ``section``), nested tables
    (``[launch.slurm]``) included, type-checked; and the values it gives under old keys, as
    new key -> (old key, value) (read by ``_moved_values``)."""
    specs, known = schema(cls), sections(cls)
    values: dict[str, Any] = {}
    moved: dict[str, tuple[str, Any]] = {}
    for name, value in table.items():
        key, where = f"{section}.{name.replace('-', '_')}", f"{shown}.{name}"
        if key in known:
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: {where} must be a [{where}] table, got {value!r}")
            found, old = _table_values(path, where, key, value, cls)
            values |= found
            moved |= old
            continue
        if isinstance(value, dict) and key not in specs:
            nested = [s for s in known if s.startswith(section + ".")]
            raise _unknown_section(path, where, key, nested)
        new_key = None if key in specs else moved_key(key, specs)
        if new_key is not None:
            moved[new_key] = (key, value)
            continue
        if key not in specs:
            hint = did_you_mean(key, specs, "")
            raise ConfigError(f"{path}: unknown key {where}{hint}")
        values[key] = _toml_value(path, key, specs[key], value)
    return values, moved


def _toml_value(path: str, key: str, spec: Spec, value: Any) -> Any:
    """A TOML value checked against the field's spec; one-line ConfigError otherwise."""
    try:
        return from_value(spec, value)
    except ValueError:
        expected = spec.describe(value)
        raise ConfigError(f"{path}: {key}: expected {expected}, got {value!r}") from None
