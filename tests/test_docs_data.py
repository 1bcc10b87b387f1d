"""The walkthrough of docs/data.md runs as written: prepare, cached rerun, info, verify, train."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from titan_core.data.assets import assets_dir

ROOT = Path(__file__).resolve().parents[1]


def _walkthrough() -> str:
    """The first bash block of docs/data.md, with the assets folder where this machine has it."""
    block = re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "data.md").read_text(), re.S)[0]
    return block.replace("~/.cache/titan/assets", str(assets_dir()))


def test_data_walkthrough_runs_as_documented(tmp_path: Path) -> None:
    script = _walkthrough()
    assert "titan data prepare" in script and "titan train" in script
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "OMP_NUM_THREADS": "1",
    }
    out = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert "data prepare: cached" in text  # the documented rerun tokenized nothing
    (dataset,) = (tmp_path / "outputs" / "data").iterdir()
    assert (dataset / "manifest.json").is_file()
    assert "validation" in text and "train" in text  # titan data info's split lines
    assert re.search(r"validation loss: \d", text)  # validation read the held-out split
    assert "Training done at step 10" in text
