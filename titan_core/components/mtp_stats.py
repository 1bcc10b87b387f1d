"""Per-step multi-token prediction bookkeeping for the trainer: the MTP loss's gradient scale
and its metric.

A model that trains MTP modules (``models.common.mtp``) adds their loss to its own gradient in
``forward`` and exposes three attributes, found here by name (no family is named):
``mtp_context_parallel`` is set once to the CP degree (its loss's share of a split window);
before each step ``mtp_loss_scale`` is set to the factor each forward's training loss gets, 1 /
(gradient-accumulation steps x pipeline microbatches), as ``MoEStats`` sets the aux loss's; and
``mtp_loss``, the detached mean MTP loss of its last training forward (None when it computed
none), is recorded after every training forward. On log steps the recorded values are averaged
over microbatches and the data x context parallel ranks (and pipeline stages: only a stage
holding MTP modules records any) with one all-reduce: the metric ``mtp/loss``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

METRIC = "mtp/loss"


def _in_backward() -> bool:
    """True during autograd's backward (activation checkpointing's recompute)."""
    return torch._C._current_graph_task_id() != -1


class MTPStats:
    """The MTP-training modules of this rank's model parts and their per-step loss."""

    def __init__(
        self,
        model: nn.Module,
        group: dist.ProcessGroup | None,
        pp_group: dist.ProcessGroup | None,
        device: torch.device | None = None,
        context_parallel: int = 1,
    ) -> None:
        self.modules = [m for m in model.modules() if hasattr(m, "mtp_loss_scale")]
        for module in self.modules:  # its loss's share of a window CP splits (``mtp_losses``)
            module.mtp_context_parallel = context_parallel
        self.group = group
        self.pp_group = pp_group
        self.device = device or torch.device("cpu")
        self._values: list[torch.Tensor] = []
        for module in self.modules:
            module.register_forward_hook(self._record)

    def _record(self, module: nn.Module, args: Any, out: Any) -> None:
        loss = getattr(module, "mtp_loss", None)
        if module.training and torch.is_grad_enabled() and not _in_backward() and loss is not None:
            self._values.append((loss.to_local() if isinstance(loss, DTensor) else loss).float())

    def start_step(self, loss_scale: float) -> None:
        """Before a step's first forward: set each forward's MTP gradient factor, the one its
        training loss gets, and forget the last step's values."""
        for module in self.modules:
            module.mtp_loss_scale = loss_scale
        self._values.clear()

    def end_step(self, log: bool) -> dict[str, float]:
        """After the step: on ``log`` steps ``{"mtp/loss": mean}`` over microbatches and ranks
        (empty otherwise, or when no forward recorded an MTP loss)."""
        if not self.modules or not log:
            return {}
        device = self._values[0].device if self._values else self.device
        total = torch.zeros(2, device=device)  # (sum, count)
        if self._values:
            total[0] = torch.stack(self._values).sum()
            total[1] = len(self._values)
        for group in (self.group, self.pp_group):
            if group is not None:
                dist.all_reduce(total, group=group)
        loss_sum, count = total.tolist()
        return {METRIC: loss_sum / count} if count > 0 else {}
