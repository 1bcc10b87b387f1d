"""Every `titan`, `run_train.sh` and config-manager command in README.md and docs/ resolves;
every `titan launch --dry-run` in them runs and prints the plan; the shown batch script is the
real one; the named TOML files and the example backend in the docs work."""

from __future__ import annotations

import os
import re
import shlex
import textwrap
from pathlib import Path

import pytest

from titan_core.config.job import Launch
from titan_core.models import family_names
from titan_core.resolve import parse_args

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Flags of the launchers that are not config, and how many values follow each.
LAUNCHER_FLAGS = {"--ngpu": 1, "--log-rank": 1, "--dry-run": 0, "--timeout": 1}
# Where the shown batch script says the checkout is (the test runs in a temporary folder).
SHOWN_CHECKOUT = "/shared/titan"


def _blocks(lang: str, doc: Path) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", doc.read_text(), flags=re.S)


def _commands() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for block in _blocks("bash", doc):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("  #")[0].strip()
                if re.search(
                    r"(^|\s)(titan (train|config|launch)|\./run_train\.sh|titan_core\.config"
                    r"\.manager)(\s|$)",
                    line,
                ):
                    found.append((doc.name, line))
    return found


def _named_tomls() -> dict[str, str]:
    """TOML blocks of the docs whose first line names the file (``# my_job.toml``)."""
    named = {}
    for doc in DOCS:
        for block in _blocks("toml", doc):
            if m := re.match(r"# ([\w.-]+\.toml)\n", block):
                named[m.group(1)] = block
    return named


