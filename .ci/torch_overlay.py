"""Install another torch release into a folder that overlays the project's venv (PYTHONPATH).

    python .ci/torch_overlay.py 2.11.0 .torch-2.11.0

`make test` runs the engine's core tests (model parity, one parallelism layout, resume,
conversion) with the oldest supported torch this way: only torch and the CUDA runtime wheels it
loads at import go into the folder; everything else (numpy, fsspec, ...) stays the venv's, so
the overlay is the one variable. PyPI's Linux torch wheel is the CUDA build, whose import needs
those runtime libraries even on a CPU machine; triton is left out (only GPU compilation uses
it). Idempotent: a DONE file records the installed version.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def _runtime_requirements(folder: Path) -> list[str]:
    """torch's Linux-only requirements (its CUDA runtime wheels), without triton."""
    meta = next(folder.glob("torch-*.dist-info")) / "METADATA"
    needs = []
    for line in meta.read_text().splitlines():
        if not line.startswith("Requires-Dist:") or "extra ==" in line:
            continue
        requirement, _, marker = line.removeprefix("Requires-Dist:").partition(";")
        if 'platform_system == "Linux"' in marker and not requirement.strip().startswith("triton"):
            needs.append(requirement.strip())
    return needs


def main() -> int:
    if len(sys.argv) != 3:
        print("usage: torch_overlay.py VERSION FOLDER", file=sys.stderr)
        return 2
    version, folder = sys.argv[1], Path(sys.argv[2])
    done = folder / "DONE"
    if done.exists() and done.read_text().strip() == version:
        return 0
    shutil.rmtree(folder, ignore_errors=True)
    pip = [sys.executable, "-m", "pip", "install", "-q", "--target", str(folder)]
    subprocess.run([*pip, "--no-deps", f"torch=={version}"], check=True)
    subprocess.run([*pip, *_runtime_requirements(folder)], check=True)
    done.write_text(version + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
