"""Optional lm-evaluation-harness run on a Hugging Face export, with local task files only.

Needs the ``eval`` extra (``lm-eval[hf]``). The harness runs in a child process started with
``HF_HUB_OFFLINE=1``, ``HF_DATASETS_OFFLINE=1`` and ``TRANSFORMERS_OFFLINE=1``: those libraries
read the switches once, at import, so only a fresh process can guarantee that nothing reaches a
hub. Task YAMLs come from one local folder (lm-eval's bundled tasks are not indexed) and run with
that folder as the working directory, so ``data_files`` paths in them are relative to it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_core import storage
from titan_core.errors import ConfigError, DataError

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
_INSTALL_HINT = "install the eval extra: pip install 'titan-pipelines[eval]'"


@dataclass(frozen=True)
class LmEvalOptions:
    """Which local lm-eval tasks to run on which Hugging Face export."""

    tasks: list[str]
    task_dir: str
    hf_folder: str = ""
    """HF export folder or URL; empty means ``<run root>/hf``."""
    limit: float | None = None
    """At most this many documents per task (a fraction when < 1); None runs them all."""
    batch_size: int = 8
    """Sequences per forward pass in the harness."""
    bootstrap_iters: int = 1000
    """Resamples for the standard errors of non-mean metrics (lm-eval's default is 100000)."""


def is_available() -> bool:
    """Whether lm-eval and its Hugging Face backend are importable."""
    return all(importlib.util.find_spec(m) is not None for m in ("lm_eval", "accelerate"))


def check_inputs(hf_folder: str, task_dir: str, tasks: list[str]) -> None:
    """One-line errors for what would make the harness fail, before any model is loaded."""
    if not is_available():
        raise ConfigError(f"evaluate.lm_eval_tasks: lm-eval is not installed ({_INSTALL_HINT})")
    if not tasks:
        raise ConfigError("evaluate.lm_eval_tasks: expected at least one task name")
    if storage.is_url(task_dir) or not Path(task_dir).is_dir():
        raise ConfigError(
            f"evaluate.lm_eval_task_dir: expected a local folder of task YAMLs: {task_dir}"
        )
    if not any(Path(task_dir).rglob("*.yaml")):
        raise ConfigError(f"evaluate.lm_eval_task_dir: no .yaml task files in {task_dir}")
    if not storage.exists(storage.join(hf_folder, "config.json")):
        raise DataError(
            f"--hf-folder: no Hugging Face export (config.json) in {hf_folder}; "
            "export the checkpoint first"
        )


def run_lm_eval(
    hf_folder: str,
    task_dir: str,
    tasks: list[str],
    limit: float | None = None,
    *,
    batch_size: int = 8,
    bootstrap_iters: int = 1000,
) -> dict[str, Any]:
    """Run ``tasks`` from ``task_dir`` on the export at ``hf_folder``, offline.

    Returns ``{"results": {task: {metric: value}}, "n_samples": {task: n}, ...}``.
    """
    check_inputs(hf_folder, task_dir, tasks)
    with tempfile.TemporaryDirectory(prefix="titan_lm_eval_") as tmp:
        local_hf = local_copy(hf_folder, tmp)
        out = os.path.join(tmp, "results.json")
        cmd = [
            sys.executable, "-m", "titan_core.evaluate.harness",
            "--hf-folder", local_hf, "--task-dir", str(Path(task_dir).resolve()),
            "--batch-size", str(batch_size), "--bootstrap-iters", str(bootstrap_iters),
            "--out", out, "--tasks", *tasks,
        ]  # fmt: skip
        if limit is not None:
            cmd += ["--limit", str(limit)]
        proc = subprocess.run(
            cmd, env={**os.environ, **OFFLINE_ENV}, capture_output=True, text=True
        )
        if proc.returncode != 0:
            lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
            errors = [ln for ln in lines if ln.startswith("error: ")]
            reason = (errors or lines or [f"exit code {proc.returncode}"])[-1]
            reason = reason.removeprefix("error: ")
            if errors and reason.startswith("--"):  # the child's own one-line input error
                raise ConfigError(reason)
            raise DataError(f"lm-eval failed: {reason}")
        result = json.loads(Path(out).read_text())
    return {"hf_folder": hf_folder, "task_dir": task_dir, "limit": limit, **result}


def local_copy(hf_folder: str, tmp: str) -> str:
    """``transformers`` reads local folders only: fetch a URL export into ``tmp`` first."""
    if not storage.is_url(hf_folder):
        return str(Path(hf_folder.removeprefix("file://")).resolve())
    fs, path = storage.filesystem(hf_folder)
    local = os.path.join(tmp, "hf")
    fs.get(path.rstrip("/") + "/", local + "/", recursive=True)
    return local


def _clean(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """lm-eval's ``{"acc,none": 0.5, "alias": ...}`` -> ``{"acc": 0.5}`` per task."""
    out: dict[str, dict[str, float]] = {}
    for task, row in results.items():
        metrics = {}
        for key, value in row.items():
            name, _, filt = key.partition(",")
            if not filt or not isinstance(value, int | float) or isinstance(value, bool):
                continue  # alias, name, sample_len and "N/A" standard errors
            metrics[name if filt == "none" else f"{name},{filt}"] = float(value)
        out[task] = metrics
    return out


def _harness_main(ns: argparse.Namespace) -> dict[str, Any]:
    import lm_eval
    import torch
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=ns.task_dir, include_defaults=False)
    unknown = [t for t in ns.tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(
            f"--lm-eval-tasks: {unknown} not in {ns.task_dir} (found: {manager.all_tasks})"
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = HFLM(pretrained=ns.hf_folder, device=device, batch_size=ns.batch_size)
    limit = None if ns.limit is None else (ns.limit if ns.limit < 1 else int(ns.limit))
    with contextlib.chdir(ns.task_dir):  # data_files in the YAMLs are relative to it
        raw = lm_eval.simple_evaluate(
            model=model,
            tasks=ns.tasks,
            task_manager=manager,
            limit=limit,
            bootstrap_iters=ns.bootstrap_iters,
            log_samples=False,
        )
    assert raw is not None  # only non-zero ranks of a multi-process harness get None
    return {
        "lm_eval_version": lm_eval.__version__,
        "results": _clean(raw["results"]),
        "n_samples": {t: n.get("effective") for t, n in raw.get("n-samples", {}).items()},
    }


def main(argv: list[str] | None = None) -> int:
    """Child-process entry: run the harness and write its cleaned results as JSON."""
    parser = argparse.ArgumentParser(prog="python -m titan_core.evaluate.harness")
    parser.add_argument("--hf-folder", required=True)
    parser.add_argument("--task-dir", required=True)
    parser.add_argument("--tasks", nargs="+", required=True)
    parser.add_argument("--limit", type=float, default=None)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--bootstrap-iters", type=int, default=1000)
    parser.add_argument("--out", required=True)
    ns = parser.parse_args(argv)
    for key, value in OFFLINE_ENV.items():
        if os.environ.get(key) != value:  # too late to set here: the libraries read it at import
            print(f"error: set {key}={value} before starting this process", file=sys.stderr)
            return 2
    try:
        result = _harness_main(ns)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    storage.write_text(ns.out, json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
