"""``titan estimate``: per-rank memory and FLOPs of a job on N ranks, without real weights.

    titan estimate --ngpu 8 --module llama3 --config llama3_8b [--json] [--device-memory 80]
    python -m titan_core.cli estimate --ngpu 1 --config-file job.toml --training.seq_len 512

The config arguments resolve exactly as for ``titan train``.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass

from titan_core.cli.command import Command, run
from titan_core.errors import ConfigError
from titan_core.estimate import estimate, fits
from titan_core.estimate.report import GIB, print_report
from titan_core.logging import logs_to_stderr
from titan_core.resolve import parse_args


@dataclass
class EstimateOptions:
    """The options of ``titan estimate`` (config arguments aside)."""

    ngpu: int = 1
    """world size to estimate for"""
    json: bool = False
    """print JSON instead of a table"""
    device_memory: float = 0.0
    """GiB per device: report whether the peak fits"""


COMMAND = Command("titan estimate", EstimateOptions, __doc__ or "")


def main(argv: list[str] | None = None) -> int:
    """Print the estimate as a table (or JSON); one ``error:`` line and 2 on bad input."""
    return run(_estimate, argv)


def _estimate(argv: list[str]) -> int:
    parsed = COMMAND.parse(argv)
    ns = parsed.options
    if ns.device_memory < 0:
        raise ConfigError(f"--device-memory: expected GiB >= 0, got {ns.device_memory}")
    with logs_to_stderr() if ns.json else contextlib.nullcontext():  # stdout: the JSON alone
        est = estimate(parse_args(parsed.config.argv()), ns.ngpu)
    device_bytes = int(ns.device_memory * GIB)
    if ns.json:
        out = est.to_dict()
        if device_bytes:
            out["device_memory_bytes"] = device_bytes
            out["fits"] = fits(est.memory, device_bytes)
        print(json.dumps(out, indent=2))
    else:
        print_report(est, device_bytes)
    return 0
