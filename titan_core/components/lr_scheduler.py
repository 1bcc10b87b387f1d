"""Warmup-stable-decay learning-rate schedule (covers warmup+linear/cosine/sqrt decay)."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim.lr_scheduler import LambdaLR

from titan_core.config.job import LRScheduler as LRSchedulerConfig
from titan_core.logging import logger


def wsd_factor(
    step: int,
    *,
    warmup_steps: int,
    stable_steps: int,
    decay_steps: int,
    decay_type: str,
    min_lr_factor: float,
) -> float:
    """LR multiplier at a 0-based scheduler step: linear warmup, flat, then decay to min."""
    if step < warmup_steps:
        # +1 so the first step trains with a small non-zero lr (as torchtitan does).
        return float(step + 1) / (warmup_steps + 1)
    if step < warmup_steps + stable_steps or decay_steps == 0:
        return 1.0
    progress = min(1.0, float(step - warmup_steps - stable_steps + 1) / decay_steps)
    if decay_type == "linear":
        remaining = 1.0 - progress
    elif decay_type == "sqrt":
        remaining = 1.0 - math.sqrt(progress)
    else:
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_factor + (1.0 - min_lr_factor) * remaining


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: LRSchedulerConfig, training_steps: int
) -> LambdaLR:
    """A ``LambdaLR`` following the warmup-stable-decay shape for ``training_steps`` steps.

    A warmup longer than the run (a recipe's 20 warmup steps with ``--training.steps 4``) is
    cut to the run's length with a warning, as torchtitan does."""
    warmup_steps = cfg.warmup_steps
    if warmup_steps > training_steps:
        logger.warning(
            "lr_scheduler.warmup_steps %d exceeds training.steps %d: warming up over all %d "
            "steps instead",
            warmup_steps,
            training_steps,
            training_steps,
        )
        warmup_steps = training_steps
    after_warmup = training_steps - warmup_steps
    if cfg.decay_ratio == -1.0:
        decay_steps = after_warmup
    else:
        decay_steps = min(after_warmup, round(training_steps * cfg.decay_ratio))
    fn = partial(
        wsd_factor,
        warmup_steps=warmup_steps,
        stable_steps=after_warmup - decay_steps,
        decay_steps=decay_steps,
        decay_type=cfg.decay_type,
        min_lr_factor=cfg.min_lr_factor,
    )
    return LambdaLR(optimizer, fn)


class LRSchedulerState(Stateful):
    """Checkpoint view of a ``LambdaLR``: the step count is all that defines its position."""

    def __init__(self, scheduler: LambdaLR) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        """Scheduler position as tensors (DCP-friendly)."""
        return {"last_epoch": torch.tensor(self.scheduler.last_epoch, dtype=torch.int64)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Jump to the saved position and recompute the optimizer's lr from the lambda."""
        last_epoch = int(state_dict["last_epoch"])
        sched = self.scheduler
        sched.last_epoch = last_epoch
        sched._step_count = last_epoch + 1
        for group, base_lr, fn in zip(
            sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True
        ):
            group["lr"] = base_lr * fn(last_epoch)
        sched._last_lr = [g["lr"] for g in sched.optimizer.param_groups]
