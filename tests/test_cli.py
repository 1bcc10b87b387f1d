"""The ``titan`` commands built on ``titan_core.config.command``: a bad flag or value is one
``error:`` line naming it and exit code 2 (no traceback, nothing on stdout), ``--help`` exits 0,
lists the command's own options and says that config arguments are accepted."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable

import pytest

from flows.main import main as titan_main
from titan_core.config.command import CONFIG_NOTE, OVERRIDES_NOTE
from titan_core.convert.cli import main as convert_main
from titan_core.estimate.cli import main as estimate_main
from titan_core.evaluate.cli import main as eval_main

Main = Callable[[list[str] | None], int]
# Every `titan` subcommand, run in-process through the dispatcher: (its words, the required
# options of its argv, one own typed option given a word (an int or a float: "" for none), the
# config note its --help ends with ("" for a command that takes no config)).
COMMANDS: list[tuple[list[str], list[str], str, str]] = [
    (["train"], [], "--ngpu", CONFIG_NOTE),
    (["config"], [], "", ""),  # its --help is the config manager's: every key (below)
    (["launch"], [], "--timeout", CONFIG_NOTE),
    (["convert", "dcp-to-hf"], ["--checkpoint", "x", "--output", "y"], "", CONFIG_NOTE),
    (["convert", "hf-to-dcp"], ["--hf", "x", "--output", "y"], "", ""),
    (["data", "prepare"], [], "--workers", CONFIG_NOTE),
    (["data", "info"], [], "", ""),
    (["data", "verify"], [], "", ""),
    (["eval"], ["--checkpoint", "x"], "--max-batches", CONFIG_NOTE),
    (["estimate"], [], "--ngpu", CONFIG_NOTE),
    (["compare"], ["--experiment", "x"], "--max-runs", ""),
    (["pipeline", "run"], [], "", CONFIG_NOTE),
    (["pipeline", "deploy"], [], "", ""),
    (["sweep"], [], "--early-stop-margin", CONFIG_NOTE),
    (["demo"], [], "--steps", OVERRIDES_NOTE),
]
IDS = [" ".join(c[0]) for c in COMMANDS]
# Commands whose positional argument is required: (words, its name in the error).
POSITIONAL = {"data info": "URL", "data verify": "URL"}


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("words, required, typed, note", COMMANDS, ids=IDS)
def test_unknown_flag_is_one_line(
    words: list[str], required: list[str], typed: str, note: str, capsys
) -> None:
    assert titan_main([*words, *required, "--bogus-flag", "1"]) == 2
    assert _one_error_line(capsys).startswith("error: unknown option --bogus-flag")


@pytest.mark.parametrize("words, required, typed, note", COMMANDS, ids=IDS)
def test_bad_value_is_one_line(
    words: list[str], required: list[str], typed: str, note: str, capsys
) -> None:
    if typed:  # a number option given a word: named as typed and as --help shows it
        assert titan_main([*words, *required, typed, "many"]) == 2
        line = _one_error_line(capsys)
        assert re.fullmatch(rf"error: {typed}: expected an? (int|float), got 'many'", line), line
    if required:  # a required option left out
        assert titan_main([*words, *required[2:]]) == 2
        assert _one_error_line(capsys) == f"error: {required[0]}: required; expected a string"
    if " ".join(words) in POSITIONAL:
        assert titan_main(words) == 2
        name = POSITIONAL[" ".join(words)]
        assert _one_error_line(capsys) == f"error: missing {name}: expected a string"
    if not typed and (note or words == ["config"]):  # a config key given a bad value
        recipe = ["--config", "llama3_debugmodel_tiny"]
        assert titan_main([*words, *required, *recipe, "--training.steps", "many"]) == 2
        assert _one_error_line(capsys) == "error: --training.steps: expected an int, got 'many'"
    elif not typed:  # a command without config: a config key is an unknown option
        assert titan_main([*words, *required, "--training.steps", "3"]) == 2
        assert _one_error_line(capsys).startswith("error: unknown option --training.steps")


@pytest.mark.parametrize("words, required, typed, note", COMMANDS, ids=IDS)
def test_help_lists_own_options(
    words: list[str], required: list[str], typed: str, note: str, capsys
) -> None:
    assert titan_main([*words, "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for flag in [*required[::2], typed]:
        assert flag in out
    if words == ["config"]:  # the config manager's help lists every key
        assert "--training.steps" in out and "--module" in out
    elif note:
        assert " ".join(note.split()) in out
    else:
        assert "Config arguments" not in out and "Config overrides" not in out


def test_dispatcher_help_lists_every_command(capsys) -> None:
    assert titan_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"\n  {name} " in out for name in {c[0][0] for c in COMMANDS})
    for words in (["convert"], ["data"], ["pipeline"]):
        assert titan_main([*words, "--help"]) == 0
        assert "commands:" in capsys.readouterr().out
    assert titan_main([]) == 2
    assert _one_error_line(capsys).startswith("error: titan: no command; commands: train,")


def test_config_argument_errors_are_the_config_managers(capsys) -> None:
    assert estimate_main(["--training.stepz", "3"]) == 2
    assert _one_error_line(capsys).startswith("error: unknown option --training.stepz; did you")
    assert estimate_main(["--ngpus", "3"]) == 2
    assert _one_error_line(capsys) == "error: unknown option --ngpus; did you mean --ngpu?"
    assert eval_main(["--checkpoint", "x", "--max-batches", "3", "--evaluate.batches", "4"]) == 2
    assert _one_error_line(capsys) == (
        "error: --max-batches: an alias of --evaluate.batches, which is given too; give one"
    )
    assert convert_main(["dcp-to-hx"]) == 2
    assert "did you mean dcp-to-hf?" in _one_error_line(capsys)


def test_titan_subprocess_is_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "flows.main", "estimate", "--ngpu", "two"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "error: --ngpu: expected an int, got 'two'\n"
