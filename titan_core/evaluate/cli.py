"""``titan eval``: held-out metrics, greedy samples and an optional lm-eval run for a checkpoint.

    titan eval --checkpoint URL [--output URL] [--hf-folder URL]
               [--module M --config C | --config-file PATH] [--section.field VALUE ...]

What to evaluate is the job config's ``[evaluate]`` section (``evaluate.batches``,
``evaluate.prompts``, ``evaluate.max_new_tokens``, ``evaluate.lm_eval_*``) and the validation
data (``validation.*``). The job config defaults to the run's own ``config.toml`` (two levels
above a step directory), else to the defaults with the model the checkpoint's commit marker
describes (every checkpoint ``titan train`` and ``titan convert hf-to-dcp`` write does);
``--section.field value`` overrides apply on top (``titan config --help`` lists them).
The older flags are aliases of config keys: --max-batches (evaluate.batches), --prompts
(evaluate.prompts; takes whole strings, commas included), --max-new-tokens, --lm-eval-tasks,
--lm-eval-task-dir and --lm-eval-limit (evaluate.<name with underscores>).
Under torchrun (``python -m torch.distributed.run --nproc_per_node N -m titan_core.evaluate.cli
...``) the validation batches are split across ranks and the model is FSDP-sharded.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn

from titan_core.errors import ConfigError, TitanError
from titan_core.evaluate.evaluator import evaluate_checkpoint
from titan_core.logging import init_logger, logger


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one-line ConfigErrors instead of a usage dump."""

    def error(self, message: str) -> NoReturn:
        """Raise instead of printing usage and exiting."""
        raise ConfigError(message)


# Flags kept as aliases of ``[evaluate]`` keys: (flag, key, argparse options).
ALIASES: list[tuple[str, str, dict[str, Any]]] = [
    ("--max-batches", "evaluate.batches", {"type": int}),
    ("--prompts", "evaluate.prompts", {"nargs": "*"}),
    ("--max-new-tokens", "evaluate.max_new_tokens", {"type": int}),
    ("--lm-eval-tasks", "evaluate.lm_eval_tasks", {"nargs": "+"}),
    ("--lm-eval-task-dir", "evaluate.lm_eval_task_dir", {}),
    ("--lm-eval-limit", "evaluate.lm_eval_limit", {"type": float}),
]


def build_parser() -> argparse.ArgumentParser:
    """The ``titan eval`` options; anything else is passed to the config manager."""
    p = _Parser(
        prog="titan eval",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # else --checkpoint.load_step would be taken for --checkpoint
    )
    p.add_argument("--checkpoint", required=True, help="step dir or checkpoint folder (URL)")
    p.add_argument("--output", help="where eval/ is written (default: the run folder)")
    p.add_argument("--hf-folder", default="", help="HF export lm-eval runs on (default <run>/hf)")
    p.add_argument("--module", help="config registry module (with --config)")
    p.add_argument("--config", help="config registry function (with --module)")
    p.add_argument("--config-file", help="TOML job config (instead of the run's config.toml)")
    for flag, key, options in ALIASES:
        p.add_argument(flag, dest=key, metavar="VALUE", help=f"alias of --{key}", **options)
    return p


def _given_keys(argv: list[str]) -> set[str]:
    """Dotted keys that ``--section.field`` tokens of ``argv`` set (either spelling)."""
    return {t[2:].partition("=")[0].replace("-", "_") for t in argv if t.startswith("--")}


def parse_eval_args(argv: list[str]) -> tuple[argparse.Namespace, list[str], dict[str, Any]]:
    """Split ``argv`` into eval options, the config manager's argv (overrides included) and the
    dotted-key values of the alias flags (set on the resolved config)."""
    ns, rest = build_parser().parse_known_args(argv)
    config_argv = list(rest)
    if ns.module is not None and ns.config is None:
        raise ConfigError("--module: names the family of a --config recipe (e.g. --config X)")
    if ns.config is not None:  # the family is found from the recipe name when not given
        module = ["--module", ns.module] if ns.module is not None else []
        config_argv = [*module, "--config", ns.config, *config_argv]
    if ns.config_file is not None:
        config_argv = ["--job.config_file", ns.config_file, *config_argv]
    values = {key: getattr(ns, key) for _, key, _ in ALIASES if getattr(ns, key) is not None}
    given = _given_keys(rest)
    for flag, key, _ in ALIASES:
        if key in values and key in given:
            raise ConfigError(f"{flag}: an alias of --{key}, which is given too; give one")
    return ns, config_argv, values


def main(argv: list[str] | None = None) -> int:
    """Run ``titan eval``; user errors print one ``error: ...`` line and return 2."""
    init_logger()
    try:
        ns, config_argv, values = parse_eval_args(list(sys.argv[1:] if argv is None else argv))
        report = evaluate_checkpoint(
            ns.checkpoint,
            config_argv=config_argv,
            values=values,
            output=ns.output,
            hf_folder=ns.hf_folder,
        )
    except TitanError as e:
        print("error: " + str(e).replace("\n", " "), file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    m = report["metrics"]
    logger.info(
        "step %d: loss %.4f  perplexity %.3f  bits/byte %.4f  (%s tokens, %.0f tokens/s)",
        report["step"],
        m["loss"],
        m["perplexity"],
        m["bits_per_byte"],
        f"{m['num_tokens']:,}",
        report["timing"]["tokens_per_s"],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
