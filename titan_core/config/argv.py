"""Config values from command-line tokens: ``--section.field value`` checked against a schema.

The one checker of every ``titan`` command line: the job config's keys (``cli_values``) and a
command's own options (``scan_argv`` on the options' ``field_specs``) are read by the same code,
so an unknown flag or a bad value is the same one-line ``ConfigError`` everywhere. Hyphens and
underscores are the same; booleans are flags (``--section.field`` / ``--section.no_field``);
lists take several values or one comma-separated value.
"""

from __future__ import annotations

from typing import Any

from titan_core.config.job import JobConfig
from titan_core.config.schema import Spec, did_you_mean, from_text, negated, schema
from titan_core.errors import ConfigError


def lookup(name: str, specs: dict[str, Spec]) -> tuple[str, bool]:
    """Resolve a command-line option name (hyphens or underscores) to ``(key, negated)``; an
    unknown name is a one-line ``ConfigError`` with suggestions."""
    key = name.replace("-", "_")
    if key in specs:
        return key, False
    section, _, field_name = key.rpartition(".")
    positive = f"{section}.{field_name.removeprefix('no_')}".lstrip(".")
    if field_name.startswith("no_") and positive in specs and specs[positive].kind == "bool":
        return positive, True
    hint = did_you_mean(key, specs, "--") or " (see --help for the options)"
    raise ConfigError(f"unknown option --{name}{hint}")


def _convert(key: str, spec: Spec, texts: list[str]) -> Any:
    """Convert the value tokens given for ``--key``; one-line ConfigError when they do not fit."""
    if spec.kind == "list":
        assert spec.item is not None
        items = [part for text in texts for part in text.split(",") if part]
        converted = []
        for item in items:
            try:
                converted.append(from_text(spec.item, item))
            except ValueError:
                expected = spec.describe(_number(item))
                raise ConfigError(f"--{key}: expected {expected}, got {item!r}") from None
        return converted
    if not texts:
        raise ConfigError(f"--{key}: expected a value ({spec.describe()})")
    try:
        return from_text(spec, texts[0])
    except ValueError:
        expected = spec.describe(_number(texts[0]))
        raise ConfigError(f"--{key}: expected {expected}, got {texts[0]!r}") from None


def _number(text: str) -> float | None:
    """``text`` as a float, for the error's words (a float its dtype cannot hold), or None."""
    try:
        return float(text)
    except ValueError:
        return None


def _take_values(argv: list[str], i: int, spec: Spec) -> tuple[list[str], int]:
    """The value tokens from ``argv[i]``: up to the next option for lists, else one."""
    end = i
    limit = len(argv) if spec.kind == "list" else min(i + 1, len(argv))
    while end < limit and not argv[end].startswith("--"):
        end += 1
    return argv[i:end], end


def scan_argv(argv: list[str], specs: dict[str, Spec]) -> dict[str, Any]:
    """The typed values of ``--key value`` tokens, checked against ``specs``."""
    values: dict[str, Any] = {}
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
        key, is_negated = lookup(name, specs)
        spec = specs[key]
        if spec.kind == "bool":
            if has_inline or (i < len(argv) and not argv[i].startswith("--")):
                shown = token if has_inline else f"{token} {argv[i]}"
                raise ConfigError(
                    f"{shown}: boolean options are flags; use --{negated(key)} "
                    f"(or --{key} to enable)"
                )
            values[key] = not is_negated
            continue
        if has_inline:
            texts = [inline]
        else:
            texts, i = _take_values(argv, i, spec)
        values[key] = _convert(key, spec, texts)
    return values


def cli_values(argv: list[str], config_cls: type = JobConfig) -> dict[str, Any]:
    """Typed dotted-key values of ``--section.field value`` tokens (as ``titan train`` reads
    them: ``--section.no_field`` for False, lists as several or comma-separated values)."""
    return scan_argv(list(argv), schema(config_cls))


def pop_option(argv: list[str], option: str) -> tuple[str | None, list[str]]:
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
