"""Every ``titan … --help`` lists the same commands and options as before the house moved.

``tests/data/help_before_house.json`` is each command's ``--help`` (at 100 columns) taken on
main before the config, CLI and pipeline layers were reorganised (issue 21), committed before
the change. The prose may improve; the commands, the options with their value types, and the
positional arguments may not change, except config keys renamed through
``titan_core.config.schema.RENAMED_KEYS``, which must appear under their new names, and config
keys added since (``helpers.ADDED_KEYS``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import ADDED_KEYS

from titan_core.cli import main as titan
from titan_core.config.schema import RENAMED_KEYS, schema

SNAPSHOT = json.loads((Path(__file__).parent / "data" / "help_before_house.json").read_text())
_BOX_ENTRY = re.compile(r"^│ (\S.*?)(?:\s{2,}|\s*│$)")


def _renamed_flags() -> dict[str, str]:
    """Old flag -> new flag for every renamed key (booleans' ``--no-`` spelling too)."""
    specs = schema()
    out = {}
    for old, (new, _) in RENAMED_KEYS.items():
        out[_flag(old)] = _flag(new)
        if new in specs and specs[new].kind == "bool":
            out[_flag(_no(old))] = _flag(_no(new))
    return out


# Command options (not config keys) added since the snapshot, by command.
ADDED_OPTIONS = {"titan pipeline run": {"-v", "--verbose", "--no-verbose"}}  # issue 36
ADDED_OPTIONS["titan sweep"] = {"--early-stop-metric"}  # issue 38: early stopping on any metric


def _no(key: str) -> str:
    section, _, name = key.rpartition(".")
    return f"{section}.no_{name}"


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def listed(text: str) -> set[str]:
    """What a help text offers: subcommands, options (with their metavar) and positionals."""
    lines = text.splitlines()
    found: set[str] = set()
    usage = lines[0]
    if m := re.search(r"\{([\w,-]+)\}", usage):
        found |= {f"command {c}" for c in m.group(1).split(",")}
    in_commands = False
    for line in lines:
        if line == "commands:":
            in_commands = True
            continue
        if in_commands:
            if m := re.match(r"^  (\S+)\s{2,}", line):
                found.add(f"command {m.group(1)}")
            elif not line.strip():
                in_commands = False
            continue
        if m := _BOX_ENTRY.match(line):
            entry = m.group(1).strip()
            for part in entry.split(", "):
                words = part.split()
                if words and (words[0].startswith("-") or words[0].isupper()):
                    found.add(" ".join(words[:2]))
    return found


@pytest.mark.parametrize("command", sorted(SNAPSHOT), ids=lambda c: c.replace(" ", "_"))
def test_help_lists_the_same_commands_and_options(
    command: str, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("TERM", "dumb")
    assert titan([*command.split()[1:], "--help"]) == 0
    now = listed(capfd.readouterr().out)
    renamed = _renamed_flags()
    before = set()
    for entry in listed(SNAPSHOT[command]):
        flag, _, rest = entry.partition(" ")
        before.add(f"{renamed[flag]} {rest}".strip() if flag in renamed else entry)
    assert len(before) >= 2, f"{command}: the snapshot lists too little to compare"
    assert sorted(before - now) == [], f"{command} --help lost these"
    added = {_flag(k) for k in ADDED_KEYS} | {_flag(_no(k)) for k in ADDED_KEYS}
    added |= ADDED_OPTIONS.get(command, set())
    gained = sorted(e for e in now - before if e.split()[0] not in added)
    assert gained == [], f"{command} --help gained these (add them to ADDED_KEYS?)"