def _split_env(line: str) -> tuple[dict[str, str], list[str]]:
    """(leading VAR=value assignments, the command's words)."""
    words = shlex.split(line)
    env = {}
    while words and re.match(r"^[A-Z_]+=", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return env, words


def _config_argv(line: str) -> list[str]:
    env, words = _split_env(line)
    if words[0] == "./run_train.sh":
        argv = []
        if "MODULE" in env or "CONFIG" in env or "CONFIG_FILE" not in env:
            argv = ["--module", env.get("MODULE", "llama3")]
            argv += ["--config", env.get("CONFIG", "llama3_debugmodel")]
        if "CONFIG_FILE" in env:
            argv += ["--job.config_file", env["CONFIG_FILE"]]
        return argv + words[1:]
    if words[0] == "python":
        words = words[3:]  # python -m titan_core.config.manager
    else:
        words = words[2:]  # titan train|config|launch
    out, skip = [], 0
    for word in words:
        if skip:
            skip -= 1
        elif word.split("=")[0] in LAUNCHER_FLAGS:
            skip = 0 if "=" in word else LAUNCHER_FLAGS[word]
        else:
            out.append(word)
    return out


def _setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run in an empty folder holding the files the documented commands name."""
    monkeypatch.chdir(tmp_path)
    Path("my_job.toml").write_text("[training]\nsteps = 5\n")
    for name, text in _named_tomls().items():
        Path(name).write_text(text)


COMMANDS = _commands()
DRY_RUNS = [(d, line) for d, line in COMMANDS if re.search(r"titan launch .*--dry-run", line)]


def test_docs_have_commands() -> None:
    assert len(COMMANDS) >= 10
    assert any("slurm" in line for _, line in DRY_RUNS)  # the multi-node docs show a batch script


@pytest.mark.parametrize(
    "doc, line", COMMANDS, ids=[f"{d}:{i}" for i, (d, _) in enumerate(COMMANDS)]
)
def test_documented_command_resolves(
    doc: str, line: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _setup(tmp_path, monkeypatch)
    argv = _config_argv(line)
    if "--help" in argv:
        with pytest.raises(SystemExit) as exc:
            parse_args(argv)
        assert exc.value.code == 0
        return
    cfg = parse_args(argv)
    assert cfg.model.name in family_names()


def _dry_run(line: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> str:
    """Run a documented ``titan launch --dry-run`` in this process; returns what it printed."""
    from titan_core.cli.launch import main

    env, words = _split_env(line)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    capsys.readouterr()
    assert main(words[2:]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize(
    "doc, line", DRY_RUNS, ids=[f"{d}:{i}" for i, (d, _) in enumerate(DRY_RUNS)]
)
def test_documented_dry_run_prints_the_plan(
    doc: str,
    line: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    assets: Path,
) -> None:
    _setup(tmp_path, monkeypatch)
    before = sorted(tmp_path.rglob("*"))
    out = _dry_run(line, monkeypatch, capsys)
    launch = parse_args(_config_argv(line)).launch
    if launch.backend == "slurm":
        assert out.startswith("#!/bin/bash\n"), out
        assert "\nsrun " in out and f"#SBATCH --nodes={launch.nnodes}\n" in out
    else:  # one torchrun per agent
        agents = 1 if launch.backend == "local" else launch.nnodes
        assert out.count(" -m torch.distributed.run ") == agents, out
    assert f"--nnodes={launch.nnodes} " in out
    assert f"--nproc_per_node={launch.nproc_per_node} " in out
    assert f"--max_restarts={launch.max_restarts} " in out
    assert sorted(tmp_path.rglob("*")) == before  # a dry run writes nothing


def test_shown_batch_script_is_what_the_dry_run_prints(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    assets: Path,
) -> None:
    """docs/multinode.md shows a dry run's output verbatim (with the checkout at /shared/titan)."""
    doc = (ROOT / "docs" / "multinode.md").read_text()
    shown = re.findall(
        r"```bash\n(titan launch --dry-run[^\n]*)\n```\n"  # the command, then (after prose)
        r"(?:(?!```).)*?```text\n(#!/bin/bash\n.*?)```",  # the script it prints
        doc,
        flags=re.S,
    )
    assert shown, "docs/multinode.md shows no batch script after a dry run"
    _setup(tmp_path, monkeypatch)
    for line, script in shown:
        out = _dry_run(line, monkeypatch, capsys)
        for here in {str(tmp_path), os.path.realpath(tmp_path)}:
            out = out.replace(here, SHOWN_CHECKOUT)
        assert out == script


@pytest.mark.parametrize("name", sorted(_named_tomls()))
def test_documented_toml_file_parses(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _setup(tmp_path, monkeypatch)
    cfg = parse_args(
        ["--module", "llama3", "--config", "llama3_debugmodel", "--job.config_file", name]
    )
    assert cfg.model.name == "llama3"


def test_documented_pipeline_runs_on_slurm_resolve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`titan pipeline run` lines of the multi-node docs (pipeline.md's: test_pipeline_edges)."""
    from titan_core.cli.pipeline import PIPELINE_RUN, flow_kwargs
    from titan_core.resolve import resolve_job

    _setup(tmp_path, monkeypatch)
    lines = [
        line
        for doc in ("multinode.md", "fault-tolerance.md")
        for block in _blocks("bash", ROOT / "docs" / doc)
        for line in block.splitlines()
        if line.startswith("titan pipeline run")
    ]
    assert lines
    for line in lines:
        kwargs = flow_kwargs(PIPELINE_RUN.parse(shlex.split(line)[3:]).config)
        args = [kwargs[k] for k in ("recipe", "config_file", "overrides")]
        assert resolve_job(*args).launch.backend == "slurm", line


@pytest.mark.multiprocess
def test_documented_backend_plugs_in_and_runs(tmp_path: Path) -> None:
    """The example backend of docs/multinode.md registers, renders and runs a job."""
    from titan_core.launch import _BACKENDS as backends
    from titan_core.launch import LaunchSpec, get_launcher

    doc = ROOT / "docs" / "multinode.md"
    example = next(b for b in _blocks("python", doc) if "register_backend(" in b)
    name = re.search(r'register_backend\("(\w+)"', example).group(1)  # type: ignore[union-attr]
    exec(compile(example, str(doc), "exec"), {"__name__": "docs_example"})
    try:
        (tmp_path / "hello.py").write_text(
            textwrap.dedent(
                """
                import os
                print(f"hello from rank {os.environ['RANK']} at nice {os.nice(0)}", flush=True)
                """
            )
        )
        launch = Launch(backend=name, nproc_per_node=1)  # type: ignore[arg-type]
        spec = LaunchSpec(args=[], launch=launch, module="hello", env={"PYTHONPATH": str(tmp_path)})
        launcher = get_launcher(launch)
        assert " -m torch.distributed.run --nnodes=1 " in launcher.render(spec)
        lines: list[str] = []
        result = launcher.run(spec, lines.append)
        assert result.returncode == 0
        said = next(
            m for line in lines if (m := re.match(r"\[rank0\]:hello .* at nice (\d+)$", line))
        )
        assert int(said.group(1)) > os.nice(0) or int(said.group(1)) == 19  # the backend's own
    finally:
        backends.pop(name, None)
