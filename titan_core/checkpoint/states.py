"""``Stateful`` views of the model and the training progress, as DCP saves them."""

from __future__ import annotations

import pickle
import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from titan_core.logging import logger

_RNG_KEY = "train_state.rng_rank_"


class ModelState(Stateful):
    """FQN-keyed model weights (DTensors stay sharded, so DCP reshards on load)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        """Model parameters and persistent buffers."""
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load strictly: a checkpoint that lacks or adds a tensor is an error."""
        set_model_state_dict(self.model, state_dict)


@dataclass
class TrainState(Stateful):
    """Step, tokens seen and this rank's RNG states."""

    rank: int = 0
    step: int = 0
    ntokens_seen: int = 0

    def state_dict(self) -> dict[str, Any]:
        """Counters as tensors; RNG states as bytes under a per-rank key."""
        rng = {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python": random.getstate(),
        }
        return {
            "step": torch.tensor(self.step, dtype=torch.int64),
            "ntokens_seen": torch.tensor(self.ntokens_seen, dtype=torch.int64),
            f"rng_rank_{self.rank}": pickle.dumps(rng),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore counters and RNG states."""
        self.step = int(state_dict["step"])
        self.ntokens_seen = int(state_dict["ntokens_seen"])
        rng = pickle.loads(state_dict[f"rng_rank_{self.rank}"])
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        random.setstate(rng["python"])


class LoadPlanner(DefaultLoadPlanner):
    """DCP's strict load planner, except for per-rank RNG states: a checkpoint saved by a
    smaller world (e.g. one process, resumed under TP 2) has none for the extra ranks, which
    then keep their seeded RNG instead of failing the load."""

    def create_local_plan(self) -> LoadPlan:
        """The default plan without the RNG keys the checkpoint lacks."""
        stored = self.metadata.state_dict_metadata
        for key in [k for k in self.state_dict if k.startswith(_RNG_KEY) and k not in stored]:
            del self.state_dict[key]
            logger.warning(
                "Checkpoint has no %s (saved by another world size): this rank keeps its "
                "seeded RNG state",
                key,
            )
        return super().create_local_plan()
