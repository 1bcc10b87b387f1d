"""Expert parallelism: each MoE layer's routed experts spread over the ``ep`` ranks, tokens sent
to the rank that holds their expert with an all-to-all and back.

Every rank routes its own tokens (the router is replicated). ``ExpertParallelDispatcher``
replaces ``MoE.dispatcher``: it exchanges how many rows each rank sends to each expert, sends
the rows (uneven ``all_to_all_single``, an autograd function whose backward is the reverse
all-to-all), regroups the received rows by local expert (stably: source rank, then token
order), runs this rank's experts, and undoes all of it. The expert weights are DTensors sharded
on the expert dim over the ``ep`` mesh (with tensor parallelism: over ``(ep, tp)``, the TP
shard on the hidden dim), so checkpoints reshard between layouts like any other DTensor.

The ``ep`` ranks are carved from the FSDP x CP ranks (``ParallelDims``): what is left of FSDP
shards each expert (``expert_fsdp_mesh_dims``), see ``models.common.parallelize``, which finds
the model's MoE layers and passes them in: nothing here knows a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from titan_core.distributed.parallel_dims import ParallelDims


class ExpertLayer(Protocol):
    """What expert parallelism wires in an MoE layer (``models.common.moe.MoE`` is one)."""

    dispatcher: Any
    """Runs rows sorted by expert through ``experts`` (set here: the all-to-all dispatcher)."""
    load_balance_group: dist.ProcessGroup | None
    """The ranks whose tokens the aux loss's per-expert fractions count together."""

    @property
    def experts(self) -> nn.Module:
        """The routed experts, ``experts(rows, counts)``; each weight stacked on dim 0 by expert."""
        ...


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; backward sends the gradients back the same way
    (the reverse all-to-all)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Send ``in_splits[j]`` rows of ``x`` (in order) to rank j of ``group``; returns the rows
    received, ``out_splits[i]`` from rank i. Differentiable (backward: the reverse exchange)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class ExpertParallelDispatcher:
    """``MoE.dispatcher`` under expert parallelism: rank ``r`` of ``group`` (size ``ep``) holds
    global experts ``r * local .. (r + 1) * local - 1`` of ``num_experts``."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)
        self.num_experts = num_experts
        self.num_local = num_experts // self.ep

    def __call__(self, experts: nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` (rows, dim) sorted by global expert, ``counts`` (E,) -> outputs, same order."""
        ep, local = self.ep, self.num_local
        with torch.no_grad():
            send_counts = counts.reshape(ep, local).to(torch.int64)
            recv_counts = torch.empty_like(send_counts)
            # Row i of recv_counts: how many rows rank i sends to each of this rank's experts.
            dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.group)
            in_splits = send_counts.sum(dim=1).tolist()
            out_splits = recv_counts.sum(dim=1).tolist()
            # Received rows are grouped by (source rank, local expert): regroup them by local
            # expert, keeping source-rank then token order (stable), and remember the way back.
            segment = torch.arange(ep * local, device=x.device).repeat_interleave(
                recv_counts.reshape(-1)
            )
            order = torch.argsort(segment % local, stable=True)
            inverse = torch.argsort(order)
        rows = all_to_all(x, out_splits, in_splits, self.group)
        y = experts(rows[order], recv_counts.sum(dim=0))
        return all_to_all(y[inverse], in_splits, out_splits, self.group)


def _shard_experts(experts: nn.Module, ep_mesh: DeviceMesh, mesh: DeviceMesh) -> None:
    """Make each expert weight a DTensor sharded on the expert dim over ``ep_mesh``: on ``mesh``
    = (ep,) or, when the weight is already tensor parallel on ``tp``, (ep, tp) keeping its TP
    placement. Runs on the meta device (no data moves)."""
    ep, ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for name, param in list(experts.named_parameters(recurse=False)):
        if isinstance(param, DTensor):  # TP first: (E, hidden/tp, dim) or (E, dim, hidden/tp)
            local, placements, shape = param.to_local(), (Shard(0), *param.placements), param.shape
        else:
            local, placements, shape = param.data, (Shard(0),), param.shape
        chunk = local.chunk(ep, dim=0)[ep_rank].contiguous()
        dt = DTensor.from_local(
            chunk, mesh, placements, run_check=False, shape=shape, stride=param.stride()
        )
        experts.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


def apply_expert_parallel(layers: Sequence[ExpertLayer], parallel_dims: ParallelDims) -> int:
    """Wire a model part's MoE ``layers`` for the parallel layout; returns how many it touched.

    Every MoE layer's aux loss counts tokens over the data x context ranks (whenever there are
    more than one, with or without EP). With EP, the experts are sharded over the ``ep`` mesh
    (after TP, which shards their hidden dim) and the all-to-all dispatcher is installed.
    """
    if parallel_dims.dp_degree * parallel_dims.cp > 1:
        group = parallel_dims.dp_cp_mesh.get_group()
        for moe in layers:
            moe.load_balance_group = group
    if not parallel_dims.ep_enabled:
        return len(layers)
    ep_mesh = parallel_dims.ep_mesh
    mesh = parallel_dims.mesh["ep", "tp"] if parallel_dims.tp_enabled else ep_mesh
    for moe in layers:
        num_experts = next(moe.experts.parameters()).shape[0]  # stacked on dim 0 by expert
        _shard_experts(moe.experts, ep_mesh, mesh)
        moe.dispatcher = ExpertParallelDispatcher(ep_mesh.get_group(), num_experts)
    return len(layers)
