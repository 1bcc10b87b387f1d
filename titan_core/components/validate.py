"""Held-out loss: a fixed number of batches from a fresh pass over the validation split."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titan_core.config.job import JobConfig
from titan_core.config.job import Validation as ValidationConfig
from titan_core.data.datasets import is_local_dataset


def validation_data(cfg: JobConfig) -> dict[str, Any]:
    """Dataset, path, split, text field, seq_len and batch size of the job's validation pass.

    They follow the ``validation`` section as the trainer's validator does: a separate local
    validation file is both the dataset and its path; a registered or Hugging Face name reads
    its validation split.
    """
    v, t = cfg.validation, cfg.training
    if v.dataset:
        path = v.dataset if is_local_dataset(v.dataset) else ""
    else:
        path = t.dataset_path
    return {
        "dataset": v.dataset or t.dataset,
        "dataset_path": path,
        "split": v.dataset_split,
        "text_field": t.dataset_text_field,
        "seq_len": t.seq_len,
        "local_batch_size": v.local_batch_size if v.local_batch_size > 0 else t.local_batch_size,
    }


class Validator:
    """Computes mean validation loss over ``cfg.steps`` batches, averaged over data-parallel ranks.

    Each run starts the validation loader from its beginning, so runs are comparable step to step.
    """

    def __init__(
        self,
        cfg: ValidationConfig,
        build_loader: Callable[[], object],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        device: torch.device,
        dp_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.cfg = cfg
        self.build_loader = build_loader
        self.loss_fn = loss_fn
        self.device = device
        self.dp_group = dp_group

    def should_validate(self, step: int, last: bool) -> bool:
        """Validate every ``freq`` steps and at the last step."""
        return self.cfg.enable and (last or step % self.cfg.freq == 0)

    @torch.no_grad()
    def validate(self, model: nn.Module) -> dict[str, float]:
        """Return ``{"validation/loss", "validation/batches"}``; the model is left in train mode."""
        model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        batches = 0
        for inputs, labels in self.build_loader():
            if batches == self.cfg.steps:
                break
            pred = model(inputs.to(self.device))
            total += self.loss_fn(pred, labels.to(self.device)).double()
            batches += 1
        model.train()
        stats = torch.tensor([total.item(), float(batches)], dtype=torch.float64)
        if self.dp_group is not None:
            dist.all_reduce(stats, group=self.dp_group)
        return {
            "validation/loss": stats[0].item() / max(stats[1].item(), 1.0),
            "validation/batches": stats[1].item(),
        }
