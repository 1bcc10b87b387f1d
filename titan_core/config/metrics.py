"""Which way each metric improves, and which metric names a run logs: the one place the champion
gate (``tracking.champion_metric``), a sweep's ranking (``--metric``) and its early stopping
(``early_stop.metric``) read.

A metric is known by its last part (``eval/ns/acc`` by ``acc``): accuracies rise, losses,
perplexities, bits per byte and seconds fall. The names a pipeline run logs are
``train/loss``, the evaluate stage's ``eval/loss``, ``eval/perplexity`` and
``eval/bits_per_byte``, and ``eval/<name>/<metric>`` of each evaluator of ``evaluators.sets``
(in-loop while training, and again by the evaluate stage on the final checkpoint).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

from titan_core.errors import ConfigError

Direction = Literal["higher", "lower"]

DIRECTIONS: dict[str, Direction] = {
    "acc": "higher",
    "acc_per_token": "higher",
    "acc_per_char": "higher",
    "loss": "lower",
    "perplexity": "lower",
    "bits_per_byte": "lower",
    "seconds": "lower",
}
"""Each metric's better direction, by the last part of its name."""

EVALUATOR_METRICS: dict[str, tuple[str, ...]] = {
    "heldout": ("loss", "perplexity", "bits_per_byte", "seconds"),
    "task": ("acc", "acc_per_token", "acc_per_char", "bits_per_byte", "seconds"),
}
"""What an evaluator of each kind logs as ``eval/<name>/<metric>``."""

RUN_METRICS = ("train/loss", "eval/loss", "eval/perplexity", "eval/bits_per_byte")
"""Metrics every pipeline run logs, evaluators or not."""

LIVE_METRICS = ("train/loss",)
"""Metrics a train stage run logs while it trains, evaluators' aside (early stopping reads
those)."""


def direction(name: str) -> Direction:
    """``higher`` or ``lower``: which way ``name`` (``eval/ns/acc``, ``train/loss``) improves,
    by its last part; a ConfigError for a name of no known kind."""
    last = name.rsplit("/", 1)[-1]
    if last not in DIRECTIONS:
        raise ConfigError(
            f"metric {name!r}: no known direction for {last!r} (known: {', '.join(DIRECTIONS)})"
        )
    return DIRECTIONS[last]


def higher_is_better(name: str) -> bool:
    """Whether a larger value of ``name`` is better."""
    return direction(name) == "higher"


def is_better(name: str, value: float, than: float | None) -> bool:
    """Whether ``value`` of metric ``name`` beats ``than`` strictly (None: nothing to beat). A
    NaN value never wins; a NaN ``than`` loses to any number."""
    if math.isnan(value):
        return False
    if than is None or math.isnan(than):
        return True
    return value > than if higher_is_better(name) else value < than


def best_of(name: str, values: list[float]) -> float:
    """The best of ``values`` by ``name``'s direction."""
    return max(values) if higher_is_better(name) else min(values)


def evaluator_metrics(evaluators: Mapping[str, str]) -> list[str]:
    """``eval/<name>/<metric>`` of every evaluator (``evaluators``: name -> kind)."""
    return [f"eval/{n}/{m}" for n, kind in evaluators.items() for m in EVALUATOR_METRICS[kind]]


def check_metric(
    name: str,
    key: str,
    evaluators: Mapping[str, str],
    plain: tuple[str, ...] = RUN_METRICS,
) -> str:
    """``name`` when a run logs it: one of ``plain``, or ``eval/<name>/<metric>`` of an
    evaluator of ``evaluators`` (name -> kind, as in ``evaluators.sets``); else one ConfigError
    line naming ``key`` and what it accepts."""
    if name in plain or name in evaluator_metrics(evaluators):
        return name
    parts = name.split("/")
    why = ""
    if len(parts) == 3 and parts[0] == "eval":
        if parts[1] not in evaluators:
            named = ", ".join(evaluators) or "none"
            why = f"; no evaluator {parts[1]!r} in evaluators.sets (its names: {named})"
        else:
            kind = evaluators[parts[1]]
            why = f"; a {kind} evaluator logs {', '.join(EVALUATOR_METRICS[kind])}"
    raise ConfigError(
        f"{key}: expected {', '.join(plain)} or eval/<name>/<metric> of an evaluator in "
        f"evaluators.sets, got {name!r}{why}"
    )
