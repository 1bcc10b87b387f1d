"""The ``titan`` console script.

    titan train [--ngpu N] [--log-rank R] [--module M --config C] [--section.field value ...]
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

Config arguments are handed to ``titan_core.config.manager`` unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import shutil
import statistics
import sys

from titan_core.errors import TitanError


def _train(ns: argparse.Namespace, rest: list[str]) -> int:
    if ns.ngpu > 1 and (simulated := _comm_mode_args(ns.ngpu, rest)):
        # COMM_MODE: one process simulates all ngpu ranks (titan_core.distributed.comm_mode).
        rest, ns.ngpu = simulated, 1
    if ns.ngpu > 1:
        from titan_core.build import check_job
        from titan_core.config.manager import parse_args

        check_job(parse_args(rest), ns.ngpu)  # a bad config fails here, before torchrun starts
        torchrun = shutil.which("torchrun") or os.path.join(
            os.path.dirname(sys.executable), "torchrun"
        )
        cmd = [
            torchrun,
            f"--nproc_per_node={ns.ngpu}",
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            "localhost:0",
            "--local-ranks-filter",
            ns.log_rank,
            "--role",
            "rank",
            "--tee",
            "3",
            "-m",
            "titan_core.train",
            *rest,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # see titan_core.launch
        os.execve(cmd[0], cmd, env)
    from titan_core.train import main as train_main

    return train_main(rest)


def _comm_mode_args(ngpu: int, rest: list[str]) -> list[str]:
    """``rest`` with the simulated world size when the job asks for a COMM_MODE, else []."""
    from titan_core.config.manager import parse_args

    if not any(a.startswith("--comm.fake_world_size") for a in rest):
        rest = [*rest, "--comm.fake_world_size", str(ngpu)]
    return rest if parse_args(rest).comm.mode != "default" else []


def _config(rest: list[str]) -> int:
    from titan_core.config.manager import main as config_main

    return config_main(rest)


def _demo(ns: argparse.Namespace, rest: list[str]) -> int:
    """Train the debug model offline; a rerun resumes from the newest checkpoint and goes on."""
    from titan_core.checkpoint import storage
    from titan_core.checkpoint.manager import complete_steps
    from titan_core.config.manager import parse_args
    from titan_core.train import run

    argv = ["--module", "llama3", "--config", "llama3_debugmodel", *rest]
    if ns.steps:
        argv += ["--training.steps", str(ns.steps)]
    cfg = parse_args(argv)
    folder = storage.resolve(cfg.job.dump_folder, cfg.checkpoint.folder)
    done = complete_steps(folder)
    if done and done[-1] >= cfg.training.steps:
        # Already trained this far: continue for another block of the same length.
        steps = done[-1] + cfg.training.steps
        print(f"demo: found checkpoint step-{done[-1]} in {folder}; continuing to step {steps}")
        cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, steps=steps))
    elif done:
        print(f"demo: resuming from checkpoint step-{done[-1]} in {folder}")
    history = run(cfg)
    losses = [h["loss"] for h in history if "loss" in h]
    if len(losses) >= 4:
        k = min(10, len(losses) // 2)
        first, last = statistics.mean(losses[:k]), statistics.mean(losses[-k:])
        print(
            f"demo: mean loss of the first {k} logged steps {first:.3f} → last {k}: "
            f"{last:.3f} ({100 * (first - last) / first:+.1f}% lower)"
        )
    print(
        f"demo: outputs in {cfg.job.dump_folder} (checkpoints: {folder}, "
        f"metrics: {os.path.join(cfg.job.dump_folder, 'metrics.jsonl')}); "
        "run `make demo` again to resume"
    )
    return 0


# Subcommands whose parsing lives with their package: `titan NAME args` == its cli.main(args).
_DELEGATED = {
    "launch": "launch training with the config's [launch] backend (local, multinode, slurm)",
    "convert": "convert checkpoints between DCP and Hugging Face formats",
    "data": "prepare raw sources into token shards; describe and verify prepared datasets",
    "eval": "evaluate a checkpoint: loss, perplexity, bits per byte, samples",
    "estimate": "estimate per-rank memory and FLOPs for a config and world size",
    "compare": "compare MLflow runs of an experiment: table, differing config, loss curves",
    "pipeline": "run the Prefect pipeline: config to trained, evaluated, published model",
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
            return _train(ns, rest)
        if ns.command == "config":
            return _config(rest)
        if ns.command in _DELEGATED:
            module = importlib.import_module(_MODULES[ns.command])
            return module.main(rest)
        if not ns.engine_only:  # the pipeline demo: flows.demo (Prefect + MLflow), lazily
            steps = ["--steps", str(ns.steps)] if ns.steps else []
            return importlib.import_module("flows.demo").main([*steps, *rest])
        return _demo(ns, rest)
    except TitanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
