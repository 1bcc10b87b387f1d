"""Held-out loss: a fixed number of batches from a fresh pass over the validation split."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from titan_core.config.job import Dataloader, JobConfig, parse_mix
from titan_core.config.job import Validation as ValidationConfig
from titan_core.data.datasets import is_local_dataset
from titan_core.distributed.pipeline_parallel import PipelineRunner

# Called with a batch's (inputs, labels) on the device; the forward and loss run inside it.
BatchContext = Callable[[torch.Tensor, torch.Tensor], contextlib.AbstractContextManager]


def validation_data(cfg: JobConfig) -> dict[str, Any]:
    """Dataset, path, split, text field, seq_len and batch size of the job's validation pass.

    They follow the ``validation`` section as the trainer's validator does: a separate local
    validation file is both the dataset and its path; a registered or Hugging Face name reads
    its validation split, and so does a prepared dataset (with ``dataloader.mix``: the first
    dataset of the mix).
    """
    v, t, d = cfg.validation, cfg.training, cfg.dataloader
    mix = parse_mix(d.mix)
    if v.dataset:
        path = v.dataset if is_local_dataset(v.dataset) else ""
    else:  # a prepared dataset's validation split; under a mix, the first dataset's
        path = "" if mix else d.path
    return {
        "dataset": v.dataset or (mix[0][0] if mix else d.dataset),
        "dataset_path": path,
        "split": v.dataset_split,
        "text_field": d.text_field,
        "seq_len": t.seq_len,
        "local_batch_size": v.local_batch_size if v.local_batch_size > 0 else t.local_batch_size,
    }


def validation_dataloader(cfg: JobConfig) -> Dataloader:
    """``cfg.dataloader`` reading the validation pass's data (``validation_data``): its dataset,
    path and split, no mix, one stream per data-parallel rank."""
    data = validation_data(cfg)
    return dataclasses.replace(
        cfg.dataloader,
        dataset=data["dataset"],
        path=data["dataset_path"],
        split=data["split"],
        mix=[],
        streams=0,
    )


class Validator:
    """Computes mean validation loss over ``cfg.steps`` batches, averaged over ``dp_group``.

    Each run starts the validation loader from its beginning, so runs are comparable step to step.
    ``batch_context(inputs, labels)`` wraps each batch's forward and loss as in training (loss
    parallel, context parallel). Under context parallelism it shards every batch along the
    sequence like a training micro-batch, so no rank ever attends over the full sequence; each
    CP rank then scores an equal share of the tokens and ``dp_group`` must span the data- and
    context-parallel ranks, whose mean is the mean over all tokens.
    """

    def __init__(
        self,
        cfg: ValidationConfig,
        build_loader: Callable[[], object],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        device: torch.device,
        dp_group: dist.ProcessGroup | None = None,
        pp_group: dist.ProcessGroup | None = None,
        batch_context: BatchContext | None = None,
    ) -> None:
        self.cfg = cfg
        self.build_loader = build_loader
        self.loss_fn = loss_fn
        self.device = device
        self.dp_group = dp_group
        self.pp_group = pp_group
        self.batch_context = batch_context

    def should_validate(self, step: int, last: bool) -> bool:
        """Validate every ``freq`` steps and at the last step."""
        return self.cfg.enable and (last or step % self.cfg.freq == 0)

    def _batch_loss(
        self,
        model_parts: list[nn.Module],
        pipeline: PipelineRunner | None,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        inputs, labels = inputs.to(self.device), labels.to(self.device)
        doc_ids = doc_ids.to(self.device) if doc_ids is not None else None
        context = self.batch_context or (lambda *_: contextlib.nullcontext())
        with context(inputs, labels):
            if pipeline is not None:  # forward through the stages; the last one has the loss
                return pipeline.eval_loss(inputs, labels)
            return self.loss_fn(model_parts[0](inputs, doc_ids=doc_ids), labels)

    @torch.no_grad()
    def validate(
        self, model_parts: list[nn.Module], pipeline: PipelineRunner | None = None
    ) -> dict[str, float]:
        """Return ``{"validation/loss", "validation/batches"}``; the model is left in train mode.

        Under pipeline parallelism ``pipeline`` runs the stages in ``model_parts``."""
        for part in model_parts:
            part.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        batches, has_loss = 0, True
        for inputs, labels, *doc_ids in self.build_loader():  # doc_ids under document masking
            if batches == self.cfg.steps:
                break
            loss = self._batch_loss(model_parts, pipeline, inputs, labels, *doc_ids)
            has_loss = loss is not None
            if isinstance(loss, DTensor):  # loss parallel: a replicated DTensor
                loss = loss.to_local()
            total += loss.double() if has_loss else 0.0
            batches += 1
        for part in model_parts:
            part.train()
        stats = torch.tensor([total.item(), float(batches)], dtype=torch.float64)
        if self.dp_group is not None:
            dist.all_reduce(stats, group=self.dp_group)
        if self.pp_group is not None:  # the last stage's result, to every stage's rank
            stats *= float(has_loss)
            dist.all_reduce(stats, group=self.pp_group)
        return {
            "validation/loss": stats[0].item() / max(stats[1].item(), 1.0),
            "validation/batches": stats[1].item(),
        }
