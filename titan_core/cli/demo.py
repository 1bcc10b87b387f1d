"""``titan demo``: the whole pipeline on the debug model, offline, with embedded defaults.

The first run pre-trains (tokenizer, prepare_data, preflight, seed, 2-process training, HF
export, eval, MLflow registry); a rerun continues the demo's model line with ``retrain`` for
another block of steps and promotes the new version only if its eval loss improved. The bundled
corpus is prepared once into token shards (``./outputs/data/``; a rerun finds it Cached) and
trained on from there; ``--raw-text`` trains on the raw text instead (tokenized in the loader).
Everything lands under ``./outputs`` (runs in ``./outputs/demo/``, MLflow in
``./outputs/mlflow.db``, Prefect's database in ``./outputs/.prefect``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
from dataclasses import dataclass
from typing import Annotated

from titan_core.cli.command import OVERRIDES_NOTE, Command, ConfigArgs, default, run
from titan_core.cli.pipeline import RENAMED_FLAGS, prepare_prefect_env, where_to_look
from titan_core.errors import ConfigError

DEMO_RECIPE, DEMO_EXPERIMENT = "llama3_debugmodel", "demo"
# Two ranks (FSDP over gloo on CPU), one thread each, 100 steps (about 2 minutes of training on
# 2 cores); a short held-out eval (10 batches).
DEMO_OVERRIDES = [
    "--job.dump_folder",  # the demo's output root (not the recipe's ./outputs/llama3_debugmodel)
    "./outputs",
    "--job.experiment",
    DEMO_EXPERIMENT,
    "--launch.nproc_per_node",
    "2",
    "--training.steps",
    "100",
    "--evaluate.batches",
    "10",
]
# The bundled corpus's train files, every 50th document held out: the same 2% of documents as its
# raw validation split (~50k tokens, enough for the eval's 10 global batches).
DEMO_VALIDATION_EVERY = 50


# In-loop evaluation while the demo trains: two held-out sets cut from the corpus's validation
# split by genre (the plays, the Python documentation: their first 2 batches of 4 x 257 tokens)
# and a fixed subset of 20 questions of the bundled line_closing task (of 300; it fits any
# seq_len, next_sentence needs 256), before the first step and every 50 steps: 3 points per curve
# in 100 steps. Sized to cost <= 3% of the run's wall time (bench/inloop_eval.py: each evaluation
# is about one training step per rank; the full sets cost ~20 steps each, 6 times).
DEMO_EVALUATORS = ["lc=task:line_closing?examples=20"]
DEMO_EVALUATOR_SETTINGS = [
    "--evaluators.freq",
    "50",
    "--evaluators.at_start",
    "--evaluators.batches",
    "2",
    "--evaluators.batch_size",
    "4",
]
_SPEAKER = re.compile(r"^[A-Z][A-Z' ]+\.$", re.MULTILINE)  # "LEONATO." heads a line of a play


def demo_heldout_sets(root: str) -> list[str]:
    """Write the corpus's validation documents as two held-out sets by genre into
    ``<root>/heldout/`` (``plays.jsonl``: documents with a speaker's line; ``python.jsonl``:
    the rest, the Python reference and docstrings) and return their ``evaluators.sets``
    entries, the bundled task's after them. Deterministic: a rerun writes the same files."""
    from titan_core import storage
    from titan_core.data.assets import bundled_corpus_dir, ensure_assets
    from titan_core.pipeline.run.paths import absolute

    ensure_assets()
    docs: list[str] = []
    for path in sorted((bundled_corpus_dir() / "validation").glob("*.jsonl")):
        docs += [json.loads(line)["text"] for line in path.read_text().splitlines()]
    genres = {
        "plays": [d for d in docs if _SPEAKER.search(d)],
        "python": [d for d in docs if not _SPEAKER.search(d)],
    }
    entries = []
    for name, texts in genres.items():
        url = storage.join(absolute(root), "heldout", f"{name}.jsonl")
        storage.write_text(url, "".join(json.dumps({"text": t}) + "\n" for t in texts))
        entries.append(f"{name}=heldout:{url}")
    return [*entries, *DEMO_EVALUATORS]


def with_demo_evaluators(overrides: list[str], root: str) -> list[str]:
    """``overrides`` with the demo's evaluators (``demo_heldout_sets`` into ``root``) before
    them, unless they set ``evaluators.sets`` themselves."""
    if any(arg.split("=", 1)[0] == "--evaluators.sets" for arg in overrides):
        return overrides
    return ["--evaluators.sets", *demo_heldout_sets(root), *DEMO_EVALUATOR_SETTINGS, *overrides]


