"""``Stateful`` views of the model and the training progress, as DCP saves them."""

from __future__ import annotations

import io
import pickle
import random
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from titan_core.errors import CheckpointError
from titan_core.logging import logger

_RNG_KEY = "train_state.rng_rank_"  # + "<rank>.<generator>" once DCP flattens the state


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


def capture_rng_state() -> dict[str, torch.Tensor]:
    """This process's RNG states as tensors: torch's CPU generator (uint8), Python's Mersenne
    Twister (version + 625 words as int64; the cached Gaussian as [present, value] float64) and,
    with CUDA, the current device's generator (the only one this rank draws from)."""
    version, words, gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor([version, *words], dtype=torch.int64),  # (626,)
        "python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, torch.Tensor]) -> None:
    """Restore what ``capture_rng_state`` returned (a CUDA state only where CUDA is present)."""
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    version, *words = state["python"].tolist()
    has_gauss, gauss = state["python_gauss"].tolist()
    random.setstate((version, tuple(words), gauss if has_gauss else None))


@dataclass
class TrainState(Stateful):
    """Step, tokens seen and this rank's RNG states, all as tensors (nothing to unpickle)."""

    rank: int = 0
    step: int = 0
    ntokens_seen: int = 0

    def state_dict(self) -> dict[str, Any]:
        """Counters, and the RNG states under a per-rank key (``rng_rank_<rank>.<generator>``)."""
        return {
            "step": torch.tensor(self.step, dtype=torch.int64),
            "ntokens_seen": torch.tensor(self.ntokens_seen, dtype=torch.int64),
            f"rng_rank_{self.rank}": capture_rng_state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore counters and RNG states. States the planner left out (see ``LoadPlanner``)
        still hold this rank's current ones, so restoring them changes nothing."""
        self.step = int(state_dict["step"])
        self.ntokens_seen = int(state_dict["ntokens_seen"])
        restore_rng_state(state_dict[f"rng_rank_{self.rank}"])


class LoadPlanner(DefaultLoadPlanner):
    """DCP's strict load planner, with two differences.

    Per-rank RNG states may be missing: a checkpoint saved by a smaller world (e.g. one
    process, resumed under TP 2), or without CUDA, has none for the extra ranks or the CUDA
    generator, which then keep their seeded state instead of failing the load.

    Non-tensor entries (the optimizer's hyper-parameters: floats, tuples, None) are read with
    torch's weights-only unpickler, which builds plain values and refuses any other object;
    DCP's own ``torch.load(..., weights_only=False)`` would run whatever code the file names.
    """

    def create_local_plan(self) -> LoadPlan:
        """The default plan without the RNG keys the checkpoint lacks."""
        stored = self.metadata.state_dict_metadata
        for key in [k for k in self.state_dict if k.startswith(_RNG_KEY) and k not in stored]:
            del self.state_dict[key]
            logger.warning(
                "Checkpoint has no %s (saved by another world size or without CUDA): this "
                "rank keeps its seeded RNG state",
                key,
            )
        return super().create_local_plan()

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Store a non-tensor entry if it is a plain value; CheckpointError otherwise."""
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            # torch's message is a paragraph of advice; keep the line that names the object.
            why = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
            detail = f" (unexpected global {why.group(1)})" if why else ""
            raise CheckpointError(
                f"checkpoint: {fqn} is not a tensor or plain value; refusing to load it{detail}"
            ) from e
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
