"""Pipeline parallelism on ``torch.distributed.pipelining``, independent of the model family.

A model is split into stages by module names (``split_module``); each rank builds the stages it
owns (``stage_ids_this_rank``: looped or V-shaped), wraps them in ``PipelineStage`` objects and one
schedule (``PipelineRunner``). ``ModelPartsView`` presents a rank's parts as one module whose
state-dict keys are those of the unsplit model, so checkpoints reshard across PP degrees.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    get_schedule_class,
)

from titan_core.errors import ConfigError

SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
LOOPED_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
SCHEDULES = (*SINGLE_STAGE_SCHEDULES, *LOOPED_SCHEDULES, *V_SCHEDULES)
# Split backward into input and weight gradients, the weight part deferred.
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", *V_SCHEDULES)
_KEY = "parallelism.pipeline_parallel_schedule"


def resolve_schedule(name: str) -> str:
    """The canonical spelling of schedule ``name`` (case-insensitive); ConfigError if unknown."""
    by_lower = {s.lower(): s for s in SCHEDULES}
    if name.lower() not in by_lower:
        raise ConfigError(f"{_KEY}: expected one of {', '.join(SCHEDULES)}, got {name!r}")
    return by_lower[name.lower()]


def stages_per_rank(schedule: str) -> int | None:
    """Stages each rank must hold for ``schedule``: 1, 2 (V-shaped), or None (any >= 2)."""
    if schedule in SINGLE_STAGE_SCHEDULES:
        return 1
    return 2 if schedule in V_SCHEDULES else None


def validate_schedule(
    schedule: str, pp: int, num_stages: int, num_microbatches: int, stage_key: str, compiled: bool
) -> None:
    """Check that ``schedule`` can run ``num_stages`` stages on ``pp`` ranks with this many
    microbatches; ``stage_key`` names the config key that chose the stage count."""
    per_rank = stages_per_rank(schedule)
    if per_rank is not None and num_stages != per_rank * pp:
        what = "one stage per rank" if per_rank == 1 else "two stages per rank (V shape)"
        raise ConfigError(
            f"{stage_key}: {schedule} runs {what}, i.e. {per_rank * pp} stages on {pp} ranks, "
            f"got {num_stages}"
        )
    if per_rank is None and (num_stages % pp or num_stages < 2 * pp):
        raise ConfigError(
            f"{stage_key}: looped schedule {schedule} needs a multiple of {pp} stages with at "
            f"least two per rank, got {num_stages} (use GPipe or 1F1B for one stage per rank)"
        )
    mb_key = "parallelism.pipeline_parallel_microbatch_size"
    if schedule in ("1F1B", "DualPipeV") and num_microbatches < num_stages:
        raise ConfigError(
            f"{mb_key}: {schedule} needs at least as many microbatches as stages ({num_stages}), "
            f"got {num_microbatches} (training.local_batch_size / microbatch size)"
        )
    rounds = max(1, num_microbatches // pp)
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and num_microbatches % rounds:
        raise ConfigError(
            f"{mb_key}: {schedule} needs the microbatch count ({num_microbatches}) to be a "
            f"multiple of its rounds ({rounds} = microbatches // {pp})"
        )
    if compiled and schedule in ZERO_BUBBLE_SCHEDULES:
        raise ConfigError(
            f"{_KEY}: {schedule} (backward split into input and weight parts) cannot run "
            "torch.compile'd stages in torch 2.13; disable compile.enable or pick another schedule"
        )


def num_microbatches(local_batch_size: int, microbatch_size: int) -> int:
    """Microbatches per step; ConfigError when the size does not divide the local batch."""
    if local_batch_size % microbatch_size:
        raise ConfigError(
            "parallelism.pipeline_parallel_microbatch_size: expected a divisor of "
            f"training.local_batch_size ({local_batch_size}), got {microbatch_size}"
        )
    return local_batch_size // microbatch_size


def stage_ids_this_rank(pp_rank: int, pp: int, num_stages: int, schedule: str) -> list[int]:
    """Stages owned by ``pp_rank``: round-robin (loop), or stage i and its mirror (V shape)."""
    if schedule in V_SCHEDULES:
        return [pp_rank, num_stages - 1 - pp_rank]
    return list(range(pp_rank, num_stages, pp))


def split_module(whole: nn.Module, keep: Sequence[str]) -> nn.Module:
    """A copy of ``whole`` (on meta) holding only the top-level modules and ``ModuleDict``
    entries named in ``keep`` (``"tok_embeddings"``, ``"layers.3"``); the rest become None or
    are removed, which the model's forward must tolerate."""
    part = copy.deepcopy(whole)
    names = set(keep)
    for name, child in list(part.named_children()):
        if isinstance(child, nn.ModuleDict):
            for key in list(child.keys()):
                if f"{name}.{key}" not in names:
                    del child[key]
        elif name not in names:
            setattr(part, name, None)
    return part


