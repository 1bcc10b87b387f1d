"""The engine commands stay light: a GPU machine needs only torch and a handful of small wheels.

`titan train` (torchrun, which it becomes, and the ranks), `titan estimate`, `titan convert` and
`titan eval` import neither the pipeline's services (Prefect, MLflow, S3) nor `datasets`,
transformers or matplotlib unless the job asks for them (docs/performance.md lists the wheels a
GPU machine needs). Each command runs for real; a ``sitecustomize`` on the path makes every
Python process it starts write, at exit, which of those packages it imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ["prefect", "mlflow", "datasets", "transformers", "boto3", "s3fs", "matplotlib", "dask"]
TINY = ["--module", "llama3", "--config", "llama3_debugmodel_tiny"]
SITECUSTOMIZE = """
import atexit, json, os, sys

def _report():
    heavy = set(json.loads(os.environ["TITAN_HEAVY"]))
    found = sorted({m.split(".")[0] for m in sys.modules} & heavy)
    path = os.path.join(os.environ["TITAN_IMPORT_REPORTS"], f"{os.getpid()}.json")
    with open(path, "w") as f:
        json.dump({"argv": sys.argv, "heavy": found}, f)

atexit.register(_report)
"""


def _imports(tmp_path: Path, *argv: str) -> list[dict]:
    """Run ``python -m titan_core.<argv>``; what each of its Python processes imported."""
    probe, reports = tmp_path / "probe", tmp_path / f"reports-{len(list(tmp_path.iterdir()))}"
    probe.mkdir(exist_ok=True)
    reports.mkdir()
    (probe / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(probe), os.environ.get("PYTHONPATH")) if p)
    env = {
        **os.environ,
        "PYTHONPATH": path,
        "OMP_NUM_THREADS": "1",
        "TITAN_HEAVY": json.dumps(HEAVY),
    }
    env["TITAN_IMPORT_REPORTS"] = str(reports)
    proc = subprocess.run(
        [sys.executable, "-m", *argv], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(p.read_text()) for p in sorted(reports.iterdir())]


def _heavy(reports: list[dict]) -> list[dict]:
    return [r for r in reports if r["heavy"]]


@pytest.fixture(scope="module")
def step(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> Path:
    """A 2-step run's full checkpoint, trained by the trainer module itself."""
    root = tmp_path_factory.mktemp("engine")
    argv = ["titan_core.train", *TINY, "--training.steps", "2", "--job.dump_folder", "run"]
    argv += ["--validation.no_enable", "--checkpoint.enable", "--checkpoint.interval", "2"]
    argv += ["--checkpoint.no_last_save_model_only", "--metrics.cpu_peak_tflops", "1"]
    reports = _imports(root, *argv)
    assert len(reports) == 1 and not _heavy(reports), reports
    return root / "run" / "checkpoint" / "step-2"


def test_titan_train_torchrun_and_its_ranks_stay_light(tmp_path: Path, assets: Path) -> None:
    argv = ["titan_core.cli", "train", *TINY, "--ngpu", "2", "--training.steps", "2"]
    argv += ["--job.dump_folder", "run", "--validation.no_enable", "--metrics.cpu_peak_tflops", "1"]
    reports = _imports(tmp_path, *argv)
    # titan supervises torchrun, whose agent starts the two ranks (titan_core/train.py)
    ranks = [r for r in reports if r["argv"][0].endswith(os.path.join("titan_core", "train.py"))]
    assert len(ranks) == 2 and len(reports) == 4, [r["argv"][:2] for r in reports]
    assert not _heavy(reports), _heavy(reports)
    assert (tmp_path / "run" / "metrics.jsonl").exists()  # the ranks trained


def test_estimate_convert_and_eval_stay_light(step: Path, tmp_path: Path) -> None:
    assert not _heavy(_imports(tmp_path, "titan_core.cli", "estimate", *TINY))
    export = ["dcp-to-hf", "--checkpoint", str(step), "--output", "hf", "--no-progress"]
    assert not _heavy(_imports(tmp_path, "titan_core.cli", "convert", *export))
    evaluate = ["--checkpoint", str(step), "--output", "eval", "--evaluate.batches", "2"]
    assert not _heavy(_imports(tmp_path, "titan_core.cli", "eval", *evaluate))
    assert (tmp_path / "hf" / "config.json").exists()
