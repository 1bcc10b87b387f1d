"""The ``titan`` console script: one dispatcher over the engine's and the pipeline's CLIs.

    titan train [--ngpu N] [--log-rank R] [--dry-run] [--module M --config C] [overrides]
    titan launch [--dry-run] [config args]              # with [launch] backend: local, slurm...
    titan config [--module M --config C] [overrides]     # print the resolved config as TOML
    titan demo [--steps N] [overrides]                   # whole pipeline offline; rerun continues
    titan demo --engine-only [--steps N] [overrides]     # train only (no Prefect/MLflow); resumes
    titan pipeline run [--module M --config C] [...]     # the Prefect pipeline (see --help)
    titan convert dcp-to-hf|hf-to-dcp ...                # checkpoint conversion (see --help)
    titan data prepare|info|verify ...                   # tokenize sources into shards
    titan eval --checkpoint URL [...]                    # held-out loss, perplexity, samples
    titan estimate --ngpu N [--json] [...]               # per-rank memory and FLOPs
    titan compare --experiment NAME [--runs ID ...]      # MLflow runs side by side, loss curves
    titan sweep --grid KEY=V1,V2 [...] [overrides]       # one pipeline run per trial, compared

Commands that read a job config take config arguments too: ``--module``/``--config`` (a
recipe), ``--config-file PATH`` and ``--section.field VALUE`` (``titan config --help``
lists every key).
"""

from __future__ import annotations

import importlib
import sys

from titan_core import cli as engine
from titan_core.config.command import Main, dispatch, run


def _lazy(module: str) -> Main:
    """The ``main`` of ``module``, imported only when its command runs: the pipeline's modules
    (Prefect, MLflow) never slow down ``titan train``."""

    def main(argv: list[str]) -> int:
        """Import ``module`` and run its ``main``."""
        return importlib.import_module(module).main(argv)

    return main


COMMANDS: dict[str, tuple[str, Main]] = {
    "train": ("train (under torchrun when --ngpu > 1)", engine.train_command),
    "launch": (
        "launch training with the config's [launch] backend (local, multinode, slurm)",
        _lazy("titan_core.launch.cli"),
    ),
    "config": ("print the resolved config as TOML (--help: every config key)", engine.config),
    "demo": (
        "the full pipeline on the debug model, offline (rerun: continues)",
        _lazy("flows.demo"),
    ),
    "pipeline": (
        "run the Prefect pipeline: config to trained, evaluated, published model",
        _lazy("flows.cli"),
    ),
    "convert": (
        "convert checkpoints between DCP and Hugging Face formats",
        _lazy("titan_core.convert.cli"),
    ),
    "data": (
        "prepare raw sources into token shards; describe and verify prepared datasets",
        _lazy("titan_core.data.cli"),
    ),
    "eval": (
        "evaluate a checkpoint: loss, perplexity, bits per byte, samples",
        _lazy("titan_core.evaluate.cli"),
    ),
    "estimate": (
        "estimate per-rank memory and FLOPs for a config and world size",
        _lazy("titan_core.estimate.cli"),
    ),
    "compare": (
        "compare MLflow runs of an experiment: table, differing config, loss curves",
        _lazy("flows.compare_cli"),
    ),
    "sweep": (
        "train a recipe once per grid or random-search trial and compare the trials",
        _lazy("flows.sweep_cli"),
    ),
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch a ``titan`` subcommand; a user error is one ``error:`` line and exit code 2."""
    return run(lambda args: dispatch("titan", __doc__ or "", COMMANDS, args), argv)


if __name__ == "__main__":
    sys.exit(main())
