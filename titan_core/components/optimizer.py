"""Optimizer construction and its checkpointable (DCP ``Stateful``) view."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from titan_core.config.job import Optimizer as OptimizerConfig


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW/Adam over all trainable parameters, with the configured kernel implementation."""
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs: dict[str, Any] = {
        "lr": cfg.lr,
        "betas": (cfg.beta1, cfg.beta2),
        "eps": cfg.eps,
        "weight_decay": cfg.weight_decay,
        "foreach": cfg.implementation == "foreach",
        "fused": cfg.implementation == "fused",
    }
    cls = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
    return cls(params, **kwargs)


class OptimizerState(Stateful):
    """Checkpoint view of an optimizer keyed by parameter FQN, so it reshards under DCP."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        """Flattened FQN-keyed optimizer state (DTensors stay sharded)."""
        return get_optimizer_state_dict(
            self.model, self.optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from a flattened FQN-keyed state."""
        set_optimizer_state_dict(
            self.model,
            self.optimizer,
            optim_state_dict=state_dict,
            options=StateDictOptions(flatten_optimizer_state_dict=True),
        )
