"""The ``titan`` commands as views of the job config, and their one error path.

A command declares its OWN options as a small dataclass: each field is a flag (``--field-name``;
underscores work too), its docstring the help, its default the default; a field without a
default is a required option, a ``tyro.conf.Positional`` field takes the positional arguments
and a nested dataclass gives dotted flags (``--tracking.uri``). tyro prints ``--help``; it never
parses (its error box is no one-line error). ``Command.parse`` splits the argv:

- config arguments (``--module``, ``--config``, ``--config-file`` (``--job.config-file`` is the
  same) and every ``--section.field`` with the values after it) become ``ConfigArgs``, handed
  unchanged to the resolver (``titan_core.resolve``: ``parse_args`` or ``resolve_job``):
  every config key is a flag of every command that takes a config;
- the command's own flags are checked by the config's checker (``config.argv.scan_argv`` on the
  dataclass's schema), so an unknown flag, a missing required option or a value of the wrong
  type is one ``ConfigError`` line in the same words as a bad config key; the options dataclass
  is built from the values so checked. A token that starts with ``--`` is a flag, any other a
  value (``--margin -0.1``) or a positional argument (where ``-x`` is an unknown option).

``run`` is the one error path of every entry point (``titan``, ``python -m titan_core.cli``,
``python -m titan_core.config.manager``): a ``TitanError`` is one ``error:`` line on stderr and
its exit code (2), a failed launch one line and 1. ``dispatch`` runs a subcommand named by the
first argument (``titan convert dcp-to-hf``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import re
import signal
import sys
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import tyro

from titan_core.config.argv import lookup, pop_option, scan_argv
from titan_core.config.job import JobConfig
from titan_core.config.schema import Spec, did_you_mean, field_specs
from titan_core.config.schema import schema as config_schema
from titan_core.errors import ConfigError, TitanError

T = TypeVar("T")
Main = Callable[[list[str]], int]

_CONFIG_ARGS = (
    "Config arguments are accepted too: --module FAMILY --config RECIPE (a registry recipe; "
    "--module is optional), --config-file PATH (a TOML job config, the same as "
    "--job.config-file) and every --section.field VALUE of the job config"
)
CONFIG_NOTE = f"{_CONFIG_ARGS} (titan config --help lists them all)."
# The note of a command whose --help lists the config keys itself (``Command.config_help``).
KEYS_NOTE = f"{_CONFIG_ARGS} (listed below, with the defaults of --config RECIPE)."
OVERRIDES_NOTE = (
    "Config overrides are accepted too: every --section.field VALUE of the job config (titan "
    "config --help lists them all)."
)
# Config arguments that are not --section.field: how each is spelled on the command line.
_SELECTORS = {"module": "--module", "config": "--config", "config_file": "--config-file"}
_CONFIG_FILE_FLAGS = ("--config-file", "--config_file", "--job.config_file", "--job.config-file")
_POSITIONAL = typing.get_args(tyro.conf.Positional[str])[1]


@dataclass(frozen=True)
class ConfigArgs:
    """The config arguments of a command line, as given (``""``: not given)."""

    module: str = ""
    config: str = ""
    config_file: str = ""
    overrides: tuple[str, ...] = ()

    def given(self) -> bool:
        """Whether any config argument was given."""
        return bool(self.module or self.config or self.config_file or self.overrides)

    def argv(self) -> list[str]:
        """The resolver's argv: ``--module``/``--config``, ``--job.config_file``, then the
        ``--section.field`` overrides."""
        out = ["--module", self.module] if self.module else []
        out += ["--config", self.config] if self.config else []
        out += ["--job.config_file", self.config_file] if self.config_file else []
        return out + list(self.overrides)

    def override_keys(self) -> set[str]:
        """The dotted keys the overrides name (either spelling)."""
        return {
            t[2:].partition("=")[0].replace("-", "_") for t in self.overrides if t.startswith("--")
        }


@dataclass(frozen=True)
class Parsed(Generic[T]):
    """A parsed command line: the options, the typed values of the own options given (by field
    name; a nested one by dotted name) and the config arguments."""

    options: T
    given: dict[str, Any]
    config: ConfigArgs


@dataclass
class _Split:
    """An argv taken apart: own scalar flags (for ``scan_argv``), own list values, positional
    arguments and config arguments."""

    own: list[str] = field(default_factory=list)
    lists: dict[str, list[str]] = field(default_factory=dict)
    positionals: list[str] = field(default_factory=list)
    config: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Command(Generic[T]):
    """One ``titan`` command: its program name, its own options and what its ``--help`` says.

    ``takes_config``: config arguments are accepted (else a dotted flag is an unknown option).
    ``aliases``: own options that stand for a config key (field name -> key), see
    ``alias_values``. ``renamed``: old flags that became config keys (old flag -> new flag),
    refused in one line naming the key and hidden from ``--help``. ``note``: what ``--help``
    says about config arguments (``OVERRIDES_NOTE`` where the command picks the recipe).
    ``config_help``: ``--help`` lists every config key too, with the defaults of the recipe
    that ``--config`` names (``titan train``, ``titan config``). ``short``: one-letter spellings
    of own flags (``-v`` -> ``--verbose``; ``tyro.conf.arg(aliases=...)`` shows them in
    ``--help``).
    """

    prog: str
    options: type[T]
    description: str
    takes_config: bool = True
    aliases: Mapping[str, str] = field(default_factory=dict)
    renamed: Mapping[str, str] = field(default_factory=dict)
    note: str = CONFIG_NOTE
    config_help: bool = False
    short: Mapping[str, str] = field(default_factory=dict)

    def parse(self, argv: list[str]) -> Parsed[T]:
        """Parse ``argv``; ``-h``/``--help`` prints the help and raises ``SystemExit(0)``."""
        if "-h" in argv or "--help" in argv:
            self._help(argv)
        argv = [self.short.get(token, token) for token in argv]
        schema = _options_schema(self.options)
        try:
            return self._parse(argv, schema)
        except ConfigError as e:
            raise ConfigError(_as_shown(str(e), schema)) from None

    def _parse(self, argv: list[str], schema: dict[str, Spec]) -> Parsed[T]:
        split = self._split(argv)
        values = scan_argv(split.own, schema)
        values |= split.lists
        positional = _positional_field(self.options)
        if positional:
            values[positional] = self._positional_value(positional, schema, split.positionals)
        elif split.positionals:
            raise ConfigError(
                f"unexpected argument {split.positionals[0]!r}: options look like --name value"
            )
        self._check_required(values, schema)
        return Parsed(_build(self.options, values), values, self._config_args(split.config))

    def alias_values(self, parsed: Parsed[T]) -> dict[str, Any]:
        """The config values the alias options given stand for (config key -> value); an alias
        given together with its key is a ``ConfigError``."""
        keys = parsed.config.override_keys()
        out = {}
        for name, key in self.aliases.items():
            if name not in parsed.given:
                continue
            if key in keys:
                raise ConfigError(
                    f"{_flag(name)}: an alias of --{key}, which is given too; give one"
                )
            out[key] = parsed.given[name]
        return out

    def _help(self, argv: list[str]) -> None:
        """Print the help and raise ``SystemExit(0)``: the own options (tyro's), then with
        ``config_help`` the config's help (every key, with the defaults of the recipe
        that ``argv`` names)."""
        if not self.config_help:
            self._tyro(["--help"])
        if dataclasses.fields(self.options):  # type: ignore[arg-type]
            with contextlib.suppress(SystemExit):
                self._tyro(["--help"])
            print()
        from titan_core.resolve import parse_args

        recipe = self._config_args([t for t in argv if t not in ("-h", "--help")])
        recipe = dataclasses.replace(recipe, config_file="", overrides=())
        parse_args([*recipe.argv(), "--help"], self.prog)

    def _tyro(self, args: list[str]) -> T:
        """tyro on ``args``: only ever ``--help`` (it prints the help and exits 0)."""
        description = unwrap(self.description.strip().replace("``", ""))
        if self.takes_config:
            description += "\n\n" + (KEYS_NOTE if self.config_help else self.note)
        return tyro.cli(self.options, args=args, prog=self.prog, description=description)

    def _split(self, argv: list[str]) -> _Split:
        """Sort each token: an own flag and its values, a config argument and the values after
        it (up to the next flag), or a positional argument."""
        out = _Split()
        schema = _options_schema(self.options)
        target, room = "positional", 0  # where a bare token goes; how many own values are left
        for token in argv:
            if token.startswith("--"):
                target, room, key = self._route(token, schema)
                if target == "list":
                    items = out.lists.setdefault(key, [])
                    _, has_inline, inline = token.partition("=")
                    items += [inline] if has_inline else []
                elif target == "config":
                    out.config.append(token)
                else:
                    out.own.append(token)
            elif target == "config":
                out.config.append(token)
            elif target == "list":
                items.append(token)
            elif room:
                out.own.append(token)
                room -= 1
            elif re.fullmatch(r"-[^\d.].*", token):
                raise ConfigError(f"unknown option {token}: options look like --name value")
            else:
                out.positionals.append(token)
        return out

    def _route(self, token: str, schema: dict[str, Spec]) -> tuple[str, int, str]:
        """Where ``token`` (a ``--flag``) goes: ``config``, ``list`` (an own list option) or
        ``own``; how many values follow it; its own key. One line for unknown or renamed
        flags."""
        name, has_inline, _ = token[2:].partition("=")
        if "--" + name in self.renamed:
            new = self.renamed["--" + name]
            raise ConfigError(f"--{name}: now the config key {new}; use {new} VALUE")
        key = name.replace("-", "_")
        own = key in schema or key.removeprefix("no_") in schema
        if self.takes_config and not own and ("." in key or key in _SELECTORS):
            return "config", 0, ""
        if not own and self.takes_config:  # suggest config keys too: --steps -> --training.steps
            hint = did_you_mean(key, {**schema, **config_schema(JobConfig)}, "--")
            raise ConfigError(f"unknown option --{name}{hint or ' (see --help for the options)'}")
        key, _ = lookup(name, schema)  # an unknown own flag: one line with suggestions
        kind = schema[key].kind
        if kind == "list":
            assert schema[key].item == Spec("str"), f"{key}: own list options are list[str]"
            return "list", 0, key
        return "own", 0 if kind == "bool" or has_inline else 1, key

    def _positional_value(self, name: str, schema: dict[str, Spec], given: list[str]) -> Any:
        """The positional arguments as the value of field ``name``: a list, or exactly one."""
        if schema[name].kind == "list":
            return list(given)
        if not given:
            raise ConfigError(f"missing {name.upper()}: expected {schema[name].describe()}")
        if len(given) > 1:
            raise ConfigError(f"unexpected argument {given[1]!r}: takes one {name.upper()}")
        return given[0]

    def _check_required(self, values: dict[str, Any], schema: dict[str, Spec]) -> None:
        """A required own option (a field without a default) that was not given is an error."""
        for f in dataclasses.fields(self.options):  # type: ignore[arg-type]
            missing = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if missing and f.name not in values:
                raise ConfigError(
                    f"{_flag(f.name)}: required; expected {schema[f.name].describe()}"
                )

    def _config_args(self, tokens: list[str]) -> ConfigArgs:
        """The config arguments: the selectors taken out (``--job.config_file`` is
        ``--config-file``, in every spelling), the overrides as given."""
        found = {}
        for name in ("module", "config"):
            value, tokens = pop_option(tokens, _SELECTORS[name])
            found[name] = value or ""
        files = {}
        for flag in _CONFIG_FILE_FLAGS:
            value, tokens = pop_option(tokens, flag)
            files |= {flag: value} if value is not None else {}
        if len(set(files.values())) > 1:
            given = ", ".join(f"{flag} {value}" for flag, value in files.items())
            raise ConfigError(f"--config-file: given twice ({given}); give one")
        found["config_file"] = next(iter(files.values()), "")
        return ConfigArgs(**found, overrides=tuple(tokens))


def default(text: str) -> Any:
    """A field's ``--help`` default in words, for ``Annotated[type, default("...")]``: an
    alias's value comes from the config, an empty string means "computed"."""
    return tyro.conf.arg(help_behavior_hint=f"(default: {text})")


