"""``titan config``: print the resolved config as TOML; ``--help`` lists every config key with
the defaults of the recipe that ``--config`` names. ``python -m titan_core.config.manager`` is
the same command under torchtitan's name."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

from titan_core.cli.command import Command, run


@dataclass
class ConfigOptions:
    """``titan config`` has no options of its own: config arguments only."""


CONFIG = Command(
    "titan config", ConfigOptions, "Print the resolved config as TOML.", config_help=True
)


def main(argv: list[str]) -> int:
    """``titan config`` on ``argv``."""
    return config_main(argv)


def config_main(argv: list[str] | None = None, prog: str = CONFIG.prog) -> int:
    """Print the config that ``argv`` resolves to as TOML (``--help``: every key, under the
    program name ``prog``); a user error is one ``error:`` line and exit code 2."""
    command = dataclasses.replace(CONFIG, prog=prog)

    def show(args: list[str]) -> int:
        from titan_core.config.schema import to_toml
        from titan_core.resolve import parse_args

        sys.stdout.write(to_toml(parse_args(command.parse(args).config.argv(), prog)))
        return 0

    return run(show, argv)
