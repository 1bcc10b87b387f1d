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

from titan_core.cli.command import Main, dispatch, run

# The one table of commands: name -> (help line, module whose ``main(argv)`` runs it). A module
# is imported only when its command runs, so the engine commands never import Prefect or MLflow.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("train (under torchrun when --ngpu > 1)", "titan_core.cli.train"),
    "launch": (
        "launch training with the config's [launch] backend (local, multinode, slurm)",
        "titan_core.cli.launch",
    ),
    "config": (
        "print the resolved config as TOML (--help: every config key)",
        "titan_core.cli.config",
    ),
    "demo": (
        "the full pipeline on the debug model, offline (rerun: continues)",
        "titan_core.cli.demo",
    ),
    "pipeline": (
        "run the Prefect pipeline: config to trained, evaluated, published model",
        "titan_core.cli.pipeline",
    ),
    "convert": (
        "convert checkpoints between DCP and Hugging Face formats",
        "titan_core.cli.convert",
    ),
    "data": (
        "prepare raw sources into token shards; describe and verify prepared datasets",
        "titan_core.cli.data",
    ),
    "eval": (
        "evaluate a checkpoint: loss, perplexity, bits per byte, samples",
        "titan_core.cli.evaluate",
    ),
    "estimate": (
        "estimate per-rank memory and FLOPs for a config and world size",
        "titan_core.cli.estimate",
    ),
    "compare": (
        "compare MLflow runs of an experiment: table, differing config, loss curves",
        "titan_core.cli.compare",
    ),
    "sweep": (
        "train a recipe once per grid or random-search trial and compare the trials",
        "titan_core.cli.sweep",
    ),
}


def _lazy(module: str) -> Main:
    """The ``main`` of ``module``, imported only when its command runs."""

    def main(argv: list[str]) -> int:
        return importlib.import_module(module).main(argv)

    return main


def main(argv: list[str] | None = None) -> int:
    """Dispatch a ``titan`` subcommand; a user error is one ``error:`` line and exit code 2."""
    commands = {name: (text, _lazy(module)) for name, (text, module) in COMMANDS.items()}
    return run(lambda args: dispatch("titan", __doc__ or "", commands, args), argv)