def unwrap(text: str) -> str:
    """``text`` with each prose paragraph on one line (the terminal wraps it), indented blocks
    (usage examples) kept as written: ``--help`` shows a docstring's paragraphs whole."""
    paragraphs = []
    for block in text.split("\n\n"):
        lines = block.splitlines()
        if any(line.startswith(" ") for line in lines):
            paragraphs.append(block)
        else:
            paragraphs.append(" ".join(line.strip() for line in lines))
    return "\n\n".join(paragraphs)


def _as_shown(message: str, schema: dict[str, Spec]) -> str:
    """``message`` with each own option spelled as the user types it and ``--help`` shows it
    (``--max-batches``, ``--no-json``), not as the checker's key (``--max_batches``)."""

    def shown(match: re.Match[str]) -> str:
        name = match.group(1)
        own = name in schema or name.removeprefix("no_") in schema
        return _flag(name) if own else match.group(0)

    return re.sub(r"--([\w.]+)", shown, message)


def _build(cls: type[T], values: Mapping[str, Any], prefix: str = "") -> T:
    """An options instance of ``cls`` from the checked ``values`` (by field name, dotted for a
    nested dataclass's fields); the fields not given keep their defaults."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        key = prefix + f.name
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], values, key + ".")
        elif key in values:
            kwargs[f.name] = values[key]
    return cls(**kwargs)


def _flag(name: str) -> str:
    """The command-line flag of an own option's field name."""
    return "--" + name.replace("_", "-")


