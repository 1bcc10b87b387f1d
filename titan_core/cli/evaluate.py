"""``titan eval``: held-out metrics, greedy samples and an optional lm-eval run for a checkpoint.

    titan eval --checkpoint URL [--output URL] [--hf-folder URL]
               [--module M --config C | --config-file PATH] [--section.field VALUE ...]

What to evaluate is the job config's ``[evaluate]`` section (``evaluate.batches``,
``evaluate.prompts``, ``evaluate.max_new_tokens``, ``evaluate.lm_eval_*``) and the validation
data (``validation.*``). The job config defaults to the run's own ``config.toml`` (two levels
above a step directory), else to the defaults with the model the checkpoint's commit marker
describes (every checkpoint ``titan train`` and ``titan convert hf-to-dcp`` write does);
``--section.field value`` overrides apply on top (``titan config --help`` lists them).
Under torchrun (``python -m torch.distributed.run --nproc_per_node N -m titan_core.cli eval
...``) the validation batches are split across ranks and the model is FSDP-sharded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Annotated, Any

from titan_core.cli.command import Command, default, run
from titan_core.evaluate.evaluator import evaluate_checkpoint
from titan_core.logging import init_logger, logger

FROM_CONFIG = default("the config's")


@dataclass(kw_only=True)
class EvalOptions:
    """The options of ``titan eval`` (config arguments aside)."""

    checkpoint: str
    """step dir or checkpoint folder (path or URL)"""
    output: Annotated[str, default("the run folder")] = ""
    """where eval/ is written"""
    hf_folder: Annotated[str, default("<run>/hf")] = ""
    """HF export that lm-eval runs on"""
    max_batches: Annotated[int, FROM_CONFIG] = 0
    """alias of --evaluate.batches"""
    prompts: Annotated[list[str], FROM_CONFIG] = field(default_factory=list)
    """alias of --evaluate.prompts (whole strings, commas included)"""
    max_new_tokens: Annotated[int, FROM_CONFIG] = 0
    """alias of --evaluate.max_new_tokens"""
    lm_eval_tasks: Annotated[list[str], FROM_CONFIG] = field(default_factory=list)
    """alias of --evaluate.lm_eval_tasks"""
    lm_eval_task_dir: Annotated[str, FROM_CONFIG] = ""
    """alias of --evaluate.lm_eval_task_dir"""
    lm_eval_limit: Annotated[float, FROM_CONFIG] = 0.0
    """alias of --evaluate.lm_eval_limit"""


# Options kept as aliases of ``[evaluate]`` keys (used only when given).
ALIASES = {
    name: f"evaluate.{name}"
    for name in ("prompts", "max_new_tokens", "lm_eval_tasks", "lm_eval_task_dir", "lm_eval_limit")
} | {"max_batches": "evaluate.batches"}
COMMAND = Command("titan eval", EvalOptions, __doc__ or "", aliases=ALIASES)


def parse_eval_args(argv: list[str]) -> tuple[EvalOptions, list[str], dict[str, Any]]:
    """Split ``argv`` into the eval options, the config manager's argv (overrides included) and
    the dotted-key values of the alias options given (set on the resolved config)."""
    parsed = COMMAND.parse(argv)
    return parsed.options, parsed.config.argv(), COMMAND.alias_values(parsed)


def main(argv: list[str] | None = None) -> int:
    """Run ``titan eval``; user errors print one ``error: ...`` line and return 2."""
    return run(_eval, argv)


def _eval(argv: list[str]) -> int:
    init_logger()
    ns, config_argv, values = parse_eval_args(argv)
    report = evaluate_checkpoint(
        ns.checkpoint,
        config_argv=config_argv,
        values=values,
        output=ns.output or None,
        hf_folder=ns.hf_folder,
    )
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
