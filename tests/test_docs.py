"""Every `titan`, `run_train.sh` and config-manager command in README.md and docs/ resolves."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from titan_core.config.manager import parse_args

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _commands() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("  #")[0].strip()
                if re.search(
                    r"(^|\s)(titan (train|config)|\./run_train\.sh|titan_core\.config"
                    r"\.manager)(\s|$)",
                    line,
                ):
                    found.append((doc.name, line))
    return found


def _config_argv(line: str) -> list[str]:
    words = shlex.split(line)
    env = {}
    while words and re.match(r"^[A-Z_]+=", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if words[0] == "./run_train.sh":
        argv = [
            "--module",
            env.get("MODULE", "llama3"),
            "--config",
            env.get("CONFIG", "llama3_debugmodel"),
        ]
        if "CONFIG_FILE" in env:
            argv += ["--job.config_file", env["CONFIG_FILE"]]
        return argv + words[1:]
    if words[0] == "python":
        words = words[3:]  # python -m titan_core.config.manager
    else:
        words = words[2:]  # titan train|config
    out, skip = [], False
    for word in words:  # launcher flags of `titan train` are not config
        if skip:
            skip = False
        elif word in ("--ngpu", "--log-rank"):
            skip = True
        else:
            out.append(word)
    return out


COMMANDS = _commands()


def test_docs_have_commands() -> None:
    assert len(COMMANDS) >= 10


@pytest.mark.parametrize(
    "doc, line", COMMANDS, ids=[f"{d}:{i}" for i, (d, _) in enumerate(COMMANDS)]
)
def test_documented_command_resolves(
    doc: str, line: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("my_job.toml").write_text("[training]\nsteps = 5\n")
    argv = _config_argv(line)
    if "--help" in argv:
        with pytest.raises(SystemExit) as exc:
            parse_args(argv)
        assert exc.value.code == 0
        return
    cfg = parse_args(argv)
    assert cfg.model.name == "llama3"