@functools.cache
def _options_schema(cls: type) -> dict[str, Spec]:
    """What each own option of ``cls`` accepts, by field name (dotted for a nested one)."""
    return field_specs(cls)


@functools.cache
def _positional_field(cls: type) -> str:
    """The name of the ``tyro.conf.Positional`` field of ``cls`` ("" when none)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    names = [name for name, hint in hints.items() if _POSITIONAL in typing.get_args(hint)[1:]]
    assert len(names) <= 1, f"{cls.__name__}: at most one positional field"
    return names[0] if names else ""


def run(main: Main, argv: list[str] | None = None) -> int:
    """Run a command's ``main`` on ``argv`` (default ``sys.argv[1:]``): the one error path.

    A user error (``TitanError``: ConfigError, DataError, CheckpointError, ...) is one
    ``error: <message>`` line on stderr and its exit code (2; 3 for ``CommError``); a failed
    launch (``LaunchError``, already summarised) one line and 1, or the ranks' 2 or 4 where
    a relaunch would fail the same way; Ctrl-C one line and 130; ``--help`` (tyro's
    ``SystemExit(0)``) returns 0. Anything else is a bug and keeps its traceback.
    """
    try:
        return main(list(sys.argv[1:] if argv is None else argv))
    except TitanError as e:
        _print_error(e)
        return e.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except SystemExit as e:
        if e.code in (0, None):
            return 0
        raise
    except Exception as e:
        # Only launch code raises a LaunchError, and it has imported the module then: looked up
        # rather than imported, so that commands that launch nothing never import torch here
        # (and a Ctrl-C during that import would be a traceback).
        failures = sys.modules.get("titan_core.launch.failures")
        if failures is None or not isinstance(e, failures.LaunchError):
            raise
        _print_error(e)
        return e.exit_code


def _print_error(e: BaseException) -> None:
    print("error: " + str(e).strip().replace("\n", " "), file=sys.stderr)


def dispatch(
    prog: str, description: str, commands: Mapping[str, tuple[str, Main]], argv: list[str]
) -> int:
    """Run the subcommand that ``argv``'s first token names (``commands``: name -> (help,
    main)) with the rest; ``-h``/``--help`` first lists the subcommands."""
    if argv[:1] in (["-h"], ["--help"]):
        width = max(map(len, commands)) + 2
        lines = [f"  {name:<{width}}{text}" for name, (text, _) in commands.items()]
        text = unwrap(description.strip().replace("``", ""))
        print(f"usage: {prog} {{{','.join(commands)}}} ...\n\n{text}\n\ncommands:")
        print("\n".join(lines) + f"\n\n{prog} COMMAND --help: the options of a command.")
        return 0
    name = argv[0] if argv else ""
    if name not in commands:
        close = difflib.get_close_matches(name, list(commands), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        got = f"unknown command {name!r}" if name else "no command"
        raise ConfigError(f"{prog}: {got}; {hint}commands: {', '.join(commands)}")
    return commands[name][1](argv[1:])
