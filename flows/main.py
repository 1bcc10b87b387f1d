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

Config arguments are handed to ``titan_core.config.manager`` unchanged.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from titan_core import cli as engine
from titan_core.errors import TitanError

# Subcommands whose parsing lives with their package: `titan NAME args` == its cli.main(args).
_DELEGATED = {
    "launch": "launch training with the config's [launch] backend (local, multinode, slurm)",
    "convert": "convert checkpoints between DCP and Hugging Face formats",
    "data": "prepare raw sources into token shards; describe and verify prepared datasets",
    "eval": "evaluate a checkpoint: loss, perplexity, bits per byte, samples",
    "estimate": "estimate per-rank memory and FLOPs for a config and world size",
    "compare": "compare MLflow runs of an experiment: table, differing config, loss curves",
    "pipeline": "run the Prefect pipeline: config to trained, evaluated, published model",
    "sweep": "train a recipe once per grid or random-search trial and compare the trials",
}
# Imported only when their command runs: the pipeline's (Prefect, MLflow) never slow `titan train`.
_MODULES = {
    "launch": "titan_core.launch.cli",
    "convert": "titan_core.convert.cli",
    "data": "titan_core.data.cli",
    "eval": "titan_core.evaluate.cli",
    "estimate": "titan_core.estimate.cli",
    "compare": "flows.compare_cli",
    "pipeline": "flows.cli",
    "sweep": "flows.sweep_cli",
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch a ``titan`` subcommand."""
    parser = argparse.ArgumentParser(
        prog="titan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train (under torchrun when --ngpu > 1)", add_help=False)
    train.add_argument("--ngpu", type=int, default=1, help="processes on this host")
    train.add_argument("--log-rank", default="0", help="ranks whose output is shown")
    train.add_argument("--dry-run", action="store_true", help="print the command, do not run")
    sub.add_parser("config", help="print the resolved config as TOML", add_help=False)
    demo = sub.add_parser(
        "demo",
        help="the full pipeline on the debug model, offline (rerun: continues)",
        add_help=False,
    )
    demo.add_argument("--steps", type=int, default=0, help="steps for a fresh demo run")
    demo.add_argument("--engine-only", action="store_true", help="train only, no pipeline")
    for name, help_text in _DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    ns, rest = parser.parse_known_args(argv)
    try:
        if ns.command == "train":
            return engine.train(ns.ngpu, ns.log_rank, rest, ns.dry_run)
        if ns.command == "config":
            return engine.config(rest)
        if ns.command in _DELEGATED:
            module = importlib.import_module(_MODULES[ns.command])
            return module.main(rest)
        if not ns.engine_only:  # the pipeline demo: flows.demo (Prefect + MLflow), lazily
            steps = ["--steps", str(ns.steps)] if ns.steps else []
            return importlib.import_module("flows.demo").main([*steps, *rest])
        return engine.demo(ns.steps, rest)
    except TitanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
