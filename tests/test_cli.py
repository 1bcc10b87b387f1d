"""The ``titan`` commands built on ``titan_core.cli.command``: a bad flag or value is one
``error:`` line naming it and exit code 2 (no traceback, nothing on stdout), ``--help`` exits 0,
lists the command's own options and says that config arguments are accepted."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from titan_core.cli import main as titan_main
from titan_core.cli.command import CONFIG_NOTE, KEYS_NOTE, OVERRIDES_NOTE
from titan_core.cli.convert import main as convert_main
from titan_core.cli.estimate import main as estimate_main
from titan_core.cli.evaluate import main as eval_main

Main = Callable[[list[str] | None], int]


@dataclass(frozen=True)
class Row:
    """One ``titan`` subcommand, run in-process through the dispatcher."""

    words: list[str]
    own: str
    """its own options (and positional metavars) that its --help must list"""
    required: list[str] = field(default_factory=list)
    """the required options of its argv, with values"""
    typed: str = ""
    """one own option that takes a number ("": none)"""
    note: str = ""
    """what its --help says about config arguments ("": it takes no config)"""
    keys: bool = False
    """its --help lists every config key too"""


COMMANDS = [
    Row(["train"], "--ngpu --log-rank --dry-run", typed="--ngpu", note=KEYS_NOTE, keys=True),
    Row(["config"], "", keys=True),
    Row(["launch"], "--dry-run --timeout", typed="--timeout", note=CONFIG_NOTE),
    Row(
        ["convert", "dcp-to-hf"],
        "--checkpoint --output --dtype --max-shard-size --progress",
        ["--checkpoint", "x", "--output", "y"],
        note=CONFIG_NOTE,
    ),
    Row(["convert", "hf-to-dcp"], "--hf --output", ["--hf", "x", "--output", "y"]),
    Row(
        ["data", "prepare"],
        "SOURCE --out --text-field --tokenizer --validation-every --workers",
        typed="--workers",
        note=CONFIG_NOTE,
    ),
    Row(["data", "info"], "URL"),
    Row(["data", "verify"], "URL --checksum"),
    Row(
        ["eval"],
        "--checkpoint --output --hf-folder --max-batches --prompts --max-new-tokens "
        "--lm-eval-tasks --lm-eval-task-dir --lm-eval-limit",
        ["--checkpoint", "x"],
        typed="--max-batches",
        note=CONFIG_NOTE,
    ),
    Row(["estimate"], "--ngpu --json --device-memory", typed="--ngpu", note=CONFIG_NOTE),
    Row(
        ["compare"],
        "--experiment --runs --max-runs --log --parent-run-id --json",
        typed="--max-runs",
        note=CONFIG_NOTE,
    ),
    Row(["pipeline", "run"], "--run-id --verbose", note=CONFIG_NOTE),
    Row(["pipeline", "deploy"], "--prefect-file --pool --pool-type --name"),
    Row(
        ["sweep"],
        "--grid --random --trials --seed --concurrency --metric --deployment --early-stop "
        "--early-stop-min-steps --early-stop-min-trials --early-stop-window --early-stop-margin",
        typed="--early-stop-margin",
        note=CONFIG_NOTE,
    ),
    Row(["demo"], "--steps --raw-text --engine-only", typed="--steps", note=OVERRIDES_NOTE),
]
IDS = [" ".join(c.words) for c in COMMANDS]
# Commands whose positional argument is required: (words, its name in the error).
POSITIONAL = {"data info": "URL", "data verify": "URL"}


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("row", COMMANDS, ids=IDS)
def test_unknown_flag_is_one_line(row: Row, capsys) -> None:
    assert titan_main([*row.words, *row.required, "--bogus-flag", "1"]) == 2
    assert _one_error_line(capsys).startswith("error: unknown option --bogus-flag")
    assert titan_main([*row.words, *row.required, "-x"]) == 2  # not tyro's error box
    assert _one_error_line(capsys) == "error: unknown option -x: options look like --name value"


@pytest.mark.parametrize("row", COMMANDS, ids=IDS)
def test_bad_value_is_one_line(row: Row, capsys) -> None:
    words, required, typed = row.words, row.required, row.typed
    if typed:  # a number option given a word: named as typed and as --help shows it
        assert titan_main([*words, *required, typed, "many"]) == 2
        line = _one_error_line(capsys)
        expected = rf"error: {typed}: expected an? (int|(finite )?float), got 'many'"
        assert re.fullmatch(expected, line), line
    if required:  # a required option left out
        assert titan_main([*words, *required[2:]]) == 2
        assert _one_error_line(capsys) == f"error: {required[0]}: required; expected a string"
    if " ".join(words) in POSITIONAL:
        assert titan_main(words) == 2
        name = POSITIONAL[" ".join(words)]
        assert _one_error_line(capsys) == f"error: missing {name}: expected a string"
    if not typed and (row.note or row.keys):  # a config key given a bad value
        recipe = ["--config", "llama3_debugmodel_tiny"]
        assert titan_main([*words, *required, *recipe, "--training.steps", "many"]) == 2
        assert _one_error_line(capsys) == "error: --training.steps: expected an int, got 'many'"
    elif not typed:  # a command without config: a config key is an unknown option
        assert titan_main([*words, *required, "--training.steps", "3"]) == 2
        assert _one_error_line(capsys).startswith("error: unknown option --training.steps")


@pytest.mark.parametrize("row", COMMANDS, ids=IDS)
def test_help_lists_own_options(row: Row, capsys) -> None:
    assert titan_main([*row.words, "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for flag in row.own.split():
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", out), flag
    if row.keys:  # the config manager's help: every key
        assert "--training.steps" in out and "--job.dump-folder" in out
    if row.note:  # said once: the description does not repeat it
        assert " ".join(row.note.split()) in out
        assert len(re.findall("Config (arguments|overrides)", out)) == 1
        assert row.note == OVERRIDES_NOTE or "config override" not in out
    else:
        assert "Config arguments" not in out and "Config overrides" not in out


@pytest.mark.parametrize("words", [["compare"], ["pipeline", "run"], ["data", "prepare"]])
def test_description_does_not_repeat_the_config_note(words: list[str], capsys) -> None:
    """The config arguments are the note's to describe: the command's own text (no synopsis of
    them) names none of them again."""
    assert titan_main([*words, "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    description = out.split("╭")[0].replace(" ".join(CONFIG_NOTE.split()), "")
    assert len(description) < len(out.split("╭")[0])  # the note was there
    repeats = r"--module|--section\.field|--config RECIPE|--config-file PATH|\[--config"
    assert not re.findall(repeats, description), description


def test_notes_differ_in_where_the_keys_are_listed() -> None:
    """KEYS_NOTE is CONFIG_NOTE pointing at the keys listed below instead of titan config."""
    assert CONFIG_NOTE.endswith(" (titan config --help lists them all).")
    assert KEYS_NOTE.endswith(" (listed below, with the defaults of --config RECIPE).")
    same = CONFIG_NOTE.removesuffix(" (titan config --help lists them all).")
    assert KEYS_NOTE.startswith(same) and same.endswith("--section.field VALUE of the job config")


@pytest.mark.parametrize("words", [["train"], ["config"]])
def test_help_lists_the_keys_with_the_recipes_defaults(words: list[str], capsys) -> None:
    assert titan_main([*words, "--config", "llama3_debugmodel_tiny", "--help"]) == 0
    out = " ".join(re.sub(r"[│╭╰─╮╯]", " ", capsys.readouterr().out).split())
    assert "--job.dump-folder STR" in out and "(default: ./outputs/llama3_debugmodel_tiny)" in out
    assert ("--ngpu INT" in out) == (words == ["train"])


def test_dispatcher_help_lists_every_command(capsys) -> None:
    assert titan_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"\n  {name} " in out for name in {c.words[0] for c in COMMANDS})
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
        [sys.executable, "-m", "titan_core.cli", "estimate", "--ngpu", "two"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "error: --ngpu: expected an int, got 'two'\n"


def test_values_may_start_with_a_dash(capsys) -> None:
    from titan_core.cli.sweep import COMMAND as SWEEP

    argv = ["--grid", "model.n_layers=-1,2", "--early-stop-margin", "-0.1", "--seed", "-3"]
    ns = SWEEP.parse(argv).options
    assert (ns.grid, ns.early_stop_margin, ns.seed) == (["model.n_layers=-1,2"], -0.1, -3)
    # A list option's value is the sweep's to check: its own one line, not tyro's box.
    assert titan_main(["sweep", "--grid", "-x"]) == 2
    assert _one_error_line(capsys).startswith("error: --grid '-x': expected KEY=VALUES")
    assert titan_main(["data", "info", "-x"]) == 2
    assert _one_error_line(capsys) == "error: unknown option -x: options look like --name value"


def test_config_file_spellings_mean_the_same(tmp_path, capsys) -> None:
    from titan_core.cli.pipeline import PIPELINE_RUN, flow_kwargs
    from titan_core.cli.sweep import sweep_kwargs

    job = tmp_path / "job.toml"
    job.write_text("[training]\nsteps = 7\n")
    spellings = ["--config-file", "--config_file", "--job.config_file", "--job.config-file"]
    printed = []
    for flag in spellings:
        assert titan_main(["config", flag, str(job)]) == 0
        printed.append(capsys.readouterr().out)
        # The pipeline applies the file onto the defaults, not onto its default recipe.
        kwargs = flow_kwargs(PIPELINE_RUN.parse([flag, str(job)]).config)
        assert (kwargs["recipe"], kwargs["config_file"]) == ("", str(job))
    assert "\nsteps = 7\n" in printed[0] and printed.count(printed[0]) == len(spellings)
    sweep = sweep_kwargs(["--job.config_file", str(job), "--grid", "debug.seed=1,2"])
    assert (sweep["recipe"], sweep["config_file"]) == ("", str(job))
    assert titan_main(["config", "--config-file", str(job), "--job.config_file", "b.toml"]) == 2
    assert _one_error_line(capsys) == (
        f"error: --config-file: given twice (--config-file {job}, --job.config_file b.toml); "
        "give one"
    )


def test_train_dry_run_checks_the_config_first(capsys) -> None:
    assert titan_main(["train", "--dry-run", "--training.steps", "many"]) == 2
    assert _one_error_line(capsys) == "error: --training.steps: expected an int, got 'many'"


@pytest.mark.parametrize(
    "words", [["demo"], ["pipeline", "run"], ["sweep", "--grid", "debug.seed=1,2"]]
)
def test_a_bad_override_writes_nothing(words: list[str], tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PREFECT_HOME", raising=False)  # its default is under ./outputs
    assert titan_main([*words, "--training.steps", "many"]) == 2
    assert _one_error_line(capsys) == "error: --training.steps: expected an int, got 'many'"
    assert list(tmp_path.iterdir()) == []
