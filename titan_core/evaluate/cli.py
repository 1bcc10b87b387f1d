"""``titan eval``: held-out metrics, greedy samples and an optional lm-eval run for a checkpoint.

    titan eval --checkpoint URL [--output URL] [--prompts TEXT ...] [--max-new-tokens N]
               [--max-batches N] [--module M --config C | --config-file PATH]
               [--lm-eval-tasks T ... --lm-eval-task-dir DIR [--hf-folder URL] [--lm-eval-limit N]]
               [--section.field VALUE ...]

The job config defaults to the run's own ``config.toml`` (two levels above a step directory),
else to the defaults with the model the checkpoint's commit marker describes (every checkpoint
``titan train`` and ``titan convert hf-to-dcp`` write does); ``--section.field value`` overrides
apply on top (``titan config --help`` lists them). Under
torchrun (``python -m torch.distributed.run --nproc_per_node N -m titan_core.evaluate.cli ...``)
the validation batches are split across ranks and the model is FSDP-sharded.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from titan_core.errors import ConfigError, TitanError
from titan_core.evaluate.evaluator import evaluate_checkpoint
from titan_core.evaluate.generate import DEFAULT_MAX_NEW_TOKENS, DEFAULT_PROMPTS
from titan_core.evaluate.harness import LmEvalOptions
from titan_core.logging import init_logger, logger


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one-line ConfigErrors instead of a usage dump."""

    def error(self, message: str) -> NoReturn:
        """Raise instead of printing usage and exiting."""
        raise ConfigError(message)


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
    p.add_argument(
        "--prompts",
        nargs="*",
        default=list(DEFAULT_PROMPTS),
        help="prompts for greedy samples; give none to skip generation",
    )
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--max-batches", type=int, default=0, help="0 scores the whole split")
    p.add_argument("--module", help="config registry module (with --config)")
    p.add_argument("--config", help="config registry function (with --module)")
    p.add_argument("--config-file", help="TOML job config (instead of the run's config.toml)")
    p.add_argument("--lm-eval-tasks", nargs="+", help="lm-eval task names (needs [eval] extra)")
    p.add_argument("--lm-eval-task-dir", help="local folder of lm-eval task YAMLs")
    p.add_argument("--lm-eval-limit", type=float, help="documents per task (fraction if < 1)")
    p.add_argument("--hf-folder", default="", help="HF export to run lm-eval on (default <run>/hf)")
    return p


def parse_eval_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Split ``argv`` into eval options and the config manager's argv (overrides included)."""
    ns, rest = build_parser().parse_known_args(argv)
    config_argv = list(rest)
    if ns.module is not None and ns.config is None:
        raise ConfigError("--module: names the family of a --config recipe (e.g. --config X)")
    if ns.config is not None:  # the family is found from the recipe name when not given
        module = ["--module", ns.module] if ns.module is not None else []
        config_argv = [*module, "--config", ns.config, *config_argv]
    if ns.config_file is not None:
        config_argv = ["--job.config_file", ns.config_file, *config_argv]
    lm_flags = (ns.lm_eval_task_dir, ns.lm_eval_limit, ns.hf_folder or None)
    if ns.lm_eval_tasks is None and any(f is not None for f in lm_flags):
        raise ConfigError("--lm-eval-tasks: required with the other --lm-eval-*/--hf-folder flags")
    if ns.lm_eval_tasks is not None and ns.lm_eval_task_dir is None:
        raise ConfigError("--lm-eval-task-dir: required with --lm-eval-tasks")
    return ns, config_argv


def main(argv: list[str] | None = None) -> int:
    """Run ``titan eval``; user errors print one ``error: ...`` line and return 2."""
    init_logger()
    try:
        ns, config_argv = parse_eval_args(list(sys.argv[1:] if argv is None else argv))
        lm_eval = None
        if ns.lm_eval_tasks is not None:
            lm_eval = LmEvalOptions(
                tasks=ns.lm_eval_tasks,
                task_dir=ns.lm_eval_task_dir,
                hf_folder=ns.hf_folder,
                limit=ns.lm_eval_limit,
            )
        report = evaluate_checkpoint(
            ns.checkpoint,
            config_argv=config_argv,
            output=ns.output,
            prompts=ns.prompts,
            max_new_tokens=ns.max_new_tokens,
            max_batches=ns.max_batches,
            lm_eval=lm_eval,
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