def demo_data_overrides() -> list[str]:
    """Overrides that prepare the bundled corpus's train folder and train on the result."""
    from titan_core.data.assets import bundled_corpus_dir

    train = str(bundled_corpus_dir() / "train")
    return ["--data.sources", train, "--data.validation_every", str(DEMO_VALIDATION_EVERY)]


@dataclass
class DemoOptions:
    """The options of ``titan demo`` (config overrides aside)."""

    steps: Annotated[int, default("100; --engine-only: the recipe's")] = 0
    """training steps of this run (a rerun trains this many more)"""
    raw_text: bool = False
    """train on the raw corpus (tokenized while training) instead of preparing it"""
    engine_only: bool = False
    """train only, in this process (no Prefect, no MLflow); a rerun resumes and goes on"""


DEMO = Command("titan demo", DemoOptions, __doc__ or "", renamed=RENAMED_FLAGS, note=OVERRIDES_NOTE)


def _overrides(config: ConfigArgs) -> list[str]:
    """The ``--section.field`` overrides of ``config``; the demo's recipe is its own."""
    if config.module or config.config or config.config_file:
        raise ConfigError(
            f"titan demo: trains {DEMO_RECIPE}; for another recipe or file use titan pipeline "
            "run --config RECIPE or --config-file F"
        )
    return list(config.overrides)


def _demo(ns: DemoOptions, overrides: list[str]) -> int:
    from titan_core.config.argv import cli_values
    from titan_core.resolve import resolve_job

    if not ns.raw_text:
        overrides = [*demo_data_overrides(), *overrides]
    overrides = [*DEMO_OVERRIDES, *overrides]
    if ns.steps:
        overrides += ["--training.steps", str(ns.steps)]
    cfg = resolve_job(DEMO_RECIPE, "", cli_values(overrides))  # a bad one is one line, first
    values = cli_values(with_demo_evaluators(overrides, cfg.job.dump_folder))
    cfg = resolve_job(DEMO_RECIPE, "", values)
    home = prepare_prefect_env()  # before anything imports Prefect: it reads settings once
    from titan_core.pipeline.run.paths import absolute
    from titan_core.pipeline.stages.model_line import latest_checkpoint

    if not ns.raw_text:
        from titan_core.data import ensure_assets

        ensure_assets()  # the corpus to prepare, on a fresh machine too (seconds, then cached)
    latest = latest_checkpoint(absolute(cfg.job.dump_folder), cfg.job.experiment)
    if latest is None:
        from flows.pipeline import pretrain_pipeline

        print(f"demo: pre-training {DEMO_RECIPE} for {cfg.training.steps} steps")
        result = pretrain_pipeline(recipe=DEMO_RECIPE, overrides=values)
    else:
        from flows.retrain import retrain

        print(
            f"demo: continuing from {latest.step_dir} for {cfg.training.steps} more steps "
            "(promoted only if the eval loss improves)"
        )
        result = retrain(steps=cfg.training.steps, recipe=DEMO_RECIPE, overrides=values)
    print(where_to_look(result, home))
    print("demo: run `make demo` again to continue training this model line")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the demo; user errors print one line and return 2."""
    return run(_main, argv)


def _main(argv: list[str]) -> int:
    parsed = DEMO.parse(argv)
    ns, overrides = parsed.options, _overrides(parsed.config)
    if ns.steps < 0:
        raise ConfigError(f"--steps: expected an int >= 0, got {ns.steps}")
    if ns.engine_only:
        if ns.raw_text:
            raise ConfigError("--raw-text: the engine-only demo always trains on raw text")
        return _engine_demo(ns.steps, overrides)
    return _demo(ns, overrides)


def _engine_demo(steps: int, rest: list[str]) -> int:
    """Train the debug model offline; a rerun resumes from the newest checkpoint and goes on."""
    from titan_core import storage
    from titan_core.checkpoint.manager import complete_steps
    from titan_core.resolve import parse_args
    from titan_core.train import run

    recipe = ["--module", "llama3", "--config", "llama3_debugmodel"]
    rest = [*rest, "--training.steps", str(steps)] if steps else rest
    cfg = parse_args([*recipe, *rest])  # a bad override is one line before anything is written
    cfg = parse_args([*recipe, *with_demo_evaluators(rest, cfg.job.dump_folder)])
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