class ModelPartsView(nn.Module):
    """One module over this rank's pipeline parts, named as in the unsplit model.

    It owns nothing: its children are the parts' own submodules (``ModuleDict`` entries merged),
    so ``state_dict``, ``parameters`` and the optimizer's FQN mapping see the same names as a
    model built without pipeline parallelism. Run the pipeline schedule, not this module.
    """

    def __init__(self, parts: Sequence[nn.Module]) -> None:
        super().__init__()
        for part in parts:
            for name, child in part.named_children():
                if isinstance(child, nn.ModuleDict):
                    if name not in self._modules:
                        self.add_module(name, nn.ModuleDict())
                    self._modules[name].update(child)
                elif child is not None:
                    self.add_module(name, child)

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        """Not runnable: the stages run through ``PipelineRunner``."""
        raise RuntimeError("ModelPartsView holds pipeline parts; run them with PipelineRunner")


class _ScaledLoss:
    """The schedule's loss: ``loss_fn`` times a factor set before each step (the microbatch and
    gradient-accumulation average, since the schedule sums microbatch gradients)."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.loss_fn = loss_fn
        self.scale = 1.0

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(pred, labels) * self.scale


@dataclass
class PipelineRunner:
    """This rank's stages and their schedule; ``step`` trains, ``eval_loss`` only forwards."""

    schedule: object
    stages: list[PipelineStage]
    loss: _ScaledLoss
    num_microbatches: int
    stage_to_rank: dict[int, int]
    device: torch.device

    @classmethod
    def build(
        cls,
        parts: Sequence[nn.Module],
        stage_ids: Sequence[int],
        num_stages: int,
        schedule_name: str,
        num_microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        device: torch.device,
        group: dist.ProcessGroup,
    ) -> PipelineRunner:
        """Wrap ``parts`` (already parallelized) as stages ``stage_ids`` and build the schedule."""
        stages = [
            PipelineStage(part, stage_id, num_stages, device, group=group)
            for part, stage_id in zip(parts, stage_ids, strict=True)
        ]
        loss = _ScaledLoss(loss_fn)
        schedule_cls = get_schedule_class(schedule_name)
        multi = issubclass(schedule_cls, PipelineScheduleMulti)
        # Gradients are averaged by the loss scale, not by the schedule (scale_grads=False), so
        # the reported loss and the gradients agree with an unsplit model's.
        schedule = schedule_cls(
            stages if multi else stages[0],
            n_microbatches=num_microbatches,
            loss_fn=loss,
            scale_grads=False,
        )
        pp = dist.get_world_size(group)
        owners = {
            s: r for r in range(pp) for s in stage_ids_this_rank(r, pp, num_stages, schedule_name)
        }
        return cls(schedule, stages, loss, num_microbatches, owners, device)

    @property
    def has_first_stage(self) -> bool:
        """Whether this rank feeds tokens in (holds stage 0)."""
        return any(stage.is_first for stage in self.stages)

    @property
    def has_last_stage(self) -> bool:
        """Whether this rank computes the loss (holds the last stage)."""
        return any(stage.is_last for stage in self.stages)

    def step(self, inputs: torch.Tensor, labels: torch.Tensor, scale: float) -> torch.Tensor:
        """Forward and backward of one batch in microbatches; the detached loss times ``scale``
        on the last stage's rank, zero elsewhere."""
        self.loss.scale = scale / self.num_microbatches
        losses: list[torch.Tensor] | None = [] if self.has_last_stage else None
        target = labels if self.has_last_stage else None
        args = (inputs,) if self.has_first_stage else ()
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack(losses).sum().detach()

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """Mean loss of one whole batch, forward only; None on ranks without the last stage."""
        logits = self.eval_logits(inputs)
        return None if logits is None else self.loss.loss_fn(logits, labels)

    @torch.no_grad()
    def eval_logits(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """The last stage's output (logits) of one whole batch of any shape, forward only;
        None on ranks without the last stage.

        Stages run in order and pass activations point to point, without the schedule: the
        V-shaped schedules cannot run forward-only (``schedule.eval`` fails in torch 2.13)."""
        local = {stage.stage_index: stage for stage in self.stages}
        group = self.stages[0].group
        rank = dist.get_rank(group)
        h = inputs  # tokens (bs, seq), then hidden states (bs, seq, dim)
        for idx in range(len(self.stage_to_rank)):
            prev = self.stage_to_rank.get(idx - 1)
            if self.stage_to_rank[idx] != rank:
                if prev == rank:
                    _send(h, self.stage_to_rank[idx], group)
                continue
            if prev is not None and prev != rank:
                h = _recv(prev, group, self.device)
            h = local[idx].submod(h)
        return h if self.has_last_stage else None


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)
_HEADER = 8  # dtype index, ndim, then up to six dims


def _send(t: torch.Tensor, group_dst: int, group: dist.ProcessGroup) -> None:
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = _DTYPES.index(t.dtype), t.dim()
    header[2 : 2 + t.dim()] = torch.tensor(t.shape)
    dist.send(header.to(t.device), group=group, group_dst=group_dst)
    dist.send(t.contiguous(), group=group, group_dst=group_dst)


def _recv(group_src: int, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, group=group, group_src=group_src)
    dtype, ndim = _DTYPES[int(header[0])], int(header[1])
    t = torch.empty(header[2 : 2 + ndim].tolist(), dtype=dtype, device=device)
    dist.recv(t, group=group, group_src=group_src)
    return t
